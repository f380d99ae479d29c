"""The offset map of a key-ordered queue: lowest unfinished offset + what finished above it.

In key mode (``ordering="key"``) messages of different keys of one queue finish out of order, so
one committed offset cannot say what was handled. RocketMQ's concurrent consumer commits the
lowest offset not yet finished (``ProcessQueue.removeMessage`` returns ``msgTreeMap.firstKey()``,
or ``queueOffsetMax + 1`` once the tree is empty) and redelivers everything above it after a
failover. Confluent's Parallel Consumer adds an *offset map*: the offsets finished above the
committed one, encoded run-length or as a bitset (whichever is shorter), committed with it, so a
new owner skips them. mqorder does both:

* ``OffsetTracker`` (in memory, one per key-ordered run) knows every pulled offset, which of them
  finished, and the committed offset they imply;
* ``encode_done`` writes the finished-above offsets as ``<base>:r<runs>`` or ``<base>:b<hex>``,
  ``base`` being the committed offset the map is relative to; ``key_commit.lua`` stores it in the
  queue's state HASH (field ``done``) in the same fenced step as the offset, and refuses a map
  whose base is not the offset committed with it;
* ``decode_done`` reads it back at ``begin.lua`` time, and only if its base is still the
  committed offset: anything that moved the offset without the map (a queue-mode run, an
  operator's reset, retention skipping trimmed messages) voids it, which can only cause
  redeliveries, never a skipped message.

The map is bounded: it covers at most ``consume_concurrently_max_span`` offsets (pulling stops
past that span), so the bitset is at most a quarter of that many hex digits.

Why a finished offset above the committed one may be skipped without breaking per-key order: a
key's message finishes (SUCCESS or the DLQ) only after every earlier message of that key
finished, so whatever a new owner redelivers of a key comes before all that key's finished ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

#: Map kinds: run lengths (alternating unfinished/finished runs from ``base + 1``) or a bitset
#: (bit ``i`` set: ``base + 1 + i`` finished), whichever is shorter.
RUNS = "r"
BITS = "b"


def encode_done(base: int, done: Iterable[int]) -> str:
    """The finished offsets above ``base`` (ascending, all > ``base``), as stored; ``''`` if none."""
    offs = list(done)
    if not offs:
        return ""
    runs: list[int] = []
    nxt = base + 1  # first offset not described yet
    bits = 0
    for o in offs:
        if o < nxt:
            raise ValueError(f"done offsets must be ascending and above {base}; got {o} after {nxt - 1}")
        if runs and o == nxt:
            runs[-1] += 1  # extends the finished run
        else:
            runs.append(o - nxt)  # unfinished run (may be 0 only at the start)
            runs.append(1)
        nxt = o + 1
        bits |= 1 << (o - base - 1)
    as_runs = RUNS + ",".join(map(str, runs))
    as_bits = BITS + format(bits, "x")
    return f"{base}:{as_runs if len(as_runs) <= len(as_bits) else as_bits}"


def decode_done(raw: bytes | str | None, offset: int) -> set[int]:
    """Finished offsets above ``offset`` recorded in ``raw``; empty unless the map's base is
    ``offset`` (the map is void once anything else moved the offset) or when it is malformed."""
    if not raw:
        return set()
    s = raw.decode() if isinstance(raw, bytes) else raw
    head, _, body = s.partition(":")
    try:
        base = int(head)
        if base != offset or not body:
            return set()
        kind, data = body[0], body[1:]
        if kind == BITS:
            bits = int(data, 16)
            out = set()
            i = 0
            while bits:
                if bits & 1:
                    out.add(base + 1 + i)
                bits >>= 1
                i += 1
            return out
        if kind == RUNS:
            runs = [int(x) for x in data.split(",")]
            out = set()
            o = base + 1
            for j, n in enumerate(runs):
                if n < 0:
                    return set()
                if j % 2:
                    out.update(range(o, o + n))
                o += n
            return out
    except ValueError:
        return set()
    return set()


class OffsetTracker:
    """Which pulled offsets of one queue are still unfinished, for one key-ordered run.

    ``window`` holds every pulled offset from the committed one up, ascending (pulls read the
    stream forward); ``finish`` marks one; the committed offset is the window's first unfinished
    offset, or ``pulled_to`` once everything pulled finished (``removeMessage``'s rule).
    ``inherited`` are offsets a previous owner recorded as finished and this run has not pulled
    yet: skipped when pulled, and kept in every map this run writes until then.
    """

    def __init__(self, committed: int, inherited: set[int] | None = None) -> None:
        self.base = committed
        self.pulled_to = committed
        self.window: deque[int] = deque()
        self.finished: set[int] = set()
        self.inherited = set(inherited or ())
        self.skipped = 0

    def pulled(self, offset: int) -> bool:
        """Record a pulled offset; False if a previous owner finished it (do not hand it out)."""
        if offset < self.pulled_to:
            return False  # read twice (a pull overlapping the previous one): already tracked
        self.pulled_to = offset + 1
        if offset in self.inherited:
            self.inherited.discard(offset)
            self.skipped += 1
            self._advance()
            return False
        self.window.append(offset)
        return True

    def skip_to(self, offset: int) -> None:
        """Everything below ``offset`` not pulled yet is gone from the log (trimmed by retention):
        pulling goes on from there, and the base moves once the window before it finished."""
        if offset > self.pulled_to:
            self.pulled_to = offset
            self._advance()

    def finish(self, offset: int) -> None:
        self.finished.add(offset)
        self._advance()

    def _advance(self) -> None:
        w, f = self.window, self.finished
        while w and w[0] in f:
            f.discard(w.popleft())
        if w:
            self.base = w[0]
            return
        # Everything pulled finished: the lowest unfinished offset is the next one to pull, past
        # those a previous owner finished (not pulled yet, but known finished).
        base, inherited = self.pulled_to, self.inherited
        while base in inherited:
            base += 1
        self.base = base

    @property
    def span(self) -> int:
        """How far pulling ran ahead of the committed offset (``consume_concurrently_max_span``;
        negative while the committed offset is past inherited finished offsets not pulled yet)."""
        return self.pulled_to - self.base

    @property
    def unfinished(self) -> int:
        return len(self.window) - len(self.finished)

    def done_offsets(self) -> list[int]:
        """Offsets above the committed one that must not be redelivered, ascending: finished ones,
        gaps between pulled ones (trimmed from the log, or inherited and skipped), inherited ones."""
        out: list[int] = []
        add = out.append
        w, f = self.window, self.finished
        prev = self.base
        for o in w:
            if o == self.base:
                continue
            out.extend(range(prev + 1, o))  # not in the log, or finished by a previous owner
            if o in f:
                add(o)
            prev = o
        if w:
            out.extend(range(prev + 1, self.pulled_to))
        out.extend(sorted(o for o in self.inherited if o > self.base))
        return out

    def encoded(self) -> str:
        return encode_done(self.base, self.done_offsets())

"""The offset map of a key-ordered queue: lowest unfinished offset + what finished above it.

In key mode (``ordering="key"``) messages of different keys of one queue finish out of order, so
one committed offset cannot say what was handled. RocketMQ's concurrent consumer commits the
lowest offset not yet finished (``ProcessQueue.removeMessage`` returns ``msgTreeMap.firstKey()``,
or ``queueOffsetMax + 1`` once the tree is empty) and redelivers everything above it after a
failover. Confluent's Parallel Consumer adds an *offset map*: the offsets finished above the
committed one, encoded run-length or as a bitset (whichever is shorter), committed with it, so a
new owner skips them. mqorder does both:

* ``OffsetTracker`` (in memory, one per key-ordered run) knows which pulled offsets are still
  unfinished, and the committed offset they imply;
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

from bisect import bisect_left
from collections.abc import Iterable

#: Map kinds: run lengths (alternating unfinished/finished runs from ``base + 1``) or a bitset
#: (bit ``i`` set: ``base + 1 + i`` finished), whichever is shorter.
RUNS = "r"
BITS = "b"


def encode_done(base: int, done: Iterable[int]) -> str:
    """The finished offsets above ``base`` (ascending, all > ``base``), as stored; ``''`` if none."""
    intervals: list[tuple[int, int]] = []
    last = base
    for o in done:
        if o <= last:
            raise ValueError(f"done offsets must be ascending and above {base}; got {o} after {last}")
        if intervals and intervals[-1][1] == o:
            intervals[-1] = (intervals[-1][0], o + 1)
        else:
            intervals.append((o, o + 1))
        last = o
    return encode_intervals(base, intervals)


def encode_intervals(base: int, intervals: list[tuple[int, int]]) -> str:
    """Finished offsets above ``base`` given as ascending, disjoint, non-adjacent half-open
    intervals ``[a, b)`` with ``a > base``: the stored map, ``''`` if none. Its cost follows the
    number of intervals, not the span they cover."""
    if not intervals:
        return ""
    runs: list[int] = []
    bits = 0
    nxt = base + 1  # first offset not described yet
    for a, b in intervals:
        runs.append(a - nxt)  # unfinished run (0 only at the start)
        runs.append(b - a)  # finished run
        bits |= ((1 << (b - a)) - 1) << (a - base - 1)
        nxt = b
    as_runs = RUNS + ",".join(map(str, runs))
    as_bits = BITS + format(bits, "x")
    return f"{base}:{as_runs if len(as_runs) <= len(as_bits) else as_bits}"


#: A map reaching further than this above its base is malformed (``key_commit.lua`` stores at most
#: 64 KiB and a run's span stays within ``consume_concurrently_max_span``, at most 100,000): it
#: decodes to nothing rather than to a set that would not fit in memory.
MAX_DECODED_SPAN = 1 << 20


def decode_done(raw: bytes | str | None, offset: int) -> set[int]:
    """Finished offsets above ``offset`` recorded in ``raw``; empty unless the map's base is
    ``offset`` (the map is void once anything else moved the offset) or when it is malformed
    (an empty map only costs redeliveries)."""
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
            if bits < 0 or bits.bit_length() > MAX_DECODED_SPAN:  # "-1" looped for ever
                return set()
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
            if any(n < 0 for n in runs) or sum(runs) > MAX_DECODED_SPAN:
                return set()
            for j, n in enumerate(runs):
                if j % 2:
                    out.update(range(o, o + n))
                o += n
            return out
    except ValueError:
        return set()
    return set()


class OffsetTracker:
    """Which pulled offsets of one queue are still unfinished, for one key-ordered run.

    ``unfinished`` holds the pulled offsets not finished yet, ascending (pulls read the stream
    forward, so a pulled offset is appended; a finished one is removed wherever it is). The
    committed offset is its first element, or, once everything pulled finished, ``pulled_to``
    (``removeMessage``'s rule). Everything else below ``pulled_to`` finished, or is not in the
    log (trimmed), or was finished by a previous owner: none of it is to be redelivered.
    ``inherited`` are offsets a previous owner recorded as finished and this run has not pulled
    yet: skipped when pulled, and kept in every map this run writes until then.

    The list stays as short as the work in flight (calls running, messages waiting in lanes), so
    the map costs that much to encode, whatever the span.
    """

    def __init__(self, committed: int, inherited: set[int] | None = None) -> None:
        self.pulled_to = committed
        self.unfinished: list[int] = []
        self.inherited = set(inherited or ())
        self.skipped = 0
        self.base = committed
        self._advance()

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
        self.unfinished.append(offset)
        self._advance()
        return True

    def pulled_all(self, offsets: list[int]) -> bool:
        """``pulled`` for a whole read at once (ascending offsets), when none of it was read
        before or finished by a previous owner: every offset is to hand out. False, recording
        nothing, otherwise (then ``pulled`` each). Per read, not per message: the read's
        bookkeeping is one list extension."""
        if not offsets or self.inherited or offsets[0] < self.pulled_to:
            return False
        self.unfinished.extend(offsets)
        self.pulled_to = offsets[-1] + 1
        self._advance()
        return True

    def skip_to(self, offset: int) -> None:
        """Everything below ``offset`` not pulled yet is gone from the log (trimmed by retention):
        pulling goes on from there, and the base moves once the window before it finished."""
        if offset > self.pulled_to:
            self.pulled_to = offset
            self._advance()

    def finish(self, offset: int) -> None:
        u = self.unfinished
        i = bisect_left(u, offset)
        if i < len(u) and u[i] == offset:
            del u[i]
            if i == 0:
                self._advance()

    def _advance(self) -> None:
        if self.unfinished:
            self.base = self.unfinished[0]
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

    def done_intervals(self) -> list[tuple[int, int]]:
        """Offsets above the committed one that must not be redelivered, as ascending half-open
        intervals: what lies between unfinished ones below ``pulled_to`` (finished, or not in the
        log), then the inherited ones above."""
        out: list[tuple[int, int]] = []
        base = self.base
        prev = base + 1
        for u in self.unfinished:
            if u <= base:
                continue
            if u > prev:
                out.append((prev, u))
            prev = u + 1
        if self.unfinished and self.pulled_to > prev:
            out.append((prev, self.pulled_to))
        # Inherited offsets below pulled_to were never read back (trimmed since): nothing to say.
        for o in sorted(o for o in self.inherited if o >= self.pulled_to and o > base):
            if out and out[-1][1] == o:
                out[-1] = (out[-1][0], o + 1)
            else:
                out.append((o, o + 1))
        return out

    def done_offsets(self) -> list[int]:
        """``done_intervals`` as a list of offsets (for tests and small maps)."""
        return [o for a, b in self.done_intervals() for o in range(a, b)]

    def encoded(self) -> str:
        return encode_intervals(self.base, self.done_intervals())

"""``mqorder status GROUP [TOPIC] --key KEY``: is this key stuck, and on what?

``mqorder status`` answers per queue; an operator on call is usually handed one order id. This
module finds the key's queue with the producer's own default selector (``crc32(utf8(key)) mod
queue count``, ``mqorder.client.selector``: a producer with a custom selector puts keys elsewhere,
which nothing stored can tell), then reads, per group lane on that queue:

* the lane's state: committed offset, owner, lease, epoch, run, pending request, the last move of
  the offset (``commit_ms``) and, in key mode, the offsets finished above it (``done``);
* the head message (the first stored offset at or above the committed one): offset, age, message
  id and keys, its reconsume count, whether it is of this key, and the last error its listener
  raised if the engine recorded one (``error`` in the state hash, written by the commit that
  records the reconsume count);
* the backlog from the committed offset, up to ``scan`` messages (what it looked at is reported:
  a key further back than that is not seen), matched on the key hash every message carries
  (header ``h``): how many of the key's messages wait, the first of them, and in key mode whether
  the key is *parked* (its first unfinished message failed and waits for its retry).

Two round trips per broker (state, then head and backlog), read-only, no scripts. The match is
on the 32-bit hash: another key with the same crc32 (about one in 4 billion pairs) would be
counted too; ``mqorder message`` shows a message's keys and body when in doubt.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mqorder import keys
from mqorder.admin.clocked import clocked_reads
from mqorder.admin.common import Admin, BadArgumentError
from mqorder.admin.status import waiting_ms
from mqorder.client.selector import key_bytes, queue_index
from mqorder.consumer.offset_map import decode_done
from mqorder.errors import TopicNotFoundError
from mqorder.model import MessageQueue
from mqorder.store.replies import text

#: Default of ``--scan``: backlog messages read from the committed offset to look for the key.
DEFAULT_SCAN = 10_000
#: Hard cap of ``--scan``: one ``XRANGE`` of this many entries stays well under a second.
MAX_SCAN = 100_000

_STATE_FIELDS = ("owner", "lease", "epoch", "offset", "pending", "pend_until", "run", "assignee", "commit_ms",
                 "done", "error")


@dataclass(frozen=True)
class HeadMessage:
    """The message at the head of a lane's backlog (the next one its group consumes)."""

    offset: int
    msg_id: str
    msg_keys: list[str]
    age_ms: int
    reconsume_times: int
    of_this_key: bool
    #: The last error a listener raised on this message, as the engine recorded it, or None.
    last_error: str | None


@dataclass(frozen=True)
class LastError:
    """What the engine recorded of the last listener exception on a lane (``error`` field)."""

    offset: int
    at_ms: int
    text: str

    @classmethod
    def parse(cls, raw: str) -> LastError | None:
        """``<offset>|<ms>|<text>`` (``mqorder.consumer``'s failed-call record), None otherwise."""
        parts = raw.split("|", 2)
        if len(parts) != 3:
            return None
        try:
            return cls(int(parts[0]), int(parts[1]), parts[2])
        except ValueError:
            return None


@dataclass
class KeyLane:
    """Where one key stands in one group lane (``sub``) of its queue."""

    sub: str
    topic: str
    broker: str
    queue_id: int
    queue_count: int
    ordering: str  # "key" if the lane commits with an offset map (key_commit.lua), else "queue"
    max_offset: int
    committed: int
    first_offset: int
    owner: str  # holder of a live lock, "" if none
    lease_left_ms: int
    epoch: int
    assignee: str
    running: bool
    run_left_ms: int
    pending: bool
    commit_ms: int | None
    now_ms: int
    head: HeadMessage | None
    #: Backlog looked at: offsets [scan_from, scan_to); complete when scan_to reached the end.
    scan_from: int
    scan_to: int
    scan_complete: bool
    #: The key's unfinished messages found in the scanned backlog, in offset order (at most 20
    #: listed; ``waiting`` counts them all).
    waiting: int
    waiting_offsets: list[int] = field(default_factory=list)
    first_waiting_age_ms: int | None = None
    first_waiting_retries: int = 0
    #: Key mode: the key's first unfinished message failed and waits for its retry.
    parked: bool = False
    #: The last error recorded for the key's first waiting message, if the lane's last recorded
    #: error is of that message (one per lane is kept: the latest).
    first_waiting_error: str | None = None

    @property
    def lag(self) -> int:
        return max(0, self.max_offset - max(self.committed, self.first_offset))

    @property
    def stalled_ms(self) -> int:
        """How long the lane's backlog has waited without its offset moving (0 without one)."""
        head_ms = self.now_ms - self.head.age_ms if self.head else None
        return waiting_ms(self.lag, self.commit_ms, head_ms, self.now_ms) or 0

    @property
    def verdict(self) -> str:
        """One line: what the key waits for, if anything."""
        if not self.waiting:
            more = "" if self.scan_complete else f" in the first {self.scan_to - self.scan_from:,} of the backlog"
            return f"nothing of this key waits{more}"
        n = "1 message of this key waits" if self.waiting == 1 else f"{self.waiting:,} messages of this key wait"
        head = self.head
        if self.parked:
            return f"{n}; the key is parked: offset {self.waiting_offsets[0]} failed " \
                   f"{self.first_waiting_retries} time(s) and waits for its retry"
        if head is not None and self.ordering == "queue" and not head.of_this_key:
            return f"{n} behind offset {head.offset} (another key, {head.reconsume_times} retries): queue order"
        if head is not None and head.of_this_key and head.reconsume_times:
            return f"{n}; its message at the head (offset {head.offset}) failed {head.reconsume_times} time(s)"
        if not self.owner:
            return f"{n}; nobody holds the queue's lock"
        return f"{n}; the queue is being consumed" if self.running else f"{n}; no ConsumeRequest runs now"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(lag=self.lag, stalled_ms=self.stalled_ms, verdict=self.verdict)
        return out


@dataclass
class KeyReport:
    group: str
    key: str
    key_hash: int
    scan: int
    lanes: list[KeyLane] = field(default_factory=list)
    missing_topics: list[str] = field(default_factory=list)

    def stuck(self, stuck_after_ms: int) -> list[KeyLane]:
        """Lanes where the key waits and the backlog has not moved for over ``stuck_after_ms``."""
        return [ln for ln in self.lanes if ln.waiting and ln.stalled_ms > stuck_after_ms]

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "key": self.key, "key_hash": self.key_hash, "scan": self.scan,
                "missing_topics": self.missing_topics, "lanes": [ln.to_json() for ln in self.lanes]}


def key_status(admin: Admin, group: str, key: str, topic: str | None = None, scan: int = DEFAULT_SCAN) -> KeyReport:
    """Where ``key`` stands in every lane of ``group`` (on ``topic`` only, if given)."""
    if not key:
        raise BadArgumentError("--key must not be empty: give the sharding key the producer sent with "
                               "(an order id, an account), as text")
    if not 1 <= scan <= MAX_SCAN:
        raise BadArgumentError(f"--scan must be from 1 to {MAX_SCAN:,} messages, got {scan}")
    hash_ = _hash(key)
    report = KeyReport(group, key, hash_, scan)
    lanes: list[tuple[str, MessageQueue, int]] = []
    for t, model in sorted(admin.topics_of(group, topic).items()):
        try:
            mqs = admin.route(t).message_queues
        except TopicNotFoundError:  # subscribed, never created (or deleted)
            report.missing_topics.append(t)
            continue
        mq = mqs[queue_index(key, len(mqs))]
        lanes.extend((sub, mq, len(mqs)) for sub in admin.lanes(group, t, model))
    by_broker: dict[str, list[tuple[str, MessageQueue, int]]] = {}
    for lane in lanes:
        by_broker.setdefault(lane[1].broker_name, []).append(lane)
    found: dict[tuple[str, MessageQueue], KeyLane] = {}
    for broker, items in by_broker.items():
        found.update(_read_broker(admin, broker, items, hash_, scan))
    report.lanes = [found[(sub, mq)] for sub, mq, _ in lanes]
    return report


def _hash(key: str) -> int:
    """The key hash every message carries (header ``h``): ``mqorder.client.selector.key_hash``."""
    return zlib.crc32(key_bytes(key))


def _read_broker(admin: Admin, broker: str, lanes: list[tuple[str, MessageQueue, int]], hash_: int,
                 scan: int) -> dict[tuple[str, MessageQueue], KeyLane]:
    store = admin.brokers.get(broker)
    first = clocked_reads(store, lanes, lambda ln: ln[1].tag, lambda ln: (
        ("GET", keys.queue_next(ln[1].tag)),
        ("HMGET", keys.sub_state(ln[1].tag, ln[0]), *_STATE_FIELDS),
        ("XRANGE", keys.queue_log(ln[1].tag), "-", "+", "COUNT", 1),
    ))
    states = []
    for c in first:
        nxt, raw, head = c.replies
        st = dict(zip(_STATE_FIELDS, raw, strict=True))
        states.append((int(nxt or 0), st, _offset(head[0]) if head else int(nxt or 0)))
    # The backlog of each lane, from its committed offset (or the first one still stored), and
    # the reconsume counts recorded for it (only uncommitted offsets have one: a small hash).
    second = clocked_reads(store, list(range(len(lanes))), lambda i: lanes[i][1].tag, lambda i: (
        ("XRANGE", keys.queue_log(lanes[i][1].tag), max(_int(states[i][1]["offset"]), states[i][2]), "+",
         "COUNT", scan),
        ("HGETALL", keys.sub_retries(lanes[i][1].tag, lanes[i][0])),
    ))
    out = {}
    for i, (sub, mq, count) in enumerate(lanes):
        nxt, st, first_offset = states[i]
        entries, raw_retries = second[i].replies
        now = second[i].now_ms
        committed = _int(st["offset"])
        retries = _retries(raw_retries)
        done = decode_done(st["done"], committed)
        lease, run = _int(st["lease"]), _int(st["run"])
        live = bool(st["owner"]) and lease > now
        error = LastError.parse(text(st["error"])) if st["error"] else None
        lane = KeyLane(
            sub=sub, topic=mq.topic, broker=mq.broker_name, queue_id=mq.queue_id, queue_count=count,
            ordering="key" if st["done"] is not None else "queue", max_offset=nxt, committed=committed,
            first_offset=first_offset, owner=text(st["owner"]) if live else "",
            lease_left_ms=lease - now if live else 0, epoch=_int(st["epoch"]), assignee=text(st["assignee"]),
            running=run > now, run_left_ms=max(0, run - now),
            pending=bool(st["pending"]) and _int(st["pend_until"]) >= now,
            commit_ms=_int(st["commit_ms"]) or None, now_ms=now, head=None,
            scan_from=max(committed, first_offset), scan_to=max(committed, first_offset), scan_complete=True,
            waiting=0,
        )
        _scan(lane, entries, hash_, retries, done, error, scan)
        out[(sub, mq)] = lane
    return out


def _scan(lane: KeyLane, entries: list[Any], hash_: int, retries: dict[int, int], done: set[int],
          error: LastError | None, scan: int) -> None:
    """Fill the head and the key's waiting messages of ``lane`` from its backlog ``entries``."""
    for entry in entries:
        offset = _offset(entry)
        if offset in done:  # key mode: finished above the committed offset
            continue
        f = entry[1]
        fields = dict(zip(f[::2], f[1::2], strict=False))
        header = orjson.loads(fields.get(b"h") or b"{}")
        stored = _int(fields.get(b"s"))
        mine = header.get("h") == hash_
        if lane.head is None:
            err = error.text if error is not None and error.offset == offset else None
            lane.head = HeadMessage(offset, str(header.get("i", "")), list(header.get("k") or []),
                                    max(0, lane.now_ms - stored) if stored else 0, retries.get(offset, 0), mine, err)
        if mine:
            if not lane.waiting:
                lane.first_waiting_age_ms = max(0, lane.now_ms - stored) if stored else None
                lane.first_waiting_retries = retries.get(offset, 0)
                lane.parked = lane.ordering == "key" and lane.first_waiting_retries > 0
                lane.first_waiting_error = error.text if error is not None and error.offset == offset else None
            lane.waiting += 1
            if len(lane.waiting_offsets) < 20:
                lane.waiting_offsets.append(offset)
    if entries:
        lane.scan_to = _offset(entries[-1]) + 1
    lane.scan_complete = len(entries) < scan or lane.scan_to >= lane.max_offset


def _retries(raw: Any) -> dict[int, int]:
    """offset -> reconsume count from ``HGETALL`` (a map under RESP3, a flat list under RESP2)."""
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=False) if raw else ()
    return {int(k): int(v) for k, v in pairs}


def _offset(entry: Any) -> int:
    return int(text(entry[0]).split("-", 1)[0])


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


# -- human output ------------------------------------------------------------------------------------


def render(console: Console, report: KeyReport) -> None:
    """One block per lane: where the key's queue stands, its head, what of the key waits."""
    from mqorder.admin.render import ago, duration

    for missing in report.missing_topics:
        console.print(f"[yellow]{report.group} subscribes to topic {missing!r}, which does not exist")
    for ln in report.lanes:
        t = Table(title=f"key {escape(report.key)!r} (crc32 {report.key_hash}) of group {escape(ln.sub)}",
                  show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        looked = f"offsets {ln.scan_from:,}..{ln.scan_to:,}" + (" (the whole backlog)" if ln.scan_complete
                                                                 else f" (stopped at --scan {report.scan:,})")
        rows = [
            ("queue", f"{ln.topic}:{ln.broker}:{ln.queue_id} (queue {ln.queue_id} of {ln.queue_count}, "
                      f"crc32 mod {ln.queue_count}); {ln.ordering} order"),
            ("offsets", f"committed {ln.committed:,}, max {ln.max_offset:,}, lag {ln.lag:,}; last commit "
                        f"{ago(ln.commit_ms, ln.now_ms)}; stalled {duration(ln.stalled_ms) if ln.stalled_ms else '-'}"),
            ("owner", f"{ln.owner or '- (no live lock)'}; lease {duration(ln.lease_left_ms) if ln.owner else '-'}; "
                      f"epoch {ln.epoch}; run {'running, ' + duration(ln.run_left_ms) + ' left' if ln.running else '-'}"
                      f"{'; request pending' if ln.pending else ''}"),
            ("head", _head_line(ln, duration)),
            ("last error", _error_line(ln)),
            ("scanned", looked),
            ("key waiting", f"{ln.waiting:,}" + (f" at offsets {', '.join(map(str, ln.waiting_offsets))}"
                                                  f"{' ...' if ln.waiting > len(ln.waiting_offsets) else ''}"
                                                  if ln.waiting else "")),
            ("first of key", "-" if not ln.waiting else
             f"offset {ln.waiting_offsets[0]}, waiting {duration(ln.first_waiting_age_ms)}, "
             f"{ln.first_waiting_retries} retries" + ("; PARKED (key mode)" if ln.parked else "")),
            ("verdict", ln.verdict),
        ]
        for name, value in rows:
            t.add_row(name, escape(value))
        console.print(t)


def _error_line(ln: KeyLane) -> str:
    """What the listener last raised on the head, or on the key's first waiting message."""
    if ln.head is not None and ln.head.last_error:
        return f"{ln.head.last_error} (offset {ln.head.offset})"
    if ln.first_waiting_error:
        return f"{ln.first_waiting_error} (offset {ln.waiting_offsets[0]})"
    return "- (none recorded)"


def _head_line(ln: KeyLane, duration: Any) -> str:
    h = ln.head
    if h is None:
        return "- (caught up)"
    whose = "this key" if h.of_this_key else "another key"
    ks = f", keys {','.join(h.msg_keys)}" if h.msg_keys else ""
    return (f"offset {h.offset:,} ({whose}), waiting {duration(h.age_ms)}, {h.reconsume_times} retries, "
            f"id {h.msg_id}{ks}")

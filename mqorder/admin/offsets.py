"""``mqorder offsets reset GROUP TOPIC --to earliest|latest|OFFSET|TIME``: RocketMQ's
``resetOffsetByTime``, fenced.

The new offset of each queue is computed here (a time maps to the first offset stored at or after
it, found by binary search over the stream entries' store time ``s``, which ``_append.lua`` writes
from Redis's clock), then written by ``reset_offset.lua``, one call per broker (per slot on a
Redis Cluster, all in one round trip), which in the same step bumps the epoch, releases the lock
and pending request and clears the reconsume counts (the race it closes is in that script's
header). Then the topology version is bumped, so the workers
rebalance at once and dispatch a ConsumeRequest that starts at the new offset.

A group that does not subscribe to the topic yet (no consumer of it ever started) is recorded
as subscribing to it (clustering), as a PullConsumer's ``subscribe`` records it, and then reset:
``--to latest`` before its first consumer starts is how a new group starts at the end of a topic
(RocketMQ's ``CONSUME_FROM_LAST_OFFSET``, Kafka's ``--reset-offsets`` of a new group); mqorder
starts a new group at the first stored message otherwise.

Refused while consumers of the group are live unless forced: a forced reset is safe for the
offsets (a running owner's later commit is refused), but the listener call it is in still
finishes, and may overlap the first call of the new run, as after a takeover from a paused holder.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from mqorder import keys
from mqorder.admin.common import Admin, BadArgumentError, RefusedError
from mqorder.model import MessageModel, MessageQueue
from mqorder.names import check_name
from mqorder.store.brokers import group_by_broker
from mqorder.store.log import MessageLog
from mqorder.store.replies import text

EARLIEST = "earliest"
LATEST = "latest"
_OFFSET_RE = re.compile(r"[0-9]+")
_EPOCH_MS_RE = re.compile(r"@([0-9]+)")


@dataclass(frozen=True)
class Target:
    """Where to reset to: ``kind`` is ``earliest``, ``latest``, ``offset`` or ``time`` (ms)."""

    kind: str
    value: int = 0

    @classmethod
    def parse(cls, raw: str) -> Target:
        """``earliest``, ``latest``, an offset (``1500``), an ISO 8601 time
        (``2025-01-31T12:00:00Z``; no zone means this machine's local time) or ``@<epoch ms>``."""
        s = raw.strip()
        if s.lower() in (EARLIEST, LATEST):
            return cls(s.lower())
        if _OFFSET_RE.fullmatch(s):
            return cls("offset", int(s))
        m = _EPOCH_MS_RE.fullmatch(s)
        if m:
            return cls("time", _checked_ms(raw, int(m.group(1))))
        try:
            when = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
            ms = int(when.timestamp() * 1000)
        except (ValueError, OverflowError, OSError):  # OverflowError/OSError: year 1 in a local zone
            raise BadArgumentError(
                f"--to {raw!r} is not earliest, latest, an offset (e.g. 1500), an ISO 8601 time "
                "(e.g. 2025-01-31T12:00:00Z) or @<epoch ms> (e.g. @1738324800000)"
            ) from None
        return cls("time", _checked_ms(raw, ms))


#: The latest time ``--to`` takes (the year 9999): a larger ``@`` value is a unit mistake (seconds
#: given as µs or ns), refused before anything is written. Once such a reset was applied, and only
#: printing its time then failed (exit 1, "nothing changed", after the offsets had moved).
MAX_TIME_MS = 253402300799999


def _checked_ms(raw: str, ms: int) -> int:
    if not 0 <= ms <= MAX_TIME_MS:
        raise BadArgumentError(
            f"--to {raw!r} is {ms:,} ms since the epoch, outside 1970..9999: milliseconds are expected "
            "(e.g. @1738324800000 for 2025-01-31T12:00:00Z)"
        )
    return ms


@dataclass(frozen=True)
class QueueReset:
    sub: str
    topic: str
    broker: str
    queue_id: int
    min_offset: int
    max_offset: int
    old_offset: int
    new_offset: int
    epoch: int = 0  # the epoch after the reset (0 in a dry run)
    owner: str = ""  # who held a live lock when it was reset (its run is fenced)

    @property
    def mq(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker, self.queue_id)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ResetReport:
    group: str
    topic: str
    target: Target
    live_consumers: list[str]
    queues: list[QueueReset] = field(default_factory=list)
    dry_run: bool = False
    #: The group did not subscribe to the topic (a new group): the reset recorded the subscription
    #: (clustering) first, so its consumers start from the new offsets (a dry run only says so).
    subscribed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "topic": self.topic, "to": asdict(self.target),
                "live_consumers": self.live_consumers, "dry_run": self.dry_run, "subscribed": self.subscribed,
                "queues": [q.to_json() for q in self.queues]}


def reset(
    admin: Admin, group: str, topic: str, to: Target, *, force: bool = False, dry_run: bool = False
) -> ResetReport:
    """Reset ``group``'s offsets on ``topic``; ``RefusedError`` while its consumers are live
    unless ``force`` (nothing changed then)."""
    mqs = admin.route(topic).message_queues  # an unknown topic says so first
    known = admin.topics.groups().get(group, {})
    model = known.get(topic, MessageModel.CLUSTERING)
    live, _, _ = admin.consumers_of(group)
    report = ResetReport(group, topic, to, sorted(c.client_id for c in live), dry_run=dry_run,
                         subscribed=topic not in known)
    if report.subscribed:
        check_name("group", group)  # a new group's name, refused before anything is written
    if live and not force and not dry_run:
        raise RefusedError(
            f"{len(live)} consumer(s) of group {group!r} are live ({', '.join(report.live_consumers)}); stop them "
            "first, or pass --force: their running ConsumeRequests are fenced (their commits refused) and "
            "consumption restarts from the new offset"
        )
    if report.subscribed and not dry_run:
        # A group with no consumer yet (RocketMQ's CONSUME_FROM_LAST_OFFSET, Kafka's reset of a new
        # group): recorded as a PullConsumer's subscribe records it, so the offsets written below
        # are the group's, its consumers start from them, and retention holds what it has not read.
        admin.topics.subscribe(group, topic, MessageModel.CLUSTERING)
    subs = admin.lanes(group, topic, model)
    if not subs:
        raise BadArgumentError(
            f"broadcasting group {group!r} has no registered client on {topic!r}: each client keeps its own offsets, "
            "created when it starts; there is nothing to reset"
        )
    plan = [_plan(admin, sub, mq, to) for sub in subs for mq in mqs]
    if dry_run:
        report.queues = plan
        return report
    report.queues = _apply(admin, plan)
    admin.brokers.meta.incr(keys.topology_version())
    return report


def _plan(admin: Admin, sub: str, mq: MessageQueue, to: Target) -> QueueReset:
    log = MessageLog(admin.brokers)
    lo, hi = log.min_offset(mq), log.max_offset(mq)
    old = log.consume_offset(sub, mq)
    if to.kind == EARLIEST:
        new = lo
    elif to.kind == LATEST:
        new = hi
    elif to.kind == "offset":
        new = min(max(to.value, lo), hi)  # RocketMQ clamps to [min, max] as well
    else:
        new = offset_at_time(admin, mq, to.value, lo, hi)
    return QueueReset(sub, mq.topic, mq.broker_name, mq.queue_id, lo, hi, old, new)


def offset_at_time(admin: Admin, mq: MessageQueue, ms: int, lo: int, hi: int) -> int:
    """The first offset in ``[lo, hi)`` whose message was stored at or after ``ms`` (``hi`` if
    none): a binary search over the store times, one ``XRANGE`` per step (about 20 for 1M).

    Store times come from Redis's clock at append, so they do not decrease along a queue (unless
    that clock was set back). Each step reads the first entry at or after the middle offset, so
    missing offsets (none today; a trimmed log later) cost nothing.
    """
    client = admin.client(mq)
    log_key = keys.queue_log(mq.tag)
    answer, a, b = hi, lo, hi
    while a < b:
        mid = (a + b) // 2
        entries = client.xrange(log_key, min=str(mid), count=1)
        offset, stored = _offset_and_store_ms(entries[0]) if entries else (b, 0)
        if offset >= b:  # nothing stored in [mid, b)
            b = mid
        elif stored >= ms:
            answer, b = offset, mid
        else:
            a = offset + 1
    return answer


def _offset_and_store_ms(entry: Any) -> tuple[int, int]:
    entry_id, fields = entry
    f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=False))
    return int(text(entry_id).split("-", 1)[0]), int(text(f.get(b"s")) or 0)


def _apply(admin: Admin, plan: list[QueueReset]) -> list[QueueReset]:
    """``reset_offset.lua`` in one round trip per broker; the plan's rows with the old offset as
    the script read it, the new epoch and the owner whose run it fenced.

    One call per broker on a plain Redis. On a Redis Cluster a script's keys must share one slot,
    so there is one call per slot (``Broker.slot_batches``: each queue's keys share its hash tag),
    all sent in the one pipelined round trip (per node, every node at once). Each queue is still
    reset atomically with its fence; no queue's reset depended on another's.
    """
    done: dict[tuple[str, MessageQueue], QueueReset] = {}
    for broker_name, items in group_by_broker(plan, lambda q: q.mq).items():
        broker = admin.brokers.get(broker_name)
        batches = broker.slot_batches(items, lambda q: q.mq.tag)
        calls = [(_reset_keys(batch), [q.new_offset for q in batch]) for batch in batches]
        replies = broker.scripts.run_pipelined("reset_offset", calls)
        for batch, res in zip(batches, replies, strict=True):
            for q, (old, epoch, owner) in zip(batch, res, strict=True):
                done[(q.sub, q.mq)] = replace(q, old_offset=int(old), epoch=int(epoch), owner=text(owner))
    return [done[(q.sub, q.mq)] for q in plan]


def _reset_keys(batch: list[QueueReset]) -> list[str]:
    """``reset_offset.lua``'s KEYS: (state HASH, retries HASH) per queue, in the batch's order."""
    out: list[str] = []
    for q in batch:
        tag = q.mq.tag
        out += [keys.sub_state(tag, q.sub), keys.sub_retries(tag, q.sub)]
    return out

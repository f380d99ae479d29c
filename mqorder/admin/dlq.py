"""``mqorder dlq list|show|replay GROUP``: what is in ``%DLQ%<group>``, and putting it back.

A dead letter keeps the original body, keys, tags and properties, and ``ORIGIN_*`` / ``DLQ_*``
properties saying where it came from and why (``mqorder.consumer.dlq``). Replay appends each one
again, through the one append path (``QueueAppender``), to its original queue (or to a queue of a
topic given: the same broker and queue id when the topic has it, else the queue id modulo the
topic's queue count, so messages that shared a queue still share one), in their original order:
per origin queue by origin offset. Dead letters stay in the DLQ (as in RocketMQ); each replayed
copy carries the id ``dlq-replay:<group>:<dlq offset>`` in its queue's idempotency ids, so a replay
run twice, or a run retried after a failure, adds nothing twice.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mqorder import keys
from mqorder.admin.common import Admin, BadArgumentError, message_at
from mqorder.codec import encode_header
from mqorder.consumer.retry import RETRY_PROPERTIES
from mqorder.errors import TopicNotFoundError
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.append import MAX_PER_CALL, AppendRequest, QueueAppender
from mqorder.store.log import MessageLog

#: Properties the DLQ writer adds (``DeadLetterWriter._header``) and the retry history of a message
#: that came through the retry topic (``mqorder.consumer.retry``); a replayed copy drops them.
DLQ_PROPERTIES = frozenset({
    "ORIGIN_TOPIC", "ORIGIN_BROKER", "ORIGIN_QUEUE_ID", "ORIGIN_QUEUE_OFFSET", "ORIGIN_MSG_ID",
    "RECONSUME_TIMES", "DLQ_REASON", "DLQ_EPOCH", "DLQ_CLIENT", "ORIGIN_METADATA_DROPPED",
}) | RETRY_PROPERTIES
#: Set on a replayed copy: the DLQ offset it was replayed from.
REPLAYED_FROM = "DLQ_REPLAYED_FROM"
#: Dead letters read per ``XRANGE``.
PAGE = 1000


def body_json(body: bytes) -> dict[str, Any]:
    """A body for JSON output: ``body`` as text when it is UTF-8, else ``body_base64``."""
    try:
        return {"body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body_base64": base64.b64encode(body).decode("ascii")}


@dataclass(frozen=True)
class DeadLetter:
    """One message of ``%DLQ%<group>``."""

    dlq_offset: int
    origin_topic: str
    origin_broker: str
    origin_queue_id: int | None
    origin_offset: int | None
    origin_msg_id: str
    reason: str
    reconsume_times: int | None
    epoch: int | None
    client: str
    stored_ms: int
    keys: list[str]
    tags: str | None
    properties: dict[str, str]  # the original's own properties (DLQ_PROPERTIES removed)
    body: bytes
    #: The original's sharding key hash (header ``h``): a replayed copy keeps its key.
    key_hash: int | None = None

    @classmethod
    def of(cls, msg: MessageExt) -> DeadLetter:
        p = msg.properties if isinstance(msg.properties, dict) else {}
        return cls(
            dlq_offset=msg.queue_offset, origin_topic=p.get("ORIGIN_TOPIC", ""),
            origin_broker=p.get("ORIGIN_BROKER", ""), origin_queue_id=_opt_int(p.get("ORIGIN_QUEUE_ID")),
            origin_offset=_opt_int(p.get("ORIGIN_QUEUE_OFFSET")), origin_msg_id=p.get("ORIGIN_MSG_ID", ""),
            reason=p.get("DLQ_REASON", msg.decode_error or ""), reconsume_times=_opt_int(p.get("RECONSUME_TIMES")),
            epoch=_opt_int(p.get("DLQ_EPOCH")), client=p.get("DLQ_CLIENT", ""), stored_ms=msg.store_timestamp,
            keys=list(msg.keys) if isinstance(msg.keys, list) else [],
            tags=msg.tags if isinstance(msg.tags, str) else None,
            properties={k: v for k, v in p.items() if k not in DLQ_PROPERTIES}, body=msg.body,
            key_hash=msg.key_hash if type(msg.key_hash) is int else None,
        )

    @property
    def origin_queue(self) -> MessageQueue | None:
        if not self.origin_topic or not self.origin_broker or self.origin_queue_id is None:
            return None
        return MessageQueue(self.origin_topic, self.origin_broker, self.origin_queue_id)

    def to_json(self, with_body: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dlq_offset": self.dlq_offset, "origin_topic": self.origin_topic, "origin_broker": self.origin_broker,
            "origin_queue_id": self.origin_queue_id, "origin_offset": self.origin_offset,
            "origin_msg_id": self.origin_msg_id, "reason": self.reason, "reconsume_times": self.reconsume_times,
            "epoch": self.epoch, "client": self.client, "stored_ms": self.stored_ms, "keys": self.keys,
            "tags": self.tags, "properties": self.properties, "body_bytes": len(self.body),
        }
        if with_body:
            out.update(body_json(self.body))
        return out


def _opt_int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def dlq_queue(admin: Admin, group: str) -> MessageQueue:
    """The one queue of ``%DLQ%<group>``; ``GroupNotFoundError`` if neither exists."""
    topic = keys.dlq_topic(group)
    try:
        return admin.route(topic).message_queues[0]
    except TopicNotFoundError:
        admin.group_topics(group)  # an unknown group says so
        return MessageQueue(topic, admin.brokers.default_name, 0)


# -- list and show -----------------------------------------------------------------------------------


@dataclass
class DlqPage:
    group: str
    topic: str
    min_offset: int
    max_offset: int
    messages: list[DeadLetter] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.max_offset - self.min_offset

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "topic": self.topic, "total": self.total, "min_offset": self.min_offset,
                "max_offset": self.max_offset, "messages": [m.to_json(with_body=False) for m in self.messages]}


def dlq_list(admin: Admin, group: str, start: int = 0, limit: int = 50) -> DlqPage:
    """Up to ``limit`` dead letters from DLQ offset ``start``, without their bodies."""
    mq = dlq_queue(admin, group)
    log = MessageLog(admin.brokers)
    page = DlqPage(group, mq.topic, log.min_offset(mq), log.max_offset(mq))
    page.messages = [DeadLetter.of(m) for m in log.read(mq, max(start, page.min_offset), limit)] if limit else []
    return page


def dlq_show(admin: Admin, group: str, offset: int) -> DeadLetter:
    mq = dlq_queue(admin, group)
    return DeadLetter.of(message_at(admin, mq, offset, mq.topic, f" (see `mqorder dlq list {group}`)"))


def iter_dead_letters(admin: Admin, mq: MessageQueue, start: int = 0, end: int | None = None) -> Iterator[DeadLetter]:
    """Dead letters with DLQ offsets in ``[start, end]`` (``end`` None: to the last one), in order."""
    log = MessageLog(admin.brokers)
    nxt = start
    while end is None or nxt <= end:
        count = PAGE if end is None else min(PAGE, end - nxt + 1)
        msgs = log.read(mq, nxt, count)
        for m in msgs:
            if end is not None and m.queue_offset > end:
                return
            yield DeadLetter.of(m)
        if len(msgs) < count:
            return
        nxt = msgs[-1].queue_offset + 1


# -- replay ----------------------------------------------------------------------------------------


@dataclass
class ReplayReport:
    group: str
    read: int = 0
    stored: int = 0
    duplicates: int = 0  # replayed by an earlier run: not stored again
    #: Dead letters of a message another dead letter in the range already stands for (the same
    #: origin queue, offset and msg id: one per client of a broadcasting group), not replayed.
    same_origin: int = 0
    by_queue: dict[str, int] = field(default_factory=dict)  # queue key -> messages stored there
    dry_run: bool = False
    #: Target topic -> the other groups that consume it (each gets its own copy of what is replayed).
    other_groups: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "read": self.read, "stored": self.stored, "duplicates": self.duplicates,
                "same_origin": self.same_origin, "by_queue": self.by_queue, "dry_run": self.dry_run,
                "other_groups": self.other_groups}


def replay_id(group: str, dlq_offset: int) -> str:
    """The idempotency id of a dead letter's replayed copy: a rerun finds it in the target queue."""
    return f"dlq-replay:{group}:{dlq_offset}"


def replay(
    admin: Admin, group: str, *, topic: str | None = None, start: int = 0, end: int | None = None,
    dry_run: bool = False, all_groups: bool = False,
) -> ReplayReport:
    """Append the dead letters with DLQ offsets in ``[start, end]`` back onto their queues.

    Every target is resolved before anything is written: a dead letter with no origin, an origin
    topic that no longer exists or a read-only target refuses the whole replay (``BadArgumentError``)
    so nothing is half-replayed by a refusal.

    A copy appended to a topic is delivered to every group that consumes it, not only to
    ``group`` (RocketMQ's console resends a dead letter to the one group's clients instead). Another
    group would get a message it handled long ago a second time, after the messages that followed
    it: so a target topic other groups consume refuses the replay unless ``all_groups`` accepts
    that (a dry run lists them, ``ReplayReport.other_groups``).
    """
    if end is not None and end < start:
        raise BadArgumentError(f"--from {start} is after --to {end}: no dead letter lies between; nothing was replayed")
    dq = dlq_queue(admin, group)
    read = list(iter_dead_letters(admin, dq, start, end))
    letters = _one_per_origin(read)
    report = ReplayReport(group, read=len(read), dry_run=dry_run, same_origin=len(read) - len(letters))
    targets = _targets(admin, letters, topic)
    plan = _in_original_order(letters, targets)
    report.other_groups = _other_groups(admin, group, {mq.topic for mq in plan})
    if report.other_groups and not (all_groups or dry_run):
        shown = "; ".join(f"{t}: {', '.join(gs)}" for t, gs in sorted(report.other_groups.items()))
        raise BadArgumentError(
            f"other groups consume the topic(s) the dead letters of {group!r} go back to ({shown}): each of them "
            "would get a second copy of every replayed message (its original msg id), after the messages that "
            f"followed it. Pass --all-groups to replay anyway (listeners that drop a msg id they handled are "
            f"unaffected), or --topic onto a topic only {group!r} consumes; nothing was replayed"
        )
    if dry_run:
        for mq, items in plan.items():
            report.by_queue[mq.key] = len(items)
        return report
    s = admin.settings
    appender = QueueAppender(admin.brokers, pending_ttl_ms=s.pending_ttl_ms, timeout=s.send_msg_timeout_ms / 1000,
                             action="DLQ replay")
    requests: list[AppendRequest] = []
    for mq, items in plan.items():
        for c in range(0, len(items), MAX_PER_CALL):
            chunk = items[c : c + MAX_PER_CALL]
            entries = [(_header(d, group), d.body) for d in chunk]
            requests.append(AppendRequest(mq, entries, [replay_id(group, d.dlq_offset) for d in chunk]))
    for req, reply in zip(requests, appender.append_many(requests), strict=True):
        report.stored += reply.stored
        report.duplicates += reply.duplicates
        report.by_queue[req.mq.key] = report.by_queue.get(req.mq.key, 0) + reply.stored
    return report


def _one_per_origin(letters: list[DeadLetter]) -> list[DeadLetter]:
    """The first dead letter of each original message (origin queue, offset and msg id). Each
    client of a broadcasting group dead-letters the same message itself, and a replay appended
    every copy: with N clients each of them got the message N times, and every other group too (a
    broadcast walk-through). A new owner may also write a dead letter again after a failover."""
    seen: set[tuple[str, int, str]] = set()
    out: list[DeadLetter] = []
    for d in letters:
        origin = d.origin_queue
        if origin is not None and d.origin_offset is not None:
            mark = (origin.key, d.origin_offset, d.origin_msg_id)
            if mark in seen:
                continue
            seen.add(mark)
        out.append(d)
    return out


def _other_groups(admin: Admin, group: str, topics: set[str]) -> dict[str, list[str]]:
    """Topic -> the groups other than ``group`` subscribed to it (by their subscriptions, and by the
    lanes on its queues: a broadcast group's clients)."""
    out: dict[str, list[str]] = {}
    subscribed = admin.topics.groups()
    for t in sorted(topics):
        lanes = {keys.group_of_sub(s) for s in admin.topics.subs_of_topic(t)}
        others = sorted((lanes | {g for g, ts in subscribed.items() if t in ts}) - {group})
        if others:
            out[t] = others
    return out


def _targets(admin: Admin, letters: list[DeadLetter], topic: str | None) -> dict[int, MessageQueue]:
    """DLQ offset -> the queue its copy goes to; refuses (nothing written) what cannot be placed."""
    routes: dict[str, list[MessageQueue] | None] = {}

    def queues_of(t: str) -> list[MessageQueue] | None:
        if t not in routes:
            try:
                route = admin.route(t)
            except TopicNotFoundError:
                routes[t] = None
            else:
                if not route.writable:
                    raise BadArgumentError(
                        f"topic {t!r} is read-only (permission {route.perm!r}); nothing was replayed"
                    )
                routes[t] = route.message_queues
        return routes[t]

    out: dict[int, MessageQueue] = {}
    problems: list[str] = []
    for d in letters:
        origin = d.origin_queue
        if topic is None and origin is None:
            problems.append(f"offset {d.dlq_offset}: no origin queue recorded")
            continue
        name = topic or d.origin_topic
        queues = queues_of(name)
        if queues is None:
            problems.append(f"offset {d.dlq_offset}: topic {name!r} does not exist")
            continue
        if origin is not None and MessageQueue(name, origin.broker_name, origin.queue_id) in queues:
            out[d.dlq_offset] = MessageQueue(name, origin.broker_name, origin.queue_id)
        else:
            out[d.dlq_offset] = queues[(origin.queue_id if origin else 0) % len(queues)]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise BadArgumentError(
            f"cannot replay {len(problems)} dead letter(s): {shown}. Replay them onto an existing topic with "
            "--topic, or narrow the range with --from/--to; nothing was replayed"
        )
    return out


def _in_original_order(
    letters: list[DeadLetter], targets: dict[int, MessageQueue]
) -> dict[MessageQueue, list[DeadLetter]]:
    """Per target queue, the dead letters in DLQ order, except that the letters of each origin
    queue take that queue's slots sorted by origin offset (a letter dead-lettered twice, after a
    replay, returns to its place)."""
    plan: dict[MessageQueue, list[DeadLetter]] = defaultdict(list)
    for d in letters:
        plan[targets[d.dlq_offset]].append(d)
    for mq, items in plan.items():
        slots: dict[str, list[int]] = defaultdict(list)
        for i, d in enumerate(items):
            slots[_origin_key(d)].append(i)
        ordered = list(items)
        for idxs in slots.values():
            by_origin = sorted((items[i] for i in idxs), key=lambda d: (d.origin_offset or 0, d.dlq_offset))
            for i, d in zip(idxs, by_origin, strict=True):
                ordered[i] = d
        plan[mq] = ordered
    return dict(plan)


def _origin_key(d: DeadLetter) -> str:
    origin = d.origin_queue
    return origin.key if origin else ""


def _header(d: DeadLetter, group: str) -> bytes:
    """The replayed copy's header: the original id, keys, tags and properties, and where it came
    from (``DLQ_REPLAYED_FROM``). Its born time is the replay's."""
    props = dict(d.properties)
    props[REPLAYED_FROM] = f"{keys.dlq_topic(group)}@{d.dlq_offset}"
    return encode_header(d.origin_msg_id or replay_id(group, d.dlq_offset), d.keys, d.tags, props,
                         key_hash=d.key_hash)

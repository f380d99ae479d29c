"""``mqorder message show TOPIC --queue Q --offset O`` / ``--msg-id ID``: RocketMQ's
``queryMsgByOffset`` and ``queryMsgById``.

By offset, one ``XRANGE`` reads the entry. By id, there is no index to ask (RocketMQ's broker
keeps one; mqorder's ids HASH holds only idempotent appends), so every queue of the topic is
scanned page by page, looking for the id in the raw header bytes before decoding a candidate. That reads the whole topic in the worst case, so the caller warns first.

Each message comes with what every group subscribed to the topic made of it: consumed (its
committed offset is past it), waiting, or retrying (the head message, with its reconsume count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from mqorder import keys
from mqorder.admin.common import Admin, BadArgumentError, message_at
from mqorder.admin.dlq import body_json
from mqorder.codec import decode_entries
from mqorder.model import MessageExt, MessageModel, MessageQueue
from mqorder.store.replies import text

#: Entries read per ``XRANGE`` while scanning for an id.
SCAN_PAGE = 1000


@dataclass(frozen=True)
class GroupView:
    """One subscribed group's progress relative to a message."""

    sub: str
    committed: int
    state: str  # "consumed", "waiting" or "retrying" (the head, reconsumed at least once)
    reconsume_times: int

    def to_json(self) -> dict[str, Any]:
        return {"group": self.sub, "committed": self.committed, "state": self.state,
                "reconsume_times": self.reconsume_times}


@dataclass(frozen=True)
class FoundMessage:
    msg: MessageExt
    groups: list[GroupView] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        m = self.msg
        out: dict[str, Any] = {
            "msg_id": m.msg_id, "topic": m.topic, "broker": m.broker_name, "queue_id": m.queue_id,
            "offset": m.queue_offset, "keys": m.keys, "tags": m.tags, "properties": m.properties,
            "born_ms": m.born_timestamp, "stored_ms": m.store_timestamp, "body_bytes": len(m.body),
            "decode_error": m.decode_error, "groups": [g.to_json() for g in self.groups],
        }
        out.update(body_json(m.body))
        return out


def queue_of(admin: Admin, topic: str, queue_id: int, broker: str | None = None) -> MessageQueue:
    """Queue ``queue_id`` of ``topic`` (on ``broker``, required when the topic spans brokers)."""
    route = admin.route(topic)
    brokers = sorted(route.queues_per_broker)
    if broker is None:
        if len(brokers) > 1:
            raise BadArgumentError(f"topic {topic!r} has queues on brokers {', '.join(brokers)}; pick one with --broker")
        broker = brokers[0]
    mq = MessageQueue(topic, broker, queue_id)
    if mq not in route.message_queues:
        raise BadArgumentError(
            f"topic {topic!r} has no queue {queue_id} on broker {broker!r}; its queues are "
            f"{', '.join(f'{b}: 0..{n - 1}' for b, n in sorted(route.queues_per_broker.items()))}"
        )
    return mq


def show(admin: Admin, topic: str, queue_id: int, offset: int, broker: str | None = None) -> FoundMessage:
    mq = queue_of(admin, topic, queue_id, broker)
    msg = message_at(admin, mq, offset, f"queue {mq.key}")
    return FoundMessage(msg, group_views(admin, msg))


def find_by_id(
    admin: Admin, topic: str, msg_id: str, progress: Callable[[MessageQueue, int], None] | None = None
) -> list[FoundMessage]:
    """Every message of ``topic`` with id ``msg_id`` (a replayed dead letter keeps its id, so there
    may be more than one). ``progress(queue, entries scanned)`` is called after each page."""
    route = admin.route(topic)
    needle = msg_id.encode("utf-8")
    found: list[MessageExt] = []
    for mq in route.message_queues:
        client = admin.client(mq)
        start, scanned = "-", 0
        while True:
            entries = client.xrange(keys.queue_log(mq.tag), min=start, count=SCAN_PAGE)
            if not entries:
                break
            scanned += len(entries)
            hits = [e for e in entries if _header_has(e, needle, msg_id)]
            found.extend(m for m in decode_entries(mq, hits) if m.msg_id == msg_id)
            if progress is not None:
                progress(mq, scanned)
            if len(entries) < SCAN_PAGE:
                break
            start = "(" + text(entries[-1][0])
    return [FoundMessage(m, group_views(admin, m)) for m in found]


def _header_has(entry: Any, needle: bytes, msg_id: str) -> bool:
    """Whether the entry's header holds ``msg_id`` as its id: a byte search first, then a parse."""
    fields = entry[1]
    f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=False))
    raw = f.get(b"h", b"")
    if needle not in raw:
        return False
    try:
        return bool(orjson.loads(raw).get("i") == msg_id)
    except (orjson.JSONDecodeError, AttributeError):
        return False


def group_views(admin: Admin, msg: MessageExt) -> list[GroupView]:
    """Where each lane subscribed to the message's topic stands relative to it."""
    mq = msg.message_queue
    client = admin.client(mq)
    subs = set(admin.topics.subs_of_topic(mq.topic))
    subs.update(g for g, t in admin.topics.groups().items() if t.get(mq.topic) is MessageModel.CLUSTERING)
    out = []
    for sub in sorted(subs):
        committed = int(client.hget(keys.sub_state(mq.tag, sub), "offset") or 0)
        retries = int(client.hget(keys.sub_retries(mq.tag, sub), str(msg.queue_offset)) or 0)
        if committed > msg.queue_offset:
            state = "consumed"
        elif committed == msg.queue_offset and retries:
            state = "retrying"
        else:
            state = "waiting"
        out.append(GroupView(sub, committed, state, retries))
    return out

"""``mqorder consumers GROUP``: RocketMQ's ``consumerConnection``: who consumes, how, and what.

Per client of the group (a Celery worker node): its heartbeat's age, its pool and concurrency
(registered by the worker bootstep), the queues the last rebalance assigned to it (each queue's
``assignee``) and the locks it actually holds now. Clients whose heartbeat lapsed but that never left
cleanly (killed) are listed as lapsed until the rebalance forgets them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from mqorder import keys
from mqorder.admin.clocked import clocked_reads
from mqorder.admin.common import Admin
from mqorder.errors import TopicNotFoundError
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.membership import ClientInfo, client_info
from mqorder.store.brokers import group_by_broker
from mqorder.store.replies import text


@dataclass(frozen=True)
class Consumer:
    client_id: str
    live: bool
    host: str
    pid: int
    pool: str
    concurrency: int
    heartbeat_age_ms: int | None  # None when the client did not register its heartbeat timeout
    deadline_left_ms: int  # negative once lapsed
    started_ms: int
    topics: list[str]
    assigned: list[str]  # queue keys the last rebalance assigned to it
    locks_held: int
    version: str = ""  # mqorder version + scripts digest; "" for an older mqorder

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GroupConsumers:
    group: str
    now_ms: int
    consumers: list[Consumer] = field(default_factory=list)

    @property
    def live(self) -> list[Consumer]:
        return [c for c in self.consumers if c.live]

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "now_ms": self.now_ms, "live": len(self.live),
                "consumers": [c.to_json() for c in self.consumers]}


def group_consumers(admin: Admin, group: str) -> GroupConsumers:
    topics = admin.group_topics(group)
    live, dead_ids, now = admin.consumers_of(group)
    clients = [(c, True) for c in live] + [(c, False) for c in _lapsed(admin, group, dead_ids)]
    lanes = _lanes(admin, group, topics, [c for c, _ in clients])
    assigned, held = _assignees_and_owners(admin, lanes)
    out = GroupConsumers(group, now)
    for c, is_live in clients:
        age = now - c.heartbeat_ms if c.heartbeat_ms else None
        out.consumers.append(Consumer(
            client_id=c.client_id, live=is_live, host=c.host, pid=c.pid, pool=c.pool, concurrency=c.concurrency,
            heartbeat_age_ms=age, deadline_left_ms=c.deadline_ms - now, started_ms=c.started_ms,
            topics=sorted(s.topic for s in c.subscriptions if s.group == group),
            assigned=sorted(assigned.get(c.client_id, [])), locks_held=held.get(c.client_id, 0),
            version=c.version,
        ))
    return out


def _lapsed(admin: Admin, group: str, dead_ids: list[str]) -> list[ClientInfo]:
    """Clients of ``group`` whose heartbeat lapsed and whose registration is still stored."""
    if not dead_ids:
        return []
    meta = admin.brokers.meta
    pipe = meta.pipeline(transaction=False)
    for cid in dead_ids:
        pipe.zscore(keys.clients(), cid)
        pipe.hgetall(keys.client_info(cid))
    replies = pipe.execute()
    out = []
    for i, cid in enumerate(dead_ids):
        score, raw = replies[2 * i], replies[2 * i + 1]
        try:
            info = client_info(cid, raw, int(score or 0))
        except ValueError:
            continue
        if any(s.group == group for s in info.subscriptions):
            out.append(info)
    return out


def _lanes(
    admin: Admin, group: str, topics: dict[str, MessageModel], clients: list[ClientInfo]
) -> list[tuple[str, MessageQueue]]:
    out: list[tuple[str, MessageQueue]] = []
    for topic, model in sorted(topics.items()):
        try:
            mqs = admin.route(topic).message_queues
        except TopicNotFoundError:
            continue
        if model is MessageModel.BROADCASTING:
            subs = sorted({keys.broadcast_sub(group, c.client_id) for c in clients})
        else:
            subs = [group]
        out.extend((sub, mq) for sub in subs for mq in mqs)
    return out


def _assignees_and_owners(
    admin: Admin, lanes: list[tuple[str, MessageQueue]]
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """(client -> queue keys assigned to it, client -> live locks it holds) over ``lanes``.

    Read from each queue's state hash (``assignee``, written by ``assign.lua``; ``owner`` and
    ``lease``), one round trip per broker, each lock judged by the clock of the Redis holding it: the truth the scripts act on, not
    the assignment hint.
    """
    assigned: dict[str, list[str]] = defaultdict(list)
    held: dict[str, int] = defaultdict(int)
    for broker, items in group_by_broker(lanes, lambda lane: lane[1]).items():
        reads = clocked_reads(admin.brokers.get(broker), items, lambda lane: lane[1].tag,
                              lambda lane: [("HMGET", keys.sub_state(lane[1].tag, lane[0]), "owner", "lease", "assignee")])
        for c in reads:
            owner, lease, assignee = c.replies[0]
            if owner and int(lease or 0) > c.now_ms:
                held[text(owner)] += 1
            if assignee and text(assignee) != keys.NOBODY:
                assigned[text(assignee)].append(c.item[1].key)
    return dict(assigned), dict(held)

"""``mqorder topic create|list|describe|delete``: RocketMQ's ``updateTopic``, ``topicList``,
``topicStatus`` and ``deleteTopic``.

``describe`` reads every queue's offsets and size with one pipeline per broker. ``delete`` refuses
a topic some group subscribes to (its consumers would lose their place) unless forced, and then
removes everything stored under the topic: its route, its queues' logs, counters and idempotency
ids, every group's lock/offset state and reconsume counts on them, their assignment hints and
stats, and the groups' subscription records.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from mqorder import keys
from mqorder.admin.common import Admin, RefusedError
from mqorder.errors import ConfigError
from mqorder.model import MessageQueue
from mqorder.retention.policy import RetentionRule, TopicRetention
from mqorder.store.brokers import group_by_broker
from mqorder.store.replies import text
from mqorder.store.topics import TopicRoute

#: Keys deleted per call while deleting a topic.
log = logging.getLogger(__name__)

DELETE_BATCH = 500
#: The end of ``keys.queue_gone``'s names: the marks ``delete`` sets, which it leaves in place.
GONE_SUFFIX = keys.queue_gone("{}").rsplit("}", 1)[-1]


@dataclass(frozen=True)
class QueueInfo:
    """One queue of a topic: the log holds offsets ``[min_offset, max_offset)``."""

    broker: str
    queue_id: int
    min_offset: int
    max_offset: int
    messages: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TopicInfo:
    topic: str
    perm: str
    created_ms: int
    queues_per_broker: dict[str, int]
    queues: list[QueueInfo]
    groups: list[str]
    #: The effective retention rule (the topic's own choices on top of MQORDER_RETENTION_*).
    retention: RetentionRule | None = None
    #: Which of its values the topic chose itself (the others follow the defaults).
    retention_own: TopicRetention = field(default_factory=TopicRetention)

    @property
    def messages(self) -> int:
        return sum(q.messages for q in self.queues)

    @property
    def bytes(self) -> int:
        return sum(q.bytes for q in self.queues)

    def to_json(self) -> dict[str, Any]:
        return {
            "topic": self.topic, "perm": self.perm, "created_ms": self.created_ms,
            "queue_count": len(self.queues), "queues_per_broker": self.queues_per_broker,
            "messages": self.messages, "bytes": self.bytes, "groups": self.groups,
            "retention": self.retention.to_json() if self.retention else None,
            "retention_own": sorted(self.retention_own.to_fields()),
            "queues": [q.to_json() for q in self.queues],
        }


def create(admin: Admin, topic: str, queues: int, brokers: list[str] | None = None, perm: str | None = None,
           retention: TopicRetention | None = None) -> TopicInfo:
    """Create ``topic`` (idempotent for the same layout); workers pick it up at once."""
    admin.topics.create_topic(topic, queues, brokers=brokers, perm=perm, retention=retention)
    return describe(admin, topic)


def update_retention(admin: Admin, topic: str, retention: TopicRetention) -> TopicInfo:
    """Change a topic's retention (values not given stay); the next trim pass applies it."""
    admin.topics.update_retention(topic, retention)
    return describe(admin, topic)


def update_perm(admin: Admin, topic: str, perm: str) -> TopicInfo:
    """RocketMQ's ``updateTopicPerm``: ``rw``, ``r`` (sends refused) or ``w`` (not consumed);
    workers rebalance at once, producers see it within their route cache (30 s)."""
    admin.topics.update_perm(topic, perm)
    return describe(admin, topic)


def subscribers(admin: Admin, topic: str) -> list[str]:
    """Groups that subscribe to ``topic`` (recorded by their workers, live or not)."""
    return sorted(g for g, subs in admin.topics.groups().items() if topic in subs)


def describe(admin: Admin, topic: str) -> TopicInfo:
    """The route and every queue's min/max offset, message count and memory (``MEMORY USAGE``)."""
    route = admin.route(topic)
    try:
        rule: RetentionRule | None = route.retention.resolve(admin.settings.retention_defaults)
    except ConfigError:
        rule = None  # stored choices that no longer fit the defaults: the trimmer uses the defaults
    return TopicInfo(
        topic, route.perm, route.created_ms, route.queues_per_broker, _queue_infos(admin, route),
        subscribers(admin, topic), rule, route.retention,
    )


def list_topics(admin: Admin) -> list[TopicInfo]:
    return [describe(admin, t) for t in admin.topics.list_topics()]


def _queue_infos(admin: Admin, route: TopicRoute) -> list[QueueInfo]:
    out: dict[MessageQueue, QueueInfo] = {}
    for broker, mqs in group_by_broker(route.message_queues).items():
        pipe = admin.brokers.get(broker).client.pipeline(transaction=False)
        for mq in mqs:
            log = keys.queue_log(mq.tag)
            pipe.get(keys.queue_next(mq.tag))
            pipe.xrange(log, count=1)
            pipe.xlen(log)
            pipe.memory_usage(log)
        replies = pipe.execute()
        for i, mq in enumerate(mqs):
            nxt, first, n, mem = replies[4 * i : 4 * i + 4]
            max_offset = int(nxt or 0)
            min_offset = int(text(first[0][0]).split("-", 1)[0]) if first else max_offset
            out[mq] = QueueInfo(broker, mq.queue_id, min_offset, max_offset, int(n or 0), int(mem or 0))
    return [out[mq] for mq in route.message_queues]


# -- delete ----------------------------------------------------------------------------------------


@dataclass
class DeleteReport:
    """What ``delete`` removed (or, with ``dry_run``, would remove)."""

    topic: str
    queues: int
    messages: int
    groups: list[str]
    live_consumers: list[str]
    keys_by_kind: dict[str, int] = field(default_factory=dict)
    assignment_fields: int = 0
    stats_fields: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def delete(admin: Admin, topic: str, *, force: bool = False, dry_run: bool = False) -> DeleteReport:
    """Delete ``topic`` and everything stored under it.

    Refused (``RefusedError``, nothing changed) while a group subscribes to it, unless ``force``:
    its consumers would lose their committed offsets, and live ones would log that the topic is
    gone at every rebalance until their listener is removed. Running ConsumeRequests of a forced
    delete lose their state hash with it, so their next fenced commit is refused.
    """
    route = admin.route(topic)
    groups = subscribers(admin, topic)
    live, _, _ = admin.registry.clients()
    consumers = sorted(c.client_id for c in live if any(s.topic == topic for s in c.subscriptions))
    infos = _queue_infos(admin, route)
    report = DeleteReport(topic, len(infos), sum(q.messages for q in infos), groups, consumers, dry_run=dry_run)
    if (groups or consumers) and not force and not dry_run:
        who = ", ".join(groups) or "-"
        live_note = f"; live consumers: {', '.join(consumers)}" if consumers else ""
        raise RefusedError(
            f"topic {topic!r} is subscribed by group(s) {who}{live_note}: deleting it drops their committed "
            "offsets. Stop their workers (or remove the listeners) first, or pass --force"
        )
    subs = _lanes_of_topic(admin, topic, groups)
    if dry_run:
        _delete_queue_keys(admin, route, report)
        _delete_meta(admin, topic, route, subs, groups, report)
        return report
    _mark_gone(admin, route)
    try:
        _delete_queue_keys(admin, route, report)
        _delete_meta(admin, topic, route, subs, groups, report)
    except BaseException:
        # Stopped half way (a timeout, Ctrl-C, a broker lost): the topic still exists, and its
        # marks would have refused every send to it for GONE_TTL_MS. Taken back if possible.
        if admin.brokers.meta.exists(keys.topic_route(topic)):
            _unmark(admin, route)
        raise
    return report


def _lanes_of_topic(admin: Admin, topic: str, groups: list[str]) -> list[str]:
    """Every subscription id that may hold state on the topic's queues."""
    subs = set(groups) | set(admin.topics.subs_of_topic(topic))
    for g in groups:
        subs.update(admin.lanes(g, topic, admin.topics.groups()[g][topic]))
    return sorted(subs)


def _key_kind(key: str) -> str:
    """``log``, ``next``, ``ids``, ``state`` (``s:<sub>``), ``retries`` (``r:<sub>``), ``stage``..."""
    tail = key.rsplit("}:", 1)[-1]
    return {"s": "state", "r": "retries"}.get(tail.split(":", 1)[0], tail.split(":", 1)[0])


def _mark_gone(admin: Admin, route: TopicRoute) -> None:
    """Before anything is deleted: each queue refuses appends for ``keys.GONE_TTL_MS``. A producer
    holding the topic's route (cached 30 s) went on storing, and its messages came back as the
    messages of a topic created again under the name."""
    for broker in route.queues_per_broker:
        client = admin.brokers.get(broker).client
        pipe = client.pipeline(transaction=False)
        for mq in route.message_queues:
            if mq.broker_name == broker:
                pipe.set(keys.queue_gone(mq.tag), 1, px=keys.GONE_TTL_MS)
        pipe.execute()


def _unmark(admin: Admin, route: TopicRoute) -> None:
    """``_mark_gone`` taken back (best effort: a mark left lapses on its own)."""
    for broker, exc in admin.topics.clear_gone_marks(route.topic, route.queues_per_broker):
        log.warning("topic delete of %r stopped half way, and broker %r did not answer to take its marks "
                    "back (%s): its queues there refuse sends for %d minutes; run the delete again to finish it",
                    route.topic, broker, exc, keys.GONE_TTL_MS // 60_000)


def _delete_queue_keys(admin: Admin, route: TopicRoute, report: DeleteReport) -> None:
    """Every key in the topic's queue hash tags (``mqorder:{<topic>:<broker>:<qid>}:*``), found with
    ``SCAN`` so that nothing written under the tag (staged Spark rows included) is left behind."""
    kinds: dict[str, int] = defaultdict(int)
    for broker in route.queues_per_broker:
        client = admin.brokers.get(broker).client
        # Topic and broker names hold no glob characters and no ':' (mqorder.names).
        pattern = f"{keys.PREFIX}:{{{route.topic}{keys.QUEUE_KEY_SEP}{broker}{keys.QUEUE_KEY_SEP}*"
        batch: list[bytes] = []
        for k in client.scan_iter(match=pattern, count=1000):
            if not report.dry_run and text(k).endswith(GONE_SUFFIX):
                continue  # this delete's own marks (_mark_gone)
            kinds[_key_kind(text(k))] += 1
            batch.append(k)
            if len(batch) >= DELETE_BATCH and not report.dry_run:
                client.delete(*batch)
                batch = []
        if batch and not report.dry_run:
            client.delete(*batch)
    report.keys_by_kind = dict(sorted(kinds.items()))


def _delete_meta(
    admin: Admin, topic: str, route: TopicRoute, subs: list[str], groups: list[str], report: DeleteReport
) -> None:
    """The route, the topic's subscriptions, assignment hints and stats fields of its queues."""
    meta = admin.brokers.meta
    queue_keys = {mq.key for mq in route.message_queues}
    assign_fields: dict[str, list[Any]] = {}
    stats_fields: dict[str, list[Any]] = {}
    for sub in subs:
        assign_fields[sub] = [f for f in meta.hkeys(keys.assignment(sub)) if text(f) in queue_keys]
        stats_fields[sub] = [
            f for f in meta.hkeys(keys.stats(sub)) if text(f).rsplit(keys.STATS_FIELD_SEP, 1)[0] in queue_keys
        ]
    report.assignment_fields = sum(len(v) for v in assign_fields.values())
    report.stats_fields = sum(len(v) for v in stats_fields.values())
    if report.dry_run:
        return
    pipe = meta.pipeline(transaction=False)
    for sub in subs:
        if assign_fields[sub]:
            pipe.hdel(keys.assignment(sub), *assign_fields[sub])
        if stats_fields[sub]:
            pipe.hdel(keys.stats(sub), *stats_fields[sub])
    # One key per DEL: on a Redis Cluster the two keys are in different slots (CROSSSLOT in one DEL).
    pipe.delete(keys.topic_route(topic))
    pipe.delete(keys.topic_subs(topic))
    pipe.srem(keys.topics(), topic)
    # Where the transaction check-back and the delay mover look (their per-queue keys went above).
    pipe.srem(keys.txn_topics(), topic)
    pipe.srem(keys.delay_queues(), *queue_keys)
    pipe.execute()
    for g in groups:
        raw = meta.hget(keys.groups(), g)
        subscriptions = json.loads(raw) if raw else {}
        subscriptions.pop(topic, None)
        if subscriptions:
            meta.hset(keys.groups(), g, json.dumps(subscriptions, sort_keys=True))
        else:
            meta.hdel(keys.groups(), g)
    # Workers rebalance at once: they stop assigning the topic's queues.
    meta.incr(keys.topology_version())

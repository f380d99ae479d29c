"""Topic routes (RocketMQ's NameServer route table) and group subscriptions, stored in Redis.

A topic has ``queues`` queues on each of its brokers (RocketMQ's per-broker ``writeQueueNums``);
its ``MessageQueue`` list is sorted by (broker, queue id) so every process sees the same order.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mqorder import keys
from mqorder.errors import ConfigError, TopicExistsError, TopicNotFoundError
from mqorder.model import MessageModel, MessageQueue
from mqorder.names import check_name, check_topic
from mqorder.retention.policy import RetentionPolicy, RetentionRule, TopicRetention, field_names
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.failures import REDIS_ERRORS
from mqorder.store.replies import text

MAX_QUEUES_PER_BROKER = 1024
#: RocketMQ's defaults (``MQORDER_RETENTION_*`` give the process's own; ``Settings.retention_defaults``).
DEFAULT_RETENTION = RetentionRule(RetentionPolicy.TIME, 72 * 3600 * 1000, 3600 * 1000)
#: RocketMQ's topic permissions (``PERM_READ | PERM_WRITE``, ``mqadmin updateTopicPerm``): a topic
#: that is not readable is consumed by nobody (its queues are assigned to no client, so its
#: backlog waits); one that is not writable refuses sends.
PERMS = ("rw", "r", "w")


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicRoute:
    topic: str
    queues_per_broker: dict[str, int]
    created_ms: int
    perm: str = "rw"
    #: The topic's own retention choices (``None`` fields follow ``MQORDER_RETENTION_*``).
    retention: TopicRetention = field(default_factory=TopicRetention)

    @property
    def readable(self) -> bool:
        return "r" in self.perm

    @property
    def writable(self) -> bool:
        return "w" in self.perm

    @property
    def message_queues(self) -> list[MessageQueue]:
        return list(_queues_of(self.topic, tuple(sorted(self.queues_per_broker.items()))))

    @property
    def queue_count(self) -> int:
        return sum(self.queues_per_broker.values())


def _say_kept(existing: TopicRoute, perm: str | None, retention: TopicRetention | None) -> None:
    """``create_topic`` of an existing topic with another permission or retention keeps the
    topic's own, as documented, but said nothing: a deploy that changed its retention in code saw
    it ignored without a word (a producer's walk-through)."""
    asked = existing.retention.merged(retention) if retention is not None else existing.retention
    changed = [f"perm {existing.perm!r} (asked {perm!r})"] if perm is not None and _check_perm(perm) != existing.perm else []
    if asked != existing.retention:
        changed.append(f"retention {existing.retention} (asked {retention})")
    if changed:
        log.warning("create_topic(%r): the topic exists and keeps its %s; change it with `mqorder topic perm` / "
                    "`mqorder topic retention` (TopicManager.update_perm / update_retention)", existing.topic,
                    " and ".join(changed))


@functools.lru_cache(maxsize=4096)
def _queues_of(topic: str, layout: tuple[tuple[str, int], ...]) -> tuple[MessageQueue, ...]:
    """The queues of ``topic`` laid out as ``layout`` ((broker, queue count), by broker name), built
    once per layout: workers and the retention pass read every topic's route every few seconds, and
    a queue spells its keys when built (``MessageQueue``)."""
    return tuple(MessageQueue(topic, broker, qid) for broker, n in layout for qid in range(n))


def _check_perm(perm: object) -> str:
    if perm not in PERMS:
        raise ConfigError(
            f"topic permission must be one of {', '.join(PERMS)} (read and write, read only, write only), "
            f"got {perm!r}"
        )
    return str(perm)


def _check_queue_count(queues: object) -> int:
    if isinstance(queues, bool) or not isinstance(queues, int):
        raise ConfigError(f"queues must be an int from 1 to {MAX_QUEUES_PER_BROKER}, got {queues!r}")
    if not 1 <= queues <= MAX_QUEUES_PER_BROKER:
        raise ConfigError(
            f"queues={queues} is out of range: a topic needs 1 to {MAX_QUEUES_PER_BROKER} queues per broker"
        )
    return queues


class TopicManager:
    """Creates and describes topics; records which groups subscribe to which topics.

    Either change bumps ``keys.topology_version()``: running workers see it within a heartbeat and
    rebalance, so a new topic's first message is consumed in about a second, not at beat's next
    rebalance (up to 20 s later).
    """

    def __init__(self, brokers: BrokerRegistry, retention_defaults: RetentionRule | None = None) -> None:
        self.brokers = brokers
        #: What a topic's retention falls back to, for checking a topic's own choices.
        self.retention_defaults = retention_defaults or DEFAULT_RETENTION
        #: topic -> (its route fields as ``describe_topics`` last read them, the route parsed from
        #: them): a pass over every topic parses only the routes that changed.
        self._parsed_routes: dict[str, tuple[list[Any], TopicRoute | None]] = {}

    def create_topic(
        self, topic: str, queues: int = 8, *, brokers: list[str] | None = None, allow_dlq: bool = False,
        perm: str | None = None, retention: TopicRetention | None = None, allow_retry: bool = False,
    ) -> TopicRoute:
        """Create ``topic`` (idempotent for the same layout). ``perm`` and ``retention`` apply to a
        new topic only; ``update_perm`` / ``update_retention`` change them later (e.g. create
        write-only, fill, then open for reading)."""
        check_topic(topic, allow_dlq=allow_dlq, allow_retry=allow_retry)
        n = _check_queue_count(queues)
        asked_perm = perm  # None: the default, "rw", and no word if the topic has another
        perm = _check_perm("rw" if perm is None else perm)
        names = sorted(set(brokers or [self.brokers.default_name]))
        for b in names:
            self.brokers.get(b)  # refuses unknown broker names with the list of known ones
        layout = {b: n for b in names}
        meta = self.brokers.meta
        created = int(time.time() * 1000)
        route_key = keys.topic_route(topic)
        # HSETNX makes concurrent creators agree on one layout.
        if retention is not None:
            retention.resolve(self.retention_defaults)  # refuse a bad combination before storing
        if meta.hsetnx(route_key, "layout", json.dumps(layout, sort_keys=True)):
            # A topic deleted under this name within keys.GONE_TTL_MS left its queues refusing
            # appends (mqorder.admin.topics.delete): this topic's queues take them again.
            for broker, exc in self.clear_gone_marks(topic, layout):
                log.warning("create_topic(%r): broker %r did not answer (%s); if the topic was deleted in the last "
                            "%d minutes, its queues there refuse sends until then", topic, broker, exc,
                            keys.GONE_TTL_MS // 60_000)
            route_fields: dict[Any, Any] = {"created_ms": created, "perm": perm}
            route_fields.update(retention.to_fields() if retention else {})
            meta.hset(route_key, mapping=route_fields)
            meta.sadd(keys.topics(), topic)
            meta.incr(keys.topology_version())
        existing = self.describe_topic(topic)
        if existing.queues_per_broker != layout:
            raise TopicExistsError(
                f"topic {topic!r} already exists with layout {existing.queues_per_broker}, not {layout}; "
                "queue counts cannot change under an ordered topic (keys would move between queues)"
            )
        _say_kept(existing, asked_perm, retention)
        return existing

    def clear_gone_marks(self, topic: str, layout: dict[str, int]) -> list[tuple[str, Exception]]:
        """Remove the marks a topic delete set (``keys.queue_gone``) from the queues of ``layout``;
        the brokers that did not answer, with why (a mark there lapses on its own, in
        ``keys.GONE_TTL_MS``): creating a topic, or taking back a delete, never needed them."""
        failed: list[tuple[str, Exception]] = []
        for broker, n in layout.items():
            try:
                pipe = self.brokers.get(broker).client.pipeline(transaction=False)
                for qid in range(n):
                    pipe.delete(keys.queue_gone(MessageQueue(topic, broker, qid).tag))  # one key per DEL: slots
                pipe.execute()
            except REDIS_ERRORS as exc:
                failed.append((broker, exc))
        return failed

    def describe_topic(self, topic: str) -> TopicRoute:
        if not isinstance(topic, str):
            raise TopicNotFoundError(f"topic must be a str, got {type(topic).__name__}")
        route = _route(topic, self.brokers.meta.hmget(keys.topic_route(topic), *_ROUTE_FIELDS, *field_names()))
        if route is None:
            raise TopicNotFoundError(
                f"topic {topic!r} does not exist; create it first with "
                f"Producer().create_topic({topic!r}, queues=8) or `mqorder topic create {topic} --queues 8`"
            )
        return route

    def describe_topics(self, topics: Sequence[str]) -> dict[str, TopicRoute]:
        """``describe_topic`` of each of ``topics`` in one round trip; a topic that does not exist
        is left out. For passes over every topic (the retention trimmer): one round trip per
        topic was most of an idle worker's round trips with 64 topics (issue 27)."""
        pipe = self.brokers.meta.pipeline(transaction=False)
        for topic in topics:
            pipe.hmget(keys.topic_route(topic), *_ROUTE_FIELDS, *field_names())
        out: dict[str, TopicRoute] = {}
        for topic, raw in zip(topics, pipe.execute() if topics else [], strict=True):
            seen = self._parsed_routes.get(topic)
            route = seen[1] if seen is not None and seen[0] == raw else _route(topic, raw)
            if len(self._parsed_routes) >= PARSED_ROUTES_KEPT and topic not in self._parsed_routes:
                self._parsed_routes.clear()  # topics come and go: never more than this many kept
            self._parsed_routes[topic] = (raw, route)
            if route is not None:
                out[topic] = route
        return out

    def update_perm(self, topic: str, perm: str) -> TopicRoute:
        """Change a topic's permission (``mqadmin updateTopicPerm``); workers rebalance at once."""
        perm = _check_perm(perm)
        self.describe_topic(topic)  # refuses an unknown topic
        self.brokers.meta.hset(keys.topic_route(topic), "perm", perm)
        self.brokers.meta.incr(keys.topology_version())
        return self.describe_topic(topic)

    def update_retention(self, topic: str, retention: TopicRetention) -> TopicRoute:
        """Change a topic's retention; values not given keep what the topic had. The next trim
        pass applies it (``MQORDER_RETENTION_INTERVAL_MS``)."""
        route = self.describe_topic(topic)  # refuses an unknown topic
        merged = route.retention.merged(retention)
        merged.resolve(self.retention_defaults)
        changed: dict[Any, Any] = merged.to_fields()
        if changed:
            self.brokers.meta.hset(keys.topic_route(topic), mapping=changed)
        return self.describe_topic(topic)

    def list_topics(self) -> list[str]:
        return sorted(text(t) for t in self.brokers.meta.smembers(keys.topics()))

    def ensure_dlq_topic(self, group: str) -> TopicRoute:
        """``%DLQ%{group}``: one queue on the default broker, created on first use as RocketMQ does."""
        return self.create_topic(keys.dlq_topic(group), 1, allow_dlq=True)

    def ensure_retry_topic(self, group: str, queues: int = 1) -> TopicRoute:
        """``%RETRY%{group}``: where the group's concurrent listeners send failed messages back
        to; created on first use with ``queues`` queues (RocketMQ: retryQueueNums, 1). An existing
        retry topic keeps its layout, whatever ``queues`` says now."""
        topic = keys.retry_topic(group)
        try:
            return self.describe_topic(topic)
        except TopicNotFoundError:
            return self.create_topic(topic, queues, allow_retry=True)

    # -- subscriptions ---------------------------------------------------------------------------

    def subscribe(self, group: str, topic: str, model: MessageModel) -> None:
        """Record that ``group`` consumes ``topic`` (what producers wake and rebalance allocates)."""
        check_name("group", group)
        check_topic(topic, allow_retry=topic == keys.retry_topic(group))
        meta = self.brokers.meta
        raw = meta.hget(keys.groups(), group)
        subs = json.loads(raw) if raw else {}
        if subs.get(topic) != model.value:
            subs[topic] = model.value
            meta.hset(keys.groups(), group, json.dumps(subs, sort_keys=True))
            meta.incr(keys.topology_version())
        if model is MessageModel.CLUSTERING:
            meta.sadd(keys.topic_subs(topic), group)
        self.ensure_dlq_topic(group)

    def add_sub(self, topic: str, sub: str) -> None:
        self.brokers.meta.sadd(keys.topic_subs(topic), sub)

    def remove_sub(self, topic: str, sub: str) -> None:
        self.brokers.meta.srem(keys.topic_subs(topic), sub)

    def subs_of_topic(self, topic: str) -> list[str]:
        return sorted(text(s) for s in self.brokers.meta.smembers(keys.topic_subs(topic)))

    def subs_of_topics(self, topics: Sequence[str]) -> dict[str, list[str]]:
        """``subs_of_topic`` of each of ``topics``, in one round trip."""
        if not topics:
            return {}
        pipe = self.brokers.meta.pipeline(transaction=False)
        for topic in topics:
            pipe.smembers(keys.topic_subs(topic))
        return {t: sorted(text(s) for s in raw) for t, raw in zip(topics, pipe.execute(), strict=True)}

    def groups(self) -> dict[str, dict[str, MessageModel]]:
        out: dict[str, dict[str, MessageModel]] = {}
        for g, raw in self.brokers.meta.hgetall(keys.groups()).items():
            out[text(g)] = {t: MessageModel(m) for t, m in json.loads(raw).items()}
        return out


#: Routes ``describe_topics`` keeps parsed (``TopicManager._parsed_routes``).
PARSED_ROUTES_KEPT = 4096

#: The route fields ``describe_topic`` reads before the retention fields (``field_names``).
_ROUTE_FIELDS = ("layout", "created_ms", "perm")


def _route(topic: str, raw: list[Any]) -> TopicRoute | None:
    """The route of ``topic`` from its ``HMGET`` of ``_ROUTE_FIELDS`` and ``field_names()``; None
    if the topic does not exist."""
    if raw[0] is None:
        return None
    names = field_names()
    retention = TopicRetention.from_fields({n: text(v) for n, v in zip(names, raw[3:], strict=True) if v})
    return TopicRoute(topic, json.loads(raw[0]), int(raw[1] or 0), text(raw[2]) or "rw", retention)

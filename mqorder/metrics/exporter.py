"""``mqorder exporter --port 9808``: the state of every consumer group, read from Redis alone.

Workers each export what *they* did; what an operator asks first ("which queue is stuck, on what,
who owns it, how far behind is it, what is in the DLQ") is the state of the *group*, which lives
in Redis. This exporter reads it at every scrape, so one scrape target covers every worker, live or
dead, and a queue nobody consumes still shows its lag.

A scrape costs two round trips per broker, plus a few reads of the topic routes, subscriptions and
heartbeats on the default broker:

1. per queue its next offset, per group lane its state hash, per group its DLQ length, and
   ``TIME`` (on a Redis Cluster every shard answers in that round trip, with its own clock,
   ``mqorder.admin.clocked``);
2. only for the lanes with a backlog: the head message (``XRANGE`` from the committed offset,
   ``COUNT 1``: its ``s`` field is its store time by Redis's clock; the stream id is
   ``<offset>-1`` and carries no time), its reconsume count, and in key mode how many messages are
   parked, with ``TIME`` again. A caught-up lane costs nothing here.

Nothing is written, no script is run, and the consume path is not touched. Every figure is
derived from what Redis holds (``commit_ms`` is written by the commit scripts), so an exporter
restart loses nothing. Broadcasting groups have one lane per client: their ``group`` label is that
lane's id, ``<group>%BC%<client>``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import redis
import typer

from mqorder import keys
from mqorder.admin.clocked import clocked_reads
from mqorder.admin.status import store_ms, waiting_ms
from mqorder.errors import ConfigError, MQOrderError, TopicNotFoundError
from mqorder.metrics import names
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.membership import ClientRegistry
from mqorder.settings import Settings, get_settings
from mqorder.store.brokers import Broker, BrokerRegistry, redact_url
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

DEFAULT_PORT = 9808


@dataclass
class _Plan:
    """What one scrape reads: the queues of every topic, every (lane, queue), every DLQ queue."""

    queues: list[MessageQueue] = field(default_factory=list)
    lanes: list[tuple[str, MessageQueue]] = field(default_factory=list)
    dlq: list[tuple[str, MessageQueue]] = field(default_factory=list)
    clients: dict[str, int] = field(default_factory=dict)


#: The state hash fields a scrape reads (``mqorder.keys.sub_state``).
_STATE_FIELDS = ("owner", "lease", "epoch", "offset", "run", "commit_ms", "done")


@dataclass(frozen=True)
class _LaneState:
    """One (group lane, queue) state hash, judged by its broker's clock (``mqorder.keys.sub_state``)."""

    owner: str  # the holder of a live lock, "" if none (_lock.lua's lock_live)
    epoch: int
    committed: int
    running: bool
    commit_ms: int  # when the committed offset last moved (commit.lua), 0 if never
    #: Key-ordered lane: only ``key_commit.lua`` writes the ``done`` field (even as ''), so its
    #: presence tells the ordering, which Redis stores nowhere else.
    key_mode: bool

    @classmethod
    def parse(cls, reply: list[Any], now_ms: int) -> _LaneState:
        owner, lease, epoch, offset, run, commit_ms, done = reply
        live = bool(owner) and int(lease or 0) > now_ms
        return cls(text(owner) if live else "", int(epoch or 0), int(offset or 0), int(run or 0) > now_ms,
                   int(commit_ms or 0), done is not None)


@dataclass(frozen=True)
class _Head:
    """The head of a lane with a backlog: how long it waited and was stuck, its reconsume count."""

    age_ms: int
    stalled_ms: int
    retries: int
    parked: int  # key mode: messages with a recorded reconsume count


@dataclass
class _Reading:
    """What one scrape read: max offset per queue, state per lane, DLQ messages per group, heads."""

    max_offsets: dict[MessageQueue, int] = field(default_factory=dict)
    lanes: dict[tuple[str, MessageQueue], _LaneState] = field(default_factory=dict)
    dlq: dict[str, int] = field(default_factory=dict)
    heads: dict[tuple[str, MessageQueue], _Head] = field(default_factory=dict)


class ClusterCollector:
    """A prometheus-client collector (``collect()``) over the Redis state of every group."""

    def __init__(self, brokers: BrokerRegistry, heartbeat_timeout_ms: int) -> None:
        self.brokers = brokers
        self.topics = TopicManager(brokers)
        self.registry = ClientRegistry(brokers.meta, heartbeat_timeout_ms)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        t0 = time.perf_counter()
        try:
            families = self._families()
            up = 1
        except (redis.RedisError, MQOrderError) as exc:
            log.warning("mqorder exporter: cannot read %s (%s)", self.brokers.default.safe_url, exc)
            families, up = [], 0
        yield from families
        yield GaugeMetricFamily(names.UP.name, names.UP.help, value=up)
        took = time.perf_counter() - t0
        yield GaugeMetricFamily(names.SCRAPE_DURATION.name, names.SCRAPE_DURATION.help, value=took)

    # -- reading ---------------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        plan = _Plan()
        groups = self.topics.groups()
        live, _, _ = self.registry.clients()
        for c in live:
            for g in {s.group for s in c.subscriptions}:
                plan.clients[g] = plan.clients.get(g, 0) + 1
        routes: dict[str, list[MessageQueue]] = {}

        def queues_of(topic: str) -> list[MessageQueue]:
            if topic not in routes:
                try:
                    routes[topic] = self.topics.describe_topic(topic).message_queues
                except TopicNotFoundError:  # subscribed before it was created
                    routes[topic] = []
                plan.queues.extend(routes[topic])
            return routes[topic]

        for group in sorted(groups):
            plan.clients.setdefault(group, 0)
            for topic, model in sorted(groups[group].items()):
                mqs = queues_of(topic)
                if model is MessageModel.BROADCASTING:
                    subs = [s for s in self.topics.subs_of_topic(topic)
                            if keys.BROADCAST_SEP in s and keys.group_of_sub(s) == group]
                else:
                    subs = [group]
                plan.lanes.extend((sub, mq) for sub in subs for mq in mqs)
            try:
                dlq = self.topics.describe_topic(keys.dlq_topic(group)).message_queues
            except TopicNotFoundError:
                dlq = []
            plan.dlq.extend((group, mq) for mq in dlq)
        return plan

    def _read(self, plan: _Plan) -> _Reading:
        """One round trip per broker: every read of the plan on that broker, and ``TIME`` from
        each node that answered (``clocked_reads``: on a cluster, every shard's queues, each
        lane's lease judged by its own node's clock)."""
        ops: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for mq in plan.queues:
            ops[mq.broker_name].append(("next", mq))
        for lane in plan.lanes:
            ops[lane[1].broker_name].append(("state", lane))
        for group, mq in plan.dlq:
            ops[mq.broker_name].append(("dlq", (group, mq)))
        reading = _Reading()
        for broker, items in ops.items():
            try:
                store = self.brokers.get(broker)
            except ConfigError as exc:  # a route names a broker this exporter was not told about
                log.warning("mqorder exporter: skipping the queues on broker %r: %s", broker, exc)
                continue
            for c in clocked_reads(store, items, _tag_of, _commands_of):
                kind, what = c.item
                reply = c.replies[0]
                if kind == "next":
                    reading.max_offsets[what] = int(reply or 0)
                elif kind == "state":
                    reading.lanes[what] = _LaneState.parse(reply, c.now_ms)
                else:
                    reading.dlq[what[0]] = reading.dlq.get(what[0], 0) + int(reply or 0)
            backlog = [(lane, st) for kind, lane in items if kind == "state"
                       for st in (reading.lanes[lane],) if reading.max_offsets.get(lane[1], 0) > st.committed]
            reading.heads.update(_read_heads(store, backlog))
        return reading

    def _families(self) -> list[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        plan = self._plan()
        reading = self._read(plan)

        def family(spec: names.MetricSpec) -> GaugeMetricFamily:
            return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)

        max_offset, committed, lag = (family(names.QUEUE_MAX_OFFSET), family(names.QUEUE_COMMITTED_OFFSET),
                                      family(names.QUEUE_LAG))
        epoch, owner, running = family(names.QUEUE_EPOCH), family(names.QUEUE_OWNER), family(names.QUEUE_RUNNING)
        for mq in plan.queues:
            if mq in reading.max_offsets:
                max_offset.add_metric([mq.topic, mq.broker_name, str(mq.queue_id)], reading.max_offsets[mq])
        for sub, mq in plan.lanes:
            state = reading.lanes.get((sub, mq))
            if state is None:
                continue
            labels = [sub, mq.topic, mq.broker_name, str(mq.queue_id)]
            committed.add_metric(labels, state.committed)
            lag.add_metric(labels, max(0, reading.max_offsets[mq] - state.committed))
            epoch.add_metric(labels, state.epoch)
            running.add_metric(labels, 1 if state.running else 0)
            if state.owner:
                owner.add_metric([*labels, state.owner], 1)
        head_age, stalled, head_retries = (family(names.QUEUE_HEAD_AGE), family(names.QUEUE_STALLED),
                                           family(names.QUEUE_HEAD_RETRIES))
        parked, unfinished = family(names.QUEUE_KEYS_SUSPENDED), family(names.QUEUE_OLDEST_UNFINISHED)
        for sub, mq in plan.lanes:
            state = reading.lanes.get((sub, mq))
            if state is None:
                continue
            labels = [sub, mq.topic, mq.broker_name, str(mq.queue_id)]
            head = reading.heads.get((sub, mq), _CAUGHT_UP)
            head_age.add_metric(labels, head.age_ms / 1000.0)
            stalled.add_metric(labels, head.stalled_ms / 1000.0)
            head_retries.add_metric(labels, head.retries)
            if state.key_mode:
                parked.add_metric(labels, head.parked)
                unfinished.add_metric(labels, head.age_ms / 1000.0)
        clients, dlq = family(names.CLIENTS_LIVE), family(names.DLQ_MESSAGES)
        for group, n in sorted(plan.clients.items()):
            clients.add_metric([group], n)
            dlq.add_metric([group], reading.dlq.get(group, 0))
        return [max_offset, committed, lag, epoch, owner, running, clients, dlq, head_age, stalled, head_retries,
                parked, unfinished]


_CAUGHT_UP = _Head(0, 0, 0, 0)


def _read_heads(store: Broker, lanes: list[tuple[tuple[str, MessageQueue], _LaneState]],
                ) -> dict[tuple[str, MessageQueue], _Head]:
    """The head of every lane with a backlog, in one round trip (``TIME`` per node again).

    The head is the first entry at or above the committed offset (retention may have trimmed the
    committed one): ``XRANGE <committed> + COUNT 1``, whose ``s`` field is the store time. Its
    reconsume count is the retries hash's field of the committed offset (a count of another offset
    does not belong to this head: 0). Stalled is ``mqorder.admin.status.waiting_ms``: since the
    later of the offset's last move and the head's store time, so a queue idle for an hour that
    just got a message is not an hour stalled.
    """
    def commands(item: tuple[tuple[str, MessageQueue], _LaneState]) -> list[tuple[Any, ...]]:
        (sub, mq), st = item
        cmds: list[tuple[Any, ...]] = [
            ("XRANGE", keys.queue_log(mq.tag), st.committed, "+", "COUNT", 1),
            ("HGET", keys.sub_retries(mq.tag, sub), st.committed),
        ]
        if st.key_mode:
            cmds.append(("HLEN", keys.sub_retries(mq.tag, sub)))
        return cmds

    out = {}
    for c in clocked_reads(store, lanes, lambda item: item[0][1].tag, commands):
        lane, st = c.item
        entries, retries = c.replies[0], c.replies[1]
        if not entries:  # trimmed away since the first read: nothing waits
            continue
        head_offset = int(text(entries[0][0]).split("-", 1)[0])
        stored = store_ms(entries)
        age = max(0, c.now_ms - stored) if stored else 0
        waited = waiting_ms(1, st.commit_ms or None, stored, c.now_ms) or 0
        out[lane] = _Head(age, waited, int(retries or 0) if head_offset == st.committed else 0,
                          int(c.replies[2]) if st.key_mode else 0)
    return out


def _tag_of(op: tuple[str, Any]) -> str:
    kind, what = op
    mq: MessageQueue = what if kind == "next" else what[1]
    return mq.tag


def _commands_of(op: tuple[str, Any]) -> list[tuple[Any, ...]]:
    kind, what = op
    if kind == "next":
        return [("GET", keys.queue_next(what.tag))]
    if kind == "state":
        sub, mq = what
        return [("HMGET", keys.sub_state(mq.tag, sub), *_STATE_FIELDS)]
    return [("XLEN", keys.queue_log(what[1].tag))]


def registry_for(settings: Settings) -> CollectorRegistry:
    """A prometheus-client registry holding only the cluster collector."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    brokers = BrokerRegistry(settings.redis_url, settings.brokers)
    registry.register(cast("Collector", ClusterCollector(brokers, settings.heartbeat_timeout_ms)))
    return registry


def exporter(
    port: int = typer.Option(DEFAULT_PORT, min=1, max=65535, help="TCP port of /metrics"),
    addr: str = typer.Option("0.0.0.0", help="address to listen on"),
    once: bool = typer.Option(
        False, "--once", help="print one scrape to stdout and exit (1 if Redis was unreadable)"
    ),
) -> None:
    """Serve every group's lag, offsets, owners, epochs, live clients and DLQ depth, read from Redis.

    One scrape target for the whole cluster (the workers' own metrics are on MQORDER_METRICS_PORT).
    """
    from prometheus_client import generate_latest, start_http_server

    try:
        settings = get_settings()
        registry = registry_for(settings)
    except MQOrderError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if once:
        out = generate_latest(registry).decode()
        sys.stdout.write(out)
        raise typer.Exit(0 if f"\n{names.UP.name} 1.0\n" in f"\n{out}" else 1)
    try:
        server, _ = start_http_server(port, addr, registry)
    except OSError as exc:
        typer.echo(f"error: cannot listen on {addr}:{port} ({exc}); choose another --port", err=True)
        raise typer.Exit(2) from None
    where = redact_url(settings.redis_url)
    typer.echo(f"mqorder exporter: metrics of {where} on http://{addr}:{port}/metrics", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    server.shutdown()
    server.server_close()

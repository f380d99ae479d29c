"""``mqorder exporter --port 9808``: the state of every consumer group, read from Redis alone.

Workers each export what *they* did; what an operator asks first ("which queue is stuck, on what,
who owns it, how far behind is it, what is in the DLQ") is the state of the *group*, which lives
in Redis. This exporter reads it at every scrape, so one scrape target covers every worker, live or
dead, and a queue nobody consumes still shows its lag.

A scrape costs one round trip per broker, plus a few reads of the topic routes, subscriptions
and heartbeats on the default broker: the lanes in batches of one read-only script
(``mqorder.metrics.lane_read``: per lane its queue's next offset, its state hash and, with a
backlog, its head message's store time and reconsume count, judged by that Redis's clock), the
length of every DLQ queue, and ``TIME`` from every node (``mqorder.admin.clocked``: on a Redis
Cluster every shard answers in that round trip). The answer is written in the text format
directly (``mqorder.metrics.exposition``).

Nothing is written and the consume path is not touched. Every figure is derived from what Redis
holds (``commit_ms`` is written by the commit scripts), so an exporter restart loses nothing.
Broadcasting groups have one lane per client: their ``group`` label is that lane's id,
``<group>%BC%<client>``.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis
import typer

from mqorder import keys
from mqorder.admin.clocked import clocked_reads
from mqorder.errors import ConfigError, MQOrderError, TopicNotFoundError
from mqorder.metrics import names
from mqorder.metrics.exposition import Family, escape, labels, render, serve
from mqorder.metrics.lane_read import Lane, LaneReading, lane_batches, lanes_command, parse_lanes
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.membership import ClientRegistry
from mqorder.settings import Settings, get_settings
from mqorder.store.brokers import BrokerRegistry, redact_url
from mqorder.store.topics import TopicManager

log = logging.getLogger(__name__)

DEFAULT_PORT = 9808


@dataclass
class _Plan:
    """What one scrape reads: the queues of every topic, every (lane, queue), every DLQ queue."""

    queues: list[MessageQueue] = field(default_factory=list)
    lanes: list[tuple[str, MessageQueue]] = field(default_factory=list)
    dlq: list[tuple[str, MessageQueue]] = field(default_factory=list)
    clients: dict[str, int] = field(default_factory=dict)


@dataclass
class _Reading:
    """What one scrape read: max offset per queue, each lane as ``LANES_LUA`` judged it, DLQ
    messages per group."""

    max_offsets: dict[MessageQueue, int] = field(default_factory=dict)
    lanes: dict[Lane, LaneReading] = field(default_factory=dict)
    dlq: dict[str, int] = field(default_factory=dict)
    #: Whether each broker of the plan was read (``mqorder_broker_up``).
    brokers: dict[str, bool] = field(default_factory=dict)


class ClusterCollector:
    """The Redis state of every group, as one Prometheus exposition per ``scrape()``."""

    def __init__(self, brokers: BrokerRegistry, heartbeat_timeout_ms: int) -> None:
        self.brokers = brokers
        self.topics = TopicManager(brokers)
        self.registry = ClientRegistry(brokers.meta, heartbeat_timeout_ms)
        self._one_at_a_time = threading.Lock()
        #: The ``EVAL`` of each lane batch of the last scrape (``_lanes_command``).
        self._commands: dict[tuple[Lane, ...], tuple[Any, ...]] = {}

    def scrape(self) -> str:
        """One scrape: every family in the Prometheus text format, then ``mqorder_up`` and the time
        this took (an unreadable default broker, which holds the routes and heartbeats: only those
        two, ``mqorder_up`` 0). Another broker that cannot be read only loses its own queues'
        series: ``mqorder_broker_up`` 0 for it and ``mqorder_up`` 0, the other brokers' lag still
        exported (one broker down must not blind the alerts on the others).

        Scrapes run one at a time (two Prometheus servers scraping at once wait for each other
        rather than read Redis twice as hard), with Python's cyclic garbage collector paused: a
        scrape of 10,000 queues allocates some 200,000 short-lived objects, none in a cycle, and
        the collections they triggered took a fifth of its CPU (measured with ``bench.exporter_scrape``'s
        setup: 0.04 to 0.1 s of 0.25 s)."""
        with self._one_at_a_time:
            t0 = time.perf_counter()
            collecting = gc.isenabled()
            gc.disable()
            try:
                families, read = self._families()
                body = render(families)
                up = int(all(read.values()))
            except (redis.RedisError, MQOrderError) as exc:
                log.warning("mqorder exporter: cannot read %s (%s)", self.brokers.default.safe_url, exc)
                body, up = "", 0
            finally:
                if collecting:
                    gc.enable()
            tail = [Family(names.UP), Family(names.SCRAPE_DURATION)]
            tail[0].add("", up)
            tail[1].add("", time.perf_counter() - t0)
            return body + render(tail)

    # -- reading ---------------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        plan = _Plan()
        groups = self.topics.groups()
        live, _, _ = self.registry.clients()
        live_ids = {c.client_id for c in live}
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
                    # Live clients' lanes only: a broadcast client that died without leaving (a
                    # kill, an OOM; its id is its hostname, new with each pod) keeps its
                    # subscription and a backlog no one will consume, which would page for ever.
                    known = set(self.topics.subs_of_topic(topic))
                    subs = [s for s in (keys.broadcast_sub(group, c) for c in sorted(live_ids)) if s in known]
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
        """One round trip per broker (``clocked_reads``: on a cluster every shard at once): the
        lanes in ``LANES_LUA`` batches, the next offset of any queue no lane reads, the length of
        every DLQ queue."""
        ops: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        by_broker: dict[str, list[Lane]] = defaultdict(list)
        for lane in plan.lanes:
            by_broker[lane[1].broker_name].append(lane)
        laned = {mq for _, mq in plan.lanes}
        for mq in plan.queues:
            if mq not in laned:  # a broadcasting topic with no client yet: its max offset alone
                ops[mq.broker_name].append(("next", mq))
        for group, mq in plan.dlq:
            ops[mq.broker_name].append(("dlq", (group, mq)))
        reading = _Reading()
        commands, self._commands = self._commands, {}
        for broker in sorted(set(ops) | set(by_broker)):
            # Each broker is read into a part of its own, kept only whole: a broker that fails half
            # way (a cluster shard down) exports none of its queues rather than some.
            part = _Reading()
            try:
                store = self.brokers.get(broker)
                items: list[tuple[str, Any]] = []
                for batch in lane_batches(store, by_broker[broker]):
                    items.append(("lanes", (batch, self._lanes_command(batch, commands))))
                for c in clocked_reads(store, items + ops[broker], _tag_of, _commands_of):
                    kind, what = c.item
                    reply = c.replies[0]
                    if kind == "lanes":
                        for lane, got in zip(what[0], parse_lanes(reply), strict=True):
                            part.lanes[lane] = got
                            part.max_offsets[lane[1]] = got.next_offset
                    elif kind == "next":
                        part.max_offsets[what] = int(reply or 0)
                    else:
                        part.dlq[what[0]] = part.dlq.get(what[0], 0) + int(reply or 0)
            except ConfigError as exc:  # a route names a broker this exporter was not told about
                log.warning("mqorder exporter: skipping the queues on broker %r: %s", broker, exc)
            except (redis.RedisError, MQOrderError) as exc:
                log.warning("mqorder exporter: cannot read broker %r, its queues are left out (%s)", broker, exc)
            else:
                reading.brokers[broker] = True
                reading.lanes.update(part.lanes)
                reading.max_offsets.update(part.max_offsets)
                for group, n in part.dlq.items():
                    reading.dlq[group] = reading.dlq.get(group, 0) + n
                continue
            reading.brokers[broker] = False
        return reading

    def _lanes_command(self, batch: list[Lane], last: dict[tuple[Lane, ...], tuple[Any, ...]]) -> tuple[Any, ...]:
        """``lanes_command(batch)``, reused from the last scrape when it had the same batch: the
        lanes rarely change, and building 40,000 key names was a sixth of a scrape's CPU."""
        key = tuple(batch)
        cmd = last.get(key)
        if cmd is None:
            cmd = lanes_command(batch)
        self._commands[key] = cmd
        return cmd

    def _families(self) -> tuple[list[Family], dict[str, bool]]:
        """Every family of one scrape, and whether each broker was read. There are ten lines per
        lane (100,000 at 10,000 queues), so a lane's label set is escaped once, and each family is
        one list comprehension of f-strings over the lanes (``mqorder.metrics.exposition``)."""
        plan = self._plan()
        reading = self._read(plan)
        reading.brokers.setdefault(self.brokers.default_name, True)  # the plan was read from it
        max_offset = Family(names.QUEUE_MAX_OFFSET)
        queue_part: dict[MessageQueue, str] = {}
        for mq in plan.queues:
            part = queue_part[mq] = f'topic="{escape(mq.topic)}",broker="{escape(mq.broker_name)}",queue="{mq.queue_id}"'
            if mq in reading.max_offsets:
                max_offset.lines.append(f"{names.QUEUE_MAX_OFFSET.name}{{{part}}} {reading.max_offsets[mq]}.0\n")
        # (label set without its braces, reading) per lane that was read.
        rows = [(f'group="{escape(lane[0])}",{queue_part[lane[1]]}', got)
                for lane in plan.lanes if (got := reading.lanes.get(lane)) is not None]
        keyed = [row for row in rows if row[1].key_mode]
        fam = {spec: Family(spec) for spec in _LANE_SPECS}

        def fill(spec: names.MetricSpec, lines: list[str]) -> None:
            fam[spec].lines = lines

        n = names
        fill(n.QUEUE_COMMITTED_OFFSET, [f"{n.QUEUE_COMMITTED_OFFSET.name}{{{ls}}} {g.committed}.0\n" for ls, g in rows])
        fill(n.QUEUE_LAG, [f"{n.QUEUE_LAG.name}{{{ls}}} {g.lag}.0\n" for ls, g in rows])
        fill(n.QUEUE_EPOCH, [f"{n.QUEUE_EPOCH.name}{{{ls}}} {g.epoch}.0\n" for ls, g in rows])
        fill(n.QUEUE_RUNNING, [f"{n.QUEUE_RUNNING.name}{{{ls}}} {1.0 if g.running else 0.0}\n" for ls, g in rows])
        fill(n.QUEUE_OWNER, [f'{n.QUEUE_OWNER.name}{{{ls},owner="{escape(g.owner)}"}} 1.0\n' for ls, g in rows
                             if g.owner])
        fill(n.QUEUE_HEAD_AGE, [f"{n.QUEUE_HEAD_AGE.name}{{{ls}}} {g.head_age_ms / 1000}\n" for ls, g in rows])
        fill(n.QUEUE_STALLED, [f"{n.QUEUE_STALLED.name}{{{ls}}} {g.stalled_ms / 1000}\n" for ls, g in rows])
        fill(n.QUEUE_HEAD_RETRIES, [f"{n.QUEUE_HEAD_RETRIES.name}{{{ls}}} {g.head_retries}.0\n" for ls, g in rows])
        fill(n.QUEUE_KEYS_SUSPENDED, [f"{n.QUEUE_KEYS_SUSPENDED.name}{{{ls}}} {g.parked}.0\n" for ls, g in keyed])
        fill(n.QUEUE_OLDEST_UNFINISHED, [f"{n.QUEUE_OLDEST_UNFINISHED.name}{{{ls}}} {g.head_age_ms / 1000}\n"
                                         for ls, g in keyed])
        clients, dlq = Family(names.CLIENTS_LIVE), Family(names.DLQ_MESSAGES)
        # A group with a DLQ queue on a broker that was not read gets no DLQ series.
        dlq_unread = {group for group, mq in plan.dlq if not reading.brokers.get(mq.broker_name, True)}
        for group, count in sorted(plan.clients.items()):
            ls = labels(("group",), (group,))
            clients.add(ls, count)
            if group not in dlq_unread:
                dlq.add(ls, reading.dlq.get(group, 0))
        broker_up = Family(names.BROKER_UP)
        for broker, ok in sorted(reading.brokers.items()):
            broker_up.add(labels(("broker",), (broker,)), int(ok))
        return [max_offset, *fam.values(), clients, dlq, broker_up], reading.brokers


#: The per-lane families, in the order ``_families`` writes them; their labels are the queue's
#: (``names._QUEUE``), plus ``owner`` last for the owner family, as the f-strings there write them.
_LANE_SPECS = (
    names.QUEUE_COMMITTED_OFFSET, names.QUEUE_LAG, names.QUEUE_EPOCH, names.QUEUE_RUNNING, names.QUEUE_OWNER,
    names.QUEUE_HEAD_AGE, names.QUEUE_STALLED, names.QUEUE_HEAD_RETRIES, names.QUEUE_KEYS_SUSPENDED,
    names.QUEUE_OLDEST_UNFINISHED,
)
_QUEUE_LABELS = ("group", "topic", "broker", "queue")
assert all(s.labels in (_QUEUE_LABELS, (*_QUEUE_LABELS, "owner")) for s in _LANE_SPECS)
assert names.QUEUE_MAX_OFFSET.labels == _QUEUE_LABELS[1:]


def _tag_of(op: tuple[str, Any]) -> str:
    kind, what = op
    if kind == "lanes":
        return str(what[0][0][1].tag)  # one slot per batch on a cluster (lane_batches)
    mq: MessageQueue = what if kind == "next" else what[1]
    return mq.tag


def _commands_of(op: tuple[str, Any]) -> list[tuple[Any, ...]]:
    kind, what = op
    if kind == "lanes":
        return [what[1]]
    if kind == "next":
        return [("GET", keys.queue_next(what.tag))]
    return [("XLEN", keys.queue_log(what[1].tag))]


def collector_for(settings: Settings) -> ClusterCollector:
    """The cluster collector over the brokers ``settings`` name."""
    brokers = BrokerRegistry(settings.redis_url, settings.brokers)
    return ClusterCollector(brokers, settings.heartbeat_timeout_ms)


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
    try:
        settings = get_settings()
        collector = collector_for(settings)
    except MQOrderError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if once:
        out = collector.scrape()
        sys.stdout.write(out)
        raise typer.Exit(0 if f"\n{names.UP.name} 1.0\n" in f"\n{out}" else 1)
    # Installed before the port opens: a SIGTERM as soon as the endpoint answers is a clean stop.
    # It raises in the main thread, wherever that is. It used to set a threading.Event the main
    # thread waited on, which can deadlock: a handler runs between two bytecodes of the main
    # thread, possibly inside Event.wait() while that thread holds the Event's own non-reentrant
    # lock, which set() then takes. Once in a test run the exporter did not exit within 15 s of
    # SIGTERM; this is the one way we found for it to hang there.
    server = None
    try:
        signal.signal(signal.SIGTERM, _stop_on_term)
        try:
            server = serve(addr, port, collector.scrape)
        except OSError as exc:
            typer.echo(f"error: cannot listen on {addr}:{port} ({exc}); choose another --port", err=True)
            raise typer.Exit(2) from None
        where = redact_url(settings.redis_url)
        typer.echo(f"mqorder exporter: metrics of {where} on http://{addr}:{port}/metrics", err=True)
        while True:
            time.sleep(3600)
    except (_Stopped, KeyboardInterrupt):
        # After a Ctrl-C too: a SIGTERM while the server shuts down must not raise out of it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if server is not None:
        server.shutdown()
        server.server_close()


class _Stopped(Exception):
    """SIGTERM: the exporter stops cleanly (exit status 0)."""


def _stop_on_term(_signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM while stopping changes nothing
    raise _Stopped

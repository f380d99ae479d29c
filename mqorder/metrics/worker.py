"""A worker's own Prometheus endpoint, on ``MQORDER_METRICS_PORT`` (off by default).

Who measures what, and in which process:

* listener calls, refused commits and lingering slots are measured where they happen: in the
  prefork children (or the main process of a threads/solo worker), through ``MetricsHook`` and
  ``LingerWatch`` (``mqorder.metrics.hook``), into prometheus-client's multiprocess files;
* ConsumeRequest runs by outcome are counted by ``after_run``, which the ``consume_request`` task
  calls with the ``Outcome`` the engine returned;
* locks held and lock takeovers come from the ``ClientInstance``'s ``lock_all`` and rebalance
  results, and the requests waiting for a slot from the prefork capacity signal: all three live in
  the main process, where they are kept in plain memory and read at scrape time. The main process
  never writes a multiprocess file while pool children exist, so a child forked while one of its
  threads held prometheus-client's file lock can never inherit that lock held;
* the main process answers ``GET /metrics`` with the sum of every process's files
  (``MultiProcessCollector``) plus its own figures, after marking exited children dead.

With ``MQORDER_METRICS_PORT`` unset, ``start`` returns None and every function here returns at
once: no hook is registered, no file is written, no thread is started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from mqorder import keys
from mqorder.consumer.async_loop import LAG_OBSERVERS
from mqorder.consumer.hooks import register_consume_message_hook
from mqorder.consumer.listener import Ordering, get_listener
from mqorder.metrics import multiproc, names
from mqorder.metrics.hook import KeyWatch, LingerWatch, MetricsHook
from mqorder.model import MessageQueue
from mqorder.settings import Settings

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

    from mqorder.consumer.engine import ConsumerEngine
    from mqorder.consumer.run_types import Outcome
    from mqorder.rebalance.service import RebalanceReport

log = logging.getLogger(__name__)

#: A capacity stamp older than this means nobody publishes it (not a prefork worker, or stopped).
CAPACITY_STALE_S = 1.0


class CapacityReader(Protocol):
    """``mqorder.celery.capacity.CapacitySignal``: ``(monotonic stamp, waiting requests, spare slot)``."""

    def read(self) -> tuple[float, int, int]: ...


@dataclass
class ClientFigures:
    """Main-process figures, written by the ``ClientInstance``'s duty thread, read by the scrape."""

    locks_held: int | None = None
    lock_takeovers: int = 0


class WorkerMetrics:
    """The metrics of one worker: created in its main process before the pool forks."""

    def __init__(self, settings: Settings, capacity: CapacityReader | None = None) -> None:
        self.settings = settings
        self.capacity = capacity
        self.path = multiproc.prepare()
        from prometheus_client import Counter, Gauge, Histogram

        # registry=None: in multiprocess mode the files are the registry; registering these too
        # would export them twice.
        self.consumed = Counter(names.CONSUMED.family, names.CONSUMED.help, names.CONSUMED.labels, registry=None)
        self.duration = Histogram(
            names.CONSUME_DURATION.family, names.CONSUME_DURATION.help, names.CONSUME_DURATION.labels,
            registry=None, buckets=names.CONSUME_DURATION_BUCKETS,
        )
        self.refused = Counter(
            names.COMMITS_REFUSED.family, names.COMMITS_REFUSED.help, names.COMMITS_REFUSED.labels, registry=None
        )
        self.runs = Counter(names.RUNS.family, names.RUNS.help, names.RUNS.labels, registry=None)
        # livesum: the slots lingering in processes that are alive now (dead ones are reaped).
        lingering = Gauge(names.LINGERING.family, names.LINGERING.help, registry=None, multiprocess_mode="livesum")
        self.linger = LingerWatch(lingering)
        self.latency = Histogram(
            names.MESSAGE_LATENCY.family, names.MESSAGE_LATENCY.help, names.MESSAGE_LATENCY.labels,
            registry=None, buckets=names.MESSAGE_LATENCY_BUCKETS,
        )
        self.redeliveries = Counter(
            names.REDELIVERIES.family, names.REDELIVERIES.help, names.REDELIVERIES.labels, registry=None
        )
        suspended = Gauge(names.KEYS_SUSPENDED.family, names.KEYS_SUSPENDED.help, names.KEYS_SUSPENDED.labels,
                          registry=None, multiprocess_mode="livesum")
        self.keys = KeyWatch(suspended)
        # Set by each process's async listener loop (livemax: the worst live process).
        loop_lag = Gauge(names.EVENT_LOOP_LAG.family, names.EVENT_LOOP_LAG.help, registry=None,
                         multiprocess_mode="livemax")
        LAG_OBSERVERS.append(loop_lag.set)
        self.client = ClientFigures()
        self.hook = MetricsHook(self.consumed, self.duration, self.refused, self.linger, self._max_reconsume,
                                self.latency, self.redeliveries, self.keys, self._key_mode)
        self._limits: dict[tuple[str, str], int] = {}
        self._key_modes: dict[tuple[str, str], bool] = {}
        self.server: object | None = None

    # -- serving (main process) --------------------------------------------------------------------

    def serve(self) -> bool:
        """Start the HTTP endpoint; a port already in use is logged and the worker goes on."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(cast("Collector", _WorkerCollector(self)))
        port, addr = self.settings.metrics_port, self.settings.metrics_addr
        assert port is not None
        try:
            self.server = start_http_server(port, addr, registry)
        except OSError as exc:
            log.error(
                "mqorder: cannot serve worker metrics on %s:%d (%s); this worker goes on consuming "
                "without a metrics endpoint: give each worker on a host its own MQORDER_METRICS_PORT",
                addr, port, exc,
            )
            return False
        log.info("mqorder: worker metrics on http://%s:%d/metrics", addr, port)
        return True

    def collect_main(self) -> Iterator[Metric]:
        """The main process's own figures, read at scrape time."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.client
        if c.locks_held is not None:
            yield GaugeMetricFamily(names.LOCKS_HELD.name, names.LOCKS_HELD.help, value=c.locks_held)
        yield CounterMetricFamily(names.LOCK_TAKEOVERS.family, names.LOCK_TAKEOVERS.help, value=c.lock_takeovers)
        if self.capacity is not None:
            stamp, waiting, _spare = self.capacity.read()
            if 0.0 <= time.monotonic() - stamp < CAPACITY_STALE_S:
                yield GaugeMetricFamily(names.WAITING.name, names.WAITING.help, value=waiting)

    # -- helpers -------------------------------------------------------------------------------------

    def _max_reconsume(self, group: str, topic: str) -> int:
        """The DLQ threshold of (group, topic), as the engine computes it."""
        limit = self._limits.get((group, topic))
        if limit is None:
            spec = get_listener(group, topic)
            own = spec.max_reconsume_times if spec is not None else None
            limit = self._limits[(group, topic)] = own if own is not None else self.settings.max_reconsume_times
        return limit


    def _key_mode(self, group: str, topic: str) -> bool:
        """Whether (group, topic)'s listener orders by key (``ordering="key"``); asked per call."""
        key = self._key_modes.get((group, topic))
        if key is None:
            spec = get_listener(group, topic)
            key = self._key_modes[(group, topic)] = spec is not None and spec.ordering is Ordering.KEY
        return key


class _WorkerCollector:
    """What the main process answers a scrape with: every process's files, then its own figures."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.metrics = metrics
        self.merge = MultiProcessCollector.merge

    def collect(self) -> Iterator[Metric]:
        path = self.metrics.path
        multiproc.reap_dead(path)
        # MultiProcessCollector.collect() minus the files not sized yet (multiproc.metric_files).
        yield from self.merge(multiproc.metric_files(path), accumulate=True)
        yield from self.metrics.collect_main()


# -- the process-wide instance and the call sites' entry points ---------------------------------------

_active: WorkerMetrics | None = None
_start_lock = threading.Lock()


def start(settings: Settings, capacity: CapacityReader | None = None) -> WorkerMetrics | None:
    """Set up this worker's metrics if ``MQORDER_METRICS_PORT`` is set (else None).

    Called by the worker bootstep's constructor: in the main process, before the pool forks, so
    the children inherit the hook, the metrics and the directory.
    """
    global _active
    if settings.metrics_port is None:
        return None
    with _start_lock:
        if _active is None:
            m = WorkerMetrics(settings, capacity)
            register_consume_message_hook(m.hook)
            m.serve()
            _active = m
        return _active


def before_run(engine: ConsumerEngine) -> None:
    """A ConsumeRequest starts on this thread: watch its engine's lingering (once per engine)."""
    m = _active
    if m is not None:
        m.linger.mark(False)
        m.linger.watch(engine)


def after_run(sub: str, mq: MessageQueue, outcome: Outcome | None) -> None:
    """A ConsumeRequest ended with ``outcome`` (None: Redis stayed unreachable)."""
    m = _active
    if m is None:
        return
    m.linger.mark(False)
    verb = "REDIS_DOWN" if outcome is None else outcome.verb.value
    group = keys.group_of_sub(sub)
    m.runs.labels(group, mq.topic, verb).inc()
    m.hook.run_ended(group, mq.topic, mq.key, verb)


def locks_held(count: int) -> int:
    """The ``ClientInstance``'s ``lock_all`` renewed or took ``count`` locks; returns ``count``."""
    m = _active
    if m is not None:
        m.client.locks_held = count
    return count


def rebalanced(report: RebalanceReport) -> None:
    """A rebalance run by this worker's ``ClientInstance`` moved ``report.moved`` locks."""
    m = _active
    if m is not None:
        m.client.lock_takeovers += report.moved

"""The chaos runner: one scenario's cluster, assembled from four parts with one job each.

* :class:`~chaos.processes.Processes` starts, signals and stops the subprocesses (the Redis under
  test, or the Sentinel deployment or Redis Cluster under test, the ledger Redis, workers, beats);
* :class:`~chaos.traffic.Traffic` sends the paced traffic (and poison) and waits for the drain;
* :class:`~chaos.faults.Faults` injects the faults a scenario's script asks for;
* :class:`~chaos.evidence.Evidence` keeps the fault log, samples the lock table and reads the
  ledger's structured records and the DLQ for the checker.

:class:`Cluster` only wires them together and tears everything down in ``stop``; what a scenario
does lives in ``chaos/scenarios.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

from chaos.cluster_topology import ClusterSpec
from chaos.evidence import Event, Evidence, log
from chaos.faults import Faults
from chaos.listeners import TOPIC
from chaos.processes import Processes
from chaos.topology import SentinelSpec
from chaos.traffic import Ack, Traffic
from mqorder import Producer
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import Settings, load_settings
from mqorder.store.brokers import BrokerRegistry

__all__ = ["Ack", "Cluster", "Event", "log"]

#: A worker subscribes to its wake channel only after it has taken its queues; a message sent in
#: between waits for the pending TTL. Traffic starts this long after every queue has an owner.
SETTLE_S = 1.5


def last_error(logfile: Path | None) -> str:
    """The last exception line of a crashed worker's log (``redis.exceptions.ResponseError: ...``),
    for the report to say why it died. Only shown to the reader: no check rests on a log line."""
    if logfile is None or not logfile.exists():
        return ""
    lines = logfile.read_bytes()[-20_000:].decode(errors="replace").splitlines()
    return next((ln.strip()[:300] for ln in reversed(lines)
                 if ln[:1].isalpha() and ("Error: " in ln or "Exception: " in ln)), "")


class Cluster:
    """Processes, traffic, faults and evidence of one scenario; ``stop`` always undoes ``start``."""

    def __init__(
        self,
        name: str,
        *,
        fsync: str = "everysec",
        env: dict[str, str] | None = None,
        workers: int = 3,
        concurrency: int = 2,
        queues: int = 12,
        rate: float = 300.0,
        n_keys: int = 300,
        keep_logs: bool = False,
        sentinel: SentinelSpec | None = None,
        cluster: ClusterSpec | None = None,
        groups: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.n_workers = workers
        self.n_queues = queues
        self.rate = rate
        self.n_keys = n_keys
        self.keep_logs = keep_logs
        self.env_extra = dict(env or {})
        self.sentinel = sentinel
        self.cluster = cluster
        #: The consumer groups of the workers beyond the chaos one, and the topic each consumes
        #: (``groups-kill``: ``listeners.EXTRA_GROUPS``, registered by the workers through the env).
        self.groups = dict(groups or {})
        self.procs = Processes(name, fsync=fsync, env=self.env_extra, concurrency=concurrency, sentinel=sentinel,
                               cluster=cluster)
        # Set by start(), once the Redis under test answers.
        self.settings: Settings | None = None
        self.evidence: Evidence | None = None
        self.traffic: Traffic | None = None
        self.faults: Faults | None = None

    def start(self) -> Cluster:
        self.procs.start_servers()
        url = self.procs.url
        # The processes' settings (a cluster's adds Celery's broker, once the ledger Redis is up).
        self.settings = load_settings(redis_url=url, **{
            k.removeprefix("MQORDER_").lower(): v for k, v in self.procs.env_extra.items() if k.startswith("MQORDER_")
        })
        brokers = BrokerRegistry(url)
        locks = RebalanceLockManager(brokers, self.settings.lock_max_live_time_ms)
        p = Producer(url)
        by_topic: dict[str, list[MessageQueue]] = {}
        for topic in dict.fromkeys([TOPIC, *self.groups.values()]):
            p.create_topic(topic, queues=self.n_queues)
            by_topic[topic] = p.describe_topic(topic).message_queues
        p.close()
        mqs = by_topic[TOPIC]
        groups = {g: by_topic[topic] for g, topic in self.groups.items()}
        self.evidence = Evidence(self.name, url, self.procs.ledger_url, brokers, locks, mqs, groups=groups)
        spec = self.sentinel or self.cluster
        self.traffic = Traffic(url, brokers, mqs, rate=self.rate, n_keys=self.n_keys,
                               wait_replicas=spec.send_wait if spec is not None else None, groups=groups)
        self.faults = Faults(self.procs, self.evidence, self.traffic)
        workers = [self.procs.start_worker(self.procs.new_worker_name(), wait=False) for _ in range(self.n_workers)]
        for w in workers:
            self.procs.wait_registered(w)
        self.procs.start_beat()
        self.evidence.start_monitor(on_tick=self._record_crashes)
        self.evidence.wait_all_owned(30)
        time.sleep(SETTLE_S)
        return self

    def _record_crashes(self) -> None:
        """A worker that exited without being killed or stopped by the runner becomes an event."""
        assert self.evidence is not None
        for w in self.procs.newly_crashed():
            self.evidence.event("crash", w.name, fault=False, info={"returncode": w.returncode(), "client": w.hostname,
                                                                    "last_error": last_error(w.logfile)})

    def quiesce(self) -> None:
        """Stop the producer, the monitor, every worker and beat; the two Redis servers stay up so
        the records written during shutdown can still be read."""
        if self.traffic is not None and self.traffic.started:
            for p in self.traffic.producers:
                p.stop_event.set()
            for p in self.traffic.producers:
                p.join(10)
        if self.evidence is not None:
            self.evidence.stop_monitor()
        self.procs.stop_celery()

    def stop(self) -> None:
        self.quiesce()
        if self.faults is not None:
            self.faults.ctl.close()
        if self.evidence is not None:
            self.evidence.close()
        self.procs.stop_servers()
        self.procs.remove_files(self.keep_logs)

"""The chaos scenarios: each one a timeline of faults over steady traffic, then a drain and the
checker. ``run(scenario)`` starts everything in a ``try/finally`` and always stops it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from chaos import listeners
from chaos.checker import Result, RunData, check, parse_ledger
from chaos.runner import Cluster, log

#: The lock lease variant: a 6 s lease renewed every 2 s, so a pause or a beat outage of 10-15 s
#: is longer than the lease itself, not only longer than the 3 s heartbeat timeout.
SHORT_LEASE = {"MQORDER_LOCK_MAX_LIVE_TIME": "6", "MQORDER_LOCK_INTERVAL": "2"}


@dataclass
class Scenario:
    name: str
    title: str
    script: Callable[[Cluster, bool], None]
    fsync: str = "everysec"
    env: dict[str, str] = field(default_factory=dict)
    enforce: set[str] = field(default_factory=set)
    workers: int = 3
    rate: float = 300.0


class Clock:
    """Sleep until ``t`` seconds after the scenario's traffic started."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def at(self, t: float) -> None:
        delay = self.t0 + t - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def now(self) -> float:
        return time.monotonic() - self.t0


class Deleter(threading.Thread):
    """Every ``every`` seconds, a one-second burst of taking ConsumeRequest tasks away from the
    Celery broker (lost tasks)."""

    def __init__(self, c: Cluster, every: float) -> None:
        super().__init__(name="chaos-deleter", daemon=True)
        self.c = c
        self.every = every
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every):
            try:
                self.c.steal_tasks(1.0)
            except redis.RedisError:
                pass  # the Redis under test may be down in the combined scenario

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


# -- timelines ------------------------------------------------------------------------------------


def kill_loop(c: Cluster, quick: bool) -> None:
    """kill -9 of the worker owning the most queues, restarted (same name) 7 s later."""
    clock = Clock()
    clock.at(4)
    for _ in range(2 if quick else 6):
        e = c.kill_worker()
        time.sleep(7)
        if e is not None:
            c.restart_worker(e.target)
        time.sleep(4)


def sigstop(c: Cluster, quick: bool, seconds: float = 8.0) -> None:
    clock = Clock()
    clock.at(4)
    for i in range(1 if quick else 2):
        c.pause_worker(seconds, in_call=i == 0)  # the first pause lands inside listener calls
        time.sleep(8)


def sigstop_lease(c: Cluster, quick: bool) -> None:
    sigstop(c, quick, seconds=10.0)


def sigstop_pool_process(c: Cluster, quick: bool) -> None:
    clock = Clock()
    clock.at(4)
    for _ in range(1 if quick else 2):
        c.pause_pool_process(12.0)
        time.sleep(6)


def redis_restart(c: Cluster, quick: bool) -> None:
    clock = Clock()
    clock.at(6)
    for _ in range(1 if quick else 2):
        c.restart_redis(down=3.0)
        time.sleep(15)  # longer than the pending TTL, so each recovery is seen on its own


def churn(c: Cluster, quick: bool) -> None:
    """Every 3 s a worker joins or (warm shutdown) leaves; 3 to 4 workers alive."""
    clock = Clock()
    for i in range(6 if quick else 14):
        clock.at(3 + 3 * i)
        if len(c.alive_workers()) <= 3:
            c.join_worker()
        else:
            c.leave_worker()
    time.sleep(4)


def lost_tasks(c: Cluster, quick: bool) -> None:
    clock = Clock()
    clock.at(3)
    d = Deleter(c, 4.0)
    d.start()
    try:
        clock.at(18 if quick else 36)
    finally:
        d.stop()
    time.sleep(4)


def poison(c: Cluster, quick: bool) -> None:
    clock = Clock()
    clock.at(4)
    c.inject_poison(4)
    if not quick:
        clock.at(14)
        c.inject_poison(3)
    clock.at(12 if quick else 24)


def beat(c: Cluster, quick: bool) -> None:
    """Beat down longer than the 6 s lease; back; then two beats at once during join/leave."""
    clock = Clock()
    clock.at(4)
    c.kill_beat()
    time.sleep(10 if quick else 15)
    c.beat_start()
    time.sleep(8)
    e = c.event("beat-double", "beat")
    second = c.start_beat()
    time.sleep(3)
    c.join_worker()
    time.sleep(6)
    c.leave_worker()
    time.sleep(5 if quick else 10)
    second.stop()
    e.t_end = time.time()


def everything(c: Cluster, quick: bool) -> None:
    """All faults in one run: kills, lost tasks, beat outage, SIGSTOP, Redis restart, churn,
    poison, two beats."""
    clock = Clock()
    d = Deleter(c, 3.0)
    d.start()
    try:
        clock.at(3)
        c.inject_poison(2)
        clock.at(5)
        e = c.kill_worker()
        time.sleep(7)
        if e is not None:
            c.restart_worker(e.target)
        clock.at(16)
        c.kill_beat()
        clock.at(18)
        c.pause_worker(10.0, in_call=True)
        clock.at(32)
        c.beat_start()
        clock.at(34)
        c.restart_redis(down=2.0)
        if not quick:
            clock.at(42)
            c.join_worker()
            clock.at(46)
            c.leave_worker()
            clock.at(50)
            c.join_worker()
            clock.at(54)
            c.leave_worker()
            clock.at(56)
            ev = c.event("beat-double", "beat")
            second = c.start_beat()
            clock.at(60)
            e = c.kill_worker()
            time.sleep(7)
            if e is not None:
                c.restart_worker(e.target)
            clock.at(70)
            second.stop()
            ev.t_end = time.time()
        clock.at(72 if not quick else 42)
    finally:
        d.stop()


def smoke(c: Cluster, quick: bool) -> None:
    """The ``make test`` smoke: one kill -9 (and restart), two lost-task deletions."""
    clock = Clock()
    clock.at(4)
    e = c.kill_worker()
    time.sleep(6)
    if e is not None:
        c.restart_worker(e.target)
    clock.at(13)
    c.steal_tasks(1.0)
    clock.at(16)
    c.steal_tasks(1.0)
    clock.at(20)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("kill", "kill -9 of a queue owner, repeatedly, with restarts (defaults)", kill_loop,
             enforce={"failover_target"}),
    Scenario("sigstop", "SIGSTOP of a queue owner past the 3 s liveness lease (8 s), then SIGCONT", sigstop),
    Scenario("sigstop-lease", "SIGSTOP past the lock lease too (6 s lease, 10 s pause), then SIGCONT",
             sigstop_lease, env=dict(SHORT_LEASE)),
    Scenario("sigstop-child", "SIGSTOP of one pool process inside a listener call for 12 s, past its 5 s run "
             "lease (the worker's main process keeps heartbeating)", sigstop_pool_process,
             env={"MQORDER_RUN_LEASE": "5"}),
    Scenario("redis-always", "Redis SIGKILLed and restarted from its AOF (appendfsync always)", redis_restart,
             fsync="always"),
    Scenario("redis-everysec", "Redis SIGKILLed and restarted from its AOF (appendfsync everysec)",
             redis_restart, fsync="everysec"),
    Scenario("churn", "workers joining and leaving (warm shutdown) every 3 s", churn),
    Scenario("lost-tasks", "ConsumeRequest tasks taken from the Celery broker (1 s bursts every 4 s)", lost_tasks,
             enforce={"stall_bound"}),
    Scenario("poison", "poison messages that always SUSPEND (max_reconsume_times=3, 1 s suspend)", poison,
             enforce={"poison_bound"}),
    Scenario("beat", "beat killed past the 6 s lease and restarted; then two beats at once", beat,
             env={**SHORT_LEASE, "MQORDER_REBALANCE_INTERVAL": "5"}, enforce={"beat"}),
    Scenario("all", "all of the above together (6 s lease, appendfsync always)", everything, fsync="always",
             env={**SHORT_LEASE, "MQORDER_REBALANCE_INTERVAL": "5"}),
]}

SMOKE = Scenario("smoke", "smoke: one kill -9 and two lost-task bursts", smoke)


def run(sc: Scenario, *, quick: bool = False, keep_logs: bool = False, drain_timeout: float = 60.0) -> Result:
    log(f"== scenario {sc.name}: {sc.title}")
    c = Cluster(sc.name, fsync=sc.fsync, env=sc.env, workers=sc.workers, rate=sc.rate, keep_logs=keep_logs)
    data: RunData | None = None
    try:
        c.start()
        c.start_traffic()
        sc.script(c, quick)
        c.stop_traffic()
        drained = c.drain(drain_timeout)
        time.sleep(1.0)  # let the last listener calls finish their ledger writes
        assert c.producer is not None and c.monitor is not None and c.settings is not None
        entries = parse_ledger(c.read_ledger())
        dlq = c.read_dlq()
        c.stop_processes()
        data = RunData(
            scenario=sc.name, fsync=sc.fsync, entries=entries, acks=list(c.producer.acks),
            unknown=list(c.producer.unknown), poison=list(c.poison), dlq=dlq, events=list(c.events),
            samples=list(c.monitor.samples), worker_log=c.worker_logs(), beat_logs=c.beat_logs(),
            drained=drained, batch=c.settings.pull_batch_size, max_reconsume=listeners.MAX_RECONSUME,
            suspend_s=listeners.SUSPEND_MS / 1000, enforce=set(sc.enforce),
            pending_ttl=c.settings.pending_ttl, sweep_interval=c.settings.sweep_interval,
        )
    finally:
        c.stop()
    res = check(data)
    log(f"== {sc.name}: {'PASS' if res.passed else 'FAIL'}: produced {res.produced}, handled {res.handled}, "
        f"violations {len(res.violations)}, lost {len(res.lost)}, dups {res.duplicates}, "
        f"failover max {res.failover_max} p99 {res.failover_p99}")
    for p in res.problems:
        log(f"   problem: {p}")
    return res

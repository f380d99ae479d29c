"""Send-to-handle latency at a steady, paced rate (default 1,000 msg/s), mqorder and naive Celery.

A paced producer in this process sends one message at a time on a fixed schedule (start + i/rate,
never bursting to catch up faster than the schedule). The body carries ``time.time_ns()`` taken
just before the send call; the handler computes ``time.time_ns() - sent`` (same machine, same
clock) and pushes it to a Redis list. One second of warm-up traffic is sent and discarded first,
and again right before every measured run (the configurations' runs are interleaved, so a worker
set idles for the others' runs in between, and a first second after an idle spell is a cold
start, not the steady rate the section measures): its bodies start with ``WARMUP_PREFIX`` and
their latency is not recorded.

mqorder: stock workers, the bench ``latency`` listener, stock settings (consume batch 1, pull 32);
the topic exists before the workers join, so they own its queues from the start and every send
wakes the owner through ``send.lua``'s pub/sub path when its queue is idle. Several worker
configurations (pool, -c, settings such as ``MQORDER_CONSUME_LINGER_MS``) are measured side by
side, each on its own redis-server, their runs interleaved.
Naive: the naive Celery app's task (per-key lock, then record), its workers consuming from the start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    Config,
    Workload,
    broker_env,
    celery_broker_url,
    celery_task_totals,
    cpu_s,
    ctl_app,
    log,
    machine_cpu,
    mq_env,
    percentile,
    queues_of,
    rabbitmq_pid,
    redis_and_client,
    server_pid,
    start_mq_workers,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import LAT_KEY, WARMUP_PREFIX
from bench.mqorder_drain import CONSUME_TASK
from mqorder import Producer

#: Seconds of discarded traffic right before every measured run.
WARMUP_S = 1.0


def paced(n: int, rate: float, send: Callable[[int], None]) -> float:
    """Call ``send(i)`` for i < n on a fixed schedule; returns the achieved rate."""
    t0 = time.perf_counter()
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        send(i)
    return n / (time.perf_counter() - t0)


def _wait_len(r: Any, key: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while r.llen(key) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {r.llen(key)}/{n} latencies recorded after {timeout}s")
        time.sleep(0.02)


def _summary(lat_ns: list[int], achieved: float) -> dict[str, float]:
    ms = [x / 1e6 for x in lat_ns]
    return {"samples": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms), "send_rate": achieved}


@dataclass
class MqLatSpec:
    """One mqorder worker configuration of the latency section."""

    key: str
    label: str
    pool: str = "prefork"
    concurrency: int = 1
    #: Extra settings for the workers (e.g. ``MQORDER_CONSUME_LINGER_MS``).
    env: dict[str, str] = field(default_factory=dict)
    #: Celery's broker: ``redis`` (the configuration's redis-server) or ``rabbitmq`` (a vhost of its own).
    celery_broker: str = "redis"
    #: Another source tree for the workers (a copy of another commit): an A/B of two engines in one run.
    root: str = ""


class _MqLatRig:
    """A redis-server, a topic and ``workers`` stock workers of one configuration, ready to measure."""

    def __init__(self, st: contextlib.ExitStack, cfg: Config, spec: MqLatSpec, *, workers: int, queues: int,
                 n_keys: int) -> None:
        self.spec = spec
        srv, self.r = redis_and_client(st)
        self.topic, self.group = "lat", "g-lat"
        self.p = Producer(srv.url)
        st.callback(self.p.close)
        self.p.create_topic(self.topic, queues=queues)
        broker = celery_broker_url(st, spec.celery_broker, srv.url)
        extra = dict(spec.env)
        if spec.root:
            extra["PYTHONPATH"] = spec.root
        env = mq_env(srv.url, topic=self.topic, group=self.group, mode="latency", **broker_env(broker, srv.url),
                     **extra)
        log(f"latency mqorder [{spec.key}]: starting {workers} worker(s) -P {spec.pool} -c {spec.concurrency}"
            + (f" {spec.env}" if spec.env else ""))
        self.ws = start_mq_workers(st, srv.url, [f"lat-{spec.key}-w{i}" for i in range(workers)], env,
                                   spec.concurrency, cfg.logdir / "latency", pool=spec.pool,
                                   cwd=Path(spec.root) if spec.root else None)
        self.mqs = queues_of(self.topic, queues)
        self.wl = Workload(n_keys)  # same seed: every configuration gets the same key sequence
        self.app = ctl_app(broker)
        st.callback(self.app.close)
        self.hostnames = [w.hostname for w in self.ws]
        self.redis_pid = server_pid(srv)
        #: RabbitMQ's CPU counts too when it is Celery's broker (it serves every vhost: the runs of the
        #: configurations are sequential, so it serves this one alone while measured).
        self.broker_pid = rabbitmq_pid() if spec.celery_broker == "rabbitmq" else 0

    def send(self, _: int) -> None:
        k, _s = self.wl.next()
        self.p.send_orderly(self.topic, str(time.time_ns()).encode(), sharding_key=f"key-{k}")

    def send_warmup(self, _: int) -> None:
        k, _s = self.wl.next()
        self.p.send_orderly(self.topic, WARMUP_PREFIX + str(time.time_ns()).encode(), sharding_key=f"key-{k}")

    def measure(self, n: int, rate: float, warmup: int = 0) -> dict[str, float]:
        """``n`` messages at ``rate``, right after ``warmup`` messages whose latency is not recorded."""
        r, ws = self.r, self.ws
        r.delete(LAT_KEY)
        if warmup:
            paced(warmup, rate, self.send_warmup)
        tasks0 = celery_task_totals(self.app, self.hostnames).get(CONSUME_TASK, 0)
        cpu_w0, cpu_r0 = tree_cpu_s(w.pid for w in ws), cpu_s(self.redis_pid)
        cpu_b0 = cpu_s(self.broker_pid) if self.broker_pid else 0.0
        busy0, cpu_p0 = machine_cpu()[0], time.process_time()
        achieved = paced(n, rate, self.send)
        cpu_p, busy = time.process_time() - cpu_p0, machine_cpu()[0] - busy0
        wait_lag_zero(r, self.group, self.mqs, 120, alive=lambda: all(w.alive() for w in ws))
        _wait_len(r, LAT_KEY, n, 30)
        cpu_w, cpu_r = tree_cpu_s(w.pid for w in ws) - cpu_w0, cpu_s(self.redis_pid) - cpu_r0
        cpu_b = cpu_s(self.broker_pid) - cpu_b0 if self.broker_pid else 0.0
        tasks = celery_task_totals(self.app, self.hostnames).get(CONSUME_TASK, 0) - tasks0
        res = _summary([int(x) for x in r.lrange(LAT_KEY, 0, -1)], achieved)
        res.update({"tasks_per_msg": tasks / n, "worker_cpu_us_per_msg": cpu_w / n * 1e6,
                    "redis_cpu_us_per_msg": cpu_r / n * 1e6, "window_s": n / achieved,
                    "producer_cpu_us_per_msg": cpu_p / n * 1e6, "machine_busy_cores": busy / (n / achieved)})
        if self.broker_pid:
            res["rabbitmq_cpu_us_per_msg"] = cpu_b / n * 1e6
        return res


def mqorder_latency(cfg: Config, *, rate: float, seconds: float, runs: int, specs: list[MqLatSpec],
                    workers: int = 2, queues: int = 16, n_keys: int = 2000) -> dict[str, list[dict[str, float]]]:
    """Measure every configuration in ``specs``, interleaved: run i of each configuration back to back
    (the order rotating from run to run), so a burst of other load on the machine falls on all of them
    alike. Each configuration has its own redis-server and workers, all started up front."""
    out: dict[str, list[dict[str, float]]] = {s.key: [] for s in specs}
    with contextlib.ExitStack() as st:
        rigs = [_MqLatRig(st, cfg, s, workers=workers, queues=queues, n_keys=n_keys) for s in specs]
        for run in range(-1, runs):
            n = int(rate * (1.0 if run < 0 else seconds))
            k = max(run, 0) % len(rigs)
            for rig in rigs[k:] + rigs[:k]:
                time.sleep(0.5)  # the previous configuration's last runs end (linger included)
                res = rig.measure(n, rate, warmup=int(rate * WARMUP_S) if run >= 0 else 0)
                if run < 0:
                    continue
                res["run"] = run
                log(f"latency mqorder [{rig.spec.key}] run {run}: p50 {res['p50_ms']:.2f} ms "
                    f"p99 {res['p99_ms']:.2f} ms max {res['max_ms']:.1f} ms at {res['send_rate']:,.0f} msg/s "
                    f"({res['samples']} samples); {res['tasks_per_msg']:.3f} tasks/msg, "
                    f"worker CPU {res['worker_cpu_us_per_msg']:.0f} µs/msg, "
                    f"redis CPU {res['redis_cpu_us_per_msg']:.0f} µs/msg, "
                    f"producer CPU {res['producer_cpu_us_per_msg']:.0f} µs/msg, "
                    f"machine busy {res['machine_busy_cores']:.2f} cores")
                out[rig.spec.key].append(res)
    return out


def naive_latency(cfg: Config, *, rate: float, seconds: float, runs: int, concurrency: int,
                  workers: int = 2, n_keys: int = 2000) -> list[dict[str, float]]:
    from bench.naive import TASK, NaiveCluster
    from bench.naive_app import LAT_KEY as NAIVE_LAT

    out = []
    with contextlib.ExitStack() as st:
        log(f"latency naive: starting {workers} worker(s) -c {concurrency}")
        c = NaiveCluster(st, cfg, workers=workers, concurrency=concurrency, tag="nlat")
        queue = "naive-lat"
        c.consume(queue)
        wl = Workload(n_keys)
        with c.app.producer_or_acquire() as prod:

            def send(_: int) -> None:
                k, s = wl.next()
                c.app.send_task(TASK, args=(f"key-{k}", s, time.time_ns()), queue=queue, producer=prod)

            for run in range(-1, runs):
                n = int(rate * (1.0 if run < 0 else seconds))
                c.r.delete(NAIVE_LAT)
                achieved = paced(n, rate, send)
                _wait_len(c.r, NAIVE_LAT, n, 300)
                if run < 0:
                    continue
                res = _summary([int(x) for x in c.r.lrange(NAIVE_LAT, 0, -1)], achieved)
                log(f"latency naive run {run}: p50 {res['p50_ms']:.2f} ms p99 {res['p99_ms']:.2f} ms "
                    f"max {res['max_ms']:.1f} ms at {achieved:,.0f} msg/s ({res['samples']} samples)")
                out.append(res)
    return out

"""Send-to-handle latency at a steady, paced rate (default 1,000 msg/s), mqorder and naive Celery.

A paced producer in this process sends one message at a time on a fixed schedule (start + i/rate,
never bursting to catch up faster than the schedule). The body carries ``time.time_ns()`` taken
just before the send call; the handler computes ``time.time_ns() - sent`` (same machine, same
clock) and pushes it to a Redis list. One second of warm-up traffic is sent and discarded first.

mqorder: stock workers, the bench ``latency`` listener, stock settings (consume batch 1, pull 32);
the topic exists before the workers join, so they own its queues from the start and every send
wakes the owner through ``send.lua``'s pub/sub path when its queue is idle.
Naive: the naive Celery app's task (per-key lock, then record), its workers consuming from the start.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from bench.common import (
    Config,
    Workload,
    celery_task_totals,
    client,
    cpu_s,
    ctl_app,
    log,
    mq_env,
    percentile,
    queues_of,
    redis_server,
    start_mq_workers,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import LAT_KEY
from bench.mqorder_drain import CONSUME_TASK
from mqorder import Producer


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


def mqorder_latency(cfg: Config, *, rate: float, seconds: float, runs: int, concurrency: int,
                    workers: int = 2, queues: int = 16, n_keys: int = 2000) -> list[dict[str, float]]:
    out = []
    with contextlib.ExitStack() as st:
        srv = redis_server(st)
        r = client(srv.url)
        st.callback(r.close)
        topic, group = "lat", "g-lat"
        p = Producer(srv.url)
        st.callback(p.close)
        p.create_topic(topic, queues=queues)
        env = mq_env(srv.url, topic=topic, group=group, mode="latency")
        log(f"latency mqorder: starting {workers} worker(s) -c {concurrency}")
        ws = start_mq_workers(st, srv.url, [f"lat-w{i}" for i in range(workers)], env, concurrency, cfg.logdir / "latency")
        mqs = queues_of(topic, queues)
        wl = Workload(n_keys)
        app = ctl_app(srv.url)
        st.callback(app.close)
        hostnames = [w.hostname for w in ws]
        redis_pid = srv.proc.pid if srv.proc else 0

        def send(_: int) -> None:
            k, _s = wl.next()
            p.send_orderly(topic, str(time.time_ns()).encode(), sharding_key=f"key-{k}")

        for run in range(-1, runs):
            n = int(rate * (1.0 if run < 0 else seconds))
            r.delete(LAT_KEY)
            tasks0 = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0)
            cpu_w0, cpu_r0 = tree_cpu_s(w.pid for w in ws), cpu_s(redis_pid)
            achieved = paced(n, rate, send)
            wait_lag_zero(r, group, mqs, 120)
            _wait_len(r, LAT_KEY, n, 30)
            cpu_w, cpu_r = tree_cpu_s(w.pid for w in ws) - cpu_w0, cpu_s(redis_pid) - cpu_r0
            tasks = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0) - tasks0
            if run < 0:
                continue
            res = _summary([int(x) for x in r.lrange(LAT_KEY, 0, -1)], achieved)
            res.update({"tasks_per_msg": tasks / n, "worker_cpu_us_per_msg": cpu_w / n * 1e6,
                        "redis_cpu_us_per_msg": cpu_r / n * 1e6, "window_s": n / achieved})
            log(f"latency mqorder run {run}: p50 {res['p50_ms']:.2f} ms p99 {res['p99_ms']:.2f} ms "
                f"max {res['max_ms']:.1f} ms at {achieved:,.0f} msg/s ({res['samples']} samples); "
                f"{res['tasks_per_msg']:.2f} tasks/msg, worker CPU {res['worker_cpu_us_per_msg']:.0f} µs/msg, "
                f"redis CPU {res['redis_cpu_us_per_msg']:.0f} µs/msg")
            out.append(res)
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

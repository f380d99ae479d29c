"""Peak RSS of one worker draining a 1,000,000-message backlog alone.

The backlog is written once (``send_orderly_batch``, 16 queues, 2,000 keys). Each run starts one
fresh stock worker whose listener belongs to a new consumer group (offset 0 on every queue), so
every run drains the full backlog from the start. The summed RSS (``VmRSS``, read with psutil) of
the worker's main process and all its descendants (the prefork pool) is sampled every 0.2 s from
the moment the worker process starts until the group's lag is 0; every figure is in MiB. Flow
control (pull batch 32 and ``pull_threshold_for_queue``) is what must keep this flat regardless of
the backlog size.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from bench.common import (
    ROOT,
    Config,
    log,
    mq_env,
    produce_backlog,
    queues_of,
    redis_and_client,
    rss_mib,
    server_pid,
    total_lag,
    tree_rss_mib,
)
from mqorder import keys
from mqorder.testing.launcher import WorkerProcess


def run(cfg: Config, *, messages: int, concurrency: int, runs: int = 3, queues: int = 16, n_keys: int = 2000,
        timeout: float = 900.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        topic = "mem"
        log(f"memory: producing {messages:,} messages")
        produce_s = produce_backlog(srv.url, topic, queues, messages, n_keys)
        redis_rss = rss_mib(server_pid(srv))
        mqs = queues_of(topic, queues)
        for run in range(runs):
            group = f"g-mem-{run}"
            env = mq_env(srv.url, topic=topic, group=group)
            w = WorkerProcess(f"mem{run}", env=env, concurrency=concurrency,
                              logfile=cfg.logdir / "memory" / f"mem{run}.log", cwd=ROOT)
            (cfg.logdir / "memory").mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            w.start()
            try:
                samples: list[tuple[float, float, int]] = []  # (seconds since start, MiB, processes)
                deadline = time.monotonic() + timeout
                registered_at = None
                registered_mib = 0.0
                while True:
                    mib, nproc = tree_rss_mib(w.pid)
                    samples.append((time.perf_counter() - t0, mib, nproc))
                    if registered_at is None and r.zscore(keys.clients(), w.hostname) is not None:
                        registered_at = time.perf_counter()
                        registered_mib = mib
                    if registered_at is not None and total_lag(r, group, mqs) == 0:
                        break
                    if not w.alive():
                        raise RuntimeError(f"memory worker exited with {w.proc.returncode if w.proc else '?'}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"memory run {run}: lag {total_lag(r, group, mqs)} after {timeout}s")
                    time.sleep(0.2)
                drained_s = time.perf_counter() - (registered_at or t0)
            finally:
                w.stop(30)
            peak = max(s[1] for s in samples)
            res = {
                "run": run, "messages": messages, "peak_rss_mib": peak,
                "registered_rss_mib": registered_mib, "final_rss_mib": samples[-1][1],
                "processes": max(s[2] for s in samples), "samples": len(samples), "drain_s": drained_s,
                "rate": messages / drained_s, "produce_s": produce_s, "redis_rss_mib_after_produce": redis_rss,
                "series": [(round(t, 2), round(m, 1)) for t, m, _ in samples],
            }
            log(f"memory run {run}: peak {res['peak_rss_mib']:.1f} MiB over {res['processes']} processes, "
                f"drained {messages:,} in {drained_s:.1f}s ({res['rate']:,.0f} msg/s)")
            out.append(res)
    return out

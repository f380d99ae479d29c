"""Celery single-lane baseline: each shard has a dedicated queue consumed by one ``-c 1`` worker.

Messages are sharded by ``crc32(key) % shards``; shard ``i`` goes to its own queue, consumed by
worker ``i`` alone with one pool process, so order holds per shard (FIFO, one consumer). The
handler is a no-op. Workers start idle; per run the tasks (and one ``lane_done`` marker per shard,
last in each queue) are published to fresh queues, the clock starts when each worker is told to
consume its shard's queue and stops when every shard's marker has run.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from typing import Any

from bench.common import (
    Config,
    Workload,
    log,
    redis_and_client,
    start_celery_workers,
)

APP = "bench.lane_app"


def run(cfg: Config, *, messages: int, n_keys: int = 2000, shards: int = 2, runs: int = 3, warmup: int = 1000,
        timeout: float = 600.0) -> list[dict[str, Any]]:
    from bench.lane_app import DONE_KEY

    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        log(f"single-lane: starting {shards} worker(s) -c 1")
        workers, app = start_celery_workers(st, srv.url, APP, [f"lane{i}" for i in range(shards)], concurrency=1,
                                            logdir=cfg.logdir / "single_lane", ctl_name="bench-lane-ctl")
        for run in range(-1, runs):
            n = warmup if run < 0 else messages
            queues = [f"lane-run{run + 1}-{s}" for s in range(shards)]
            wl = Workload(n_keys)
            with app.producer_or_acquire() as prod:
                for _ in range(n):
                    k, seq = wl.next()
                    key = f"key-{k}"
                    shard = zlib.crc32(key.encode()) % shards
                    app.send_task("bench.lane.handle", args=(key, seq, f'{{"k":{k},"s":{seq}}}'),
                                  queue=queues[shard], producer=prod)
                for s in range(shards):
                    app.send_task("bench.lane.done", args=(s,), queue=queues[s], producer=prod)
            r.delete(*[DONE_KEY.format(s) for s in range(shards)])
            t0 = time.perf_counter()
            for s, w in enumerate(workers):
                app.control.add_consumer(queues[s], destination=[w.hostname], reply=True, timeout=5)
            deadline = time.monotonic() + timeout
            while r.exists(*[DONE_KEY.format(s) for s in range(shards)]) < shards:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"single-lane run {run}: not drained after {timeout}s")
                time.sleep(0.02)
            secs = time.perf_counter() - t0
            for s, w in enumerate(workers):
                app.control.cancel_consumer(queues[s], destination=[w.hostname], reply=True, timeout=5)
            if run < 0:
                log(f"single-lane warm-up: {n} msgs in {secs:.2f}s")
                continue
            out.append({"run": run, "messages": n, "seconds": secs, "rate": n / secs})
            log(f"single-lane run {run}: {n} msgs in {secs:.2f}s = {n / secs:,.0f} msg/s")
    return out

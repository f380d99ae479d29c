"""Naive Celery baseline: one task per message, per-key ``SET NX PX`` lock, retry on contention.

Workers (``python -m celery -A bench.naive_app worker``) start idle on a private queue. For each
run the tasks are published to a fresh queue nobody consumes yet; the clock starts when the
workers are told to consume it (``control.add_consumer``) and stops when every message has been
handled once (``LLEN bench:naive:rec``). A warm-up run precedes the measured ones.

Keys delivered out of order are counted from the handling order recorded by the tasks.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any

from bench.common import (
    HOST,
    Config,
    Workload,
    celery_task_totals,
    log,
    redis_and_client,
    start_celery_workers,
)

APP = "bench.naive_app"
TASK = "bench.naive.handle"


def out_of_order_keys(records: list[bytes]) -> tuple[int, int]:
    """(keys whose handled seq sequence is not strictly increasing, keys seen)."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for raw in records:
        k, s = raw.decode().split("|")
        seqs[k].append(int(s))
    bad = sum(1 for v in seqs.values() if any(b <= a for a, b in zip(v, v[1:], strict=False)))
    return bad, len(seqs)


class NaiveCluster:
    """Naive workers on their own redis-server, plus a publishing app."""

    def __init__(self, stack: contextlib.ExitStack, cfg: Config, *, workers: int, concurrency: int,
                 tag: str) -> None:
        self.srv, self.r = redis_and_client(stack)
        self.workers, self.app = start_celery_workers(stack, self.srv.url, APP, [f"{tag}{i}" for i in range(workers)],
                                                      concurrency=concurrency, logdir=cfg.logdir / tag,
                                                      ctl_name="bench-naive-ctl")
        self.hostnames = [w.hostname for w in self.workers]

    def publish(self, queue: str, items: list[tuple[str, int, int]]) -> None:
        with self.app.producer_or_acquire() as prod:
            for key, seq, sent_ns in items:
                self.app.send_task(TASK, args=(key, seq, sent_ns), queue=queue, producer=prod)

    def consume(self, queue: str) -> None:
        self.app.control.add_consumer(queue, destination=self.hostnames, reply=True, timeout=5)

    def stop_consuming(self, queue: str) -> None:
        self.app.control.cancel_consumer(queue, destination=self.hostnames, reply=True, timeout=5)


def _items(n: int, n_keys: int) -> list[tuple[str, int, int]]:
    w = Workload(n_keys)
    out = []
    for _ in range(n):
        k, s = w.next()
        out.append((f"key-{k}", s, 0))
    return out


def throughput(cfg: Config, *, messages: int, n_keys: int = 2000, workers: int = 2, concurrency: int = 2,
               runs: int = 3, warmup: int = 500, timeout: float = 600.0) -> list[dict[str, Any]]:
    from bench.naive_app import REC_KEY, RETRIES_KEY

    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        log(f"naive: starting {workers} worker(s) -c {concurrency}")
        c = NaiveCluster(st, cfg, workers=workers, concurrency=concurrency, tag="naive")
        for run in range(-1, runs):
            n = warmup if run < 0 else messages
            queue = f"naive-run{run + 1}"
            c.r.delete(REC_KEY, RETRIES_KEY)
            c.publish(queue, _items(n, n_keys))
            tasks0 = celery_task_totals(c.app, c.hostnames).get(TASK, 0)
            t0 = time.perf_counter()
            c.consume(queue)
            deadline = time.monotonic() + timeout
            while c.r.llen(REC_KEY) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"naive run {run}: {c.r.llen(REC_KEY)}/{n} handled after {timeout}s")
                time.sleep(0.02)
            secs = time.perf_counter() - t0
            c.stop_consuming(queue)
            recs = c.r.lrange(REC_KEY, 0, -1)
            bad, seen = out_of_order_keys(recs)
            retries = int(c.r.get(RETRIES_KEY) or 0)
            tasks = celery_task_totals(c.app, c.hostnames).get(TASK, 0) - tasks0
            if run < 0:
                log(f"naive warm-up: {n} msgs in {secs:.2f}s")
                continue
            res = {"run": run, "messages": n, "seconds": secs, "rate": n / secs, "out_of_order_keys": bad,
                   "keys": seen, "handled": len(recs), "retries": retries, "task_runs": tasks}
            log(f"naive run {run}: {n} msgs in {secs:.2f}s = {n / secs:,.0f} msg/s, {bad}/{seen} keys out of "
                f"order, {retries} lock retries")
            out.append(res)
    return out


__all__ = ["HOST", "NaiveCluster", "out_of_order_keys", "throughput"]

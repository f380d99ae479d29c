"""The single-lane Celery baseline's app: each shard has its own queue and one ``-c 1`` worker.

``python -m celery -A bench.lane_app worker -c 1`` (broker: ``BENCH_BROKER_URL``, JSON only).
Order holds per shard because one process consumes the shard's queue in FIFO order. The handler
is a no-op (the best case for this baseline); the runner appends one ``lane_done`` task per
shard after the messages, which stamps ``bench:lane:done:<shard>`` when the shard is drained.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

DONE_KEY = "bench:lane:done:{}"
LAT_KEY = "bench:lat"

app = Celery("bench_lane", broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
)

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["BENCH_BROKER_URL"])
    return _r


@app.task(name="bench.lane.handle")
def handle(key: str, seq: int, body: str) -> None:
    return None


@app.task(name="bench.lane.done")
def done(shard: int) -> None:
    r().set(DONE_KEY.format(shard), time.time_ns())

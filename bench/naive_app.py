"""The naive Celery baseline's app: one task per message, a per-key ``SET NX PX`` lock.

``python -m celery -A bench.naive_app worker`` (broker: ``BENCH_BROKER_URL``, JSON only). A task
that finds its key locked retries itself 50 ms later (``self.retry(countdown=0.05)``), forever.
Each handled message is recorded as ``key|seq`` on ``bench:naive:rec`` (handling order), so the
runner can count keys delivered out of order; with ``sent_ns`` set, the send-to-handle latency
is pushed to ``bench:lat`` too.
"""

from __future__ import annotations

import os
import time
import uuid

import redis
from celery import Celery

REC_KEY = "bench:naive:rec"
LAT_KEY = "bench:lat"
RETRIES_KEY = "bench:naive:retries"
LOCK_PX = 5000

app = Celery("bench_naive", broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"))
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


@app.task(name="bench.naive.handle", bind=True, max_retries=None)
def handle(self, key: str, seq: int, sent_ns: int = 0) -> None:  # noqa: ANN001
    c = r()
    lock = f"bench:naive:lock:{key}"
    if not c.set(lock, uuid.uuid4().hex, nx=True, px=LOCK_PX):
        c.incr(RETRIES_KEY)
        raise self.retry(countdown=0.05)
    pipe = c.pipeline(transaction=False)
    pipe.rpush(REC_KEY, f"{key}|{seq}")
    if sent_ns:
        pipe.rpush(LAT_KEY, time.time_ns() - sent_ns)
    pipe.delete(lock)
    pipe.execute()

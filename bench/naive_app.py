"""The naive Celery baseline's app: one task per message, a per-key ``SET NX PX`` lock.

``python -m celery -A bench.naive_app worker`` (broker: ``BENCH_BROKER_URL``, JSON only). A task
that finds its key locked retries itself 50 ms later (``self.retry(countdown=0.05)``), forever.
Each handled message is recorded as ``key|seq`` on ``bench:naive:rec`` (handling order), so the
runner can count keys delivered out of order; with ``sent_ns`` set, the send-to-handle latency
is pushed to ``bench:lat`` too.
"""

from __future__ import annotations

import time
import uuid

from bench.baseline_app import make_app, r

REC_KEY = "bench:naive:rec"
LAT_KEY = "bench:lat"
RETRIES_KEY = "bench:naive:retries"
LOCK_PX = 5000

app = make_app("bench_naive")


@app.task(name="bench.naive.handle", bind=True, max_retries=None)
def handle(self, key: str, seq: int, sent_ns: int = 0) -> None:
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

"""The single-lane Celery baseline's app: each shard has its own queue and one ``-c 1`` worker.

``python -m celery -A bench.lane_app worker -c 1`` (broker: ``BENCH_BROKER_URL``, JSON only).
Order holds per shard because one process consumes the shard's queue in FIFO order. The handler
is a no-op (the best case for this baseline); the runner appends one ``lane_done`` task per
shard after the messages, which stamps ``bench:lane:done:<shard>`` when the shard is drained.
"""

from __future__ import annotations

import time

from bench.baseline_app import make_app, r

DONE_KEY = "bench:lane:done:{}"

app = make_app("bench_lane")


@app.task(name="bench.lane.handle")
def handle(key: str, seq: int, body: str) -> None:
    return None


@app.task(name="bench.lane.done")
def done(shard: int) -> None:
    r().set(DONE_KEY.format(shard), time.time_ns())

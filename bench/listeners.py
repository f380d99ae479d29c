"""Orderly listeners for the benchmark workers (``MQORDER_LISTENERS=bench.listeners``).

Configured from the environment so one module serves every section:

* ``BENCH_TOPIC`` / ``BENCH_GROUP``: base names; with ``BENCH_LANES=n`` (default 1) the module
  registers ``n`` listeners on ``<topic>-<i>`` / ``<group>-<i>`` (i = 0..n-1), so one set of
  workers can serve several measured runs, each on a topic created only when the run starts;
* ``BENCH_MODE``: ``noop`` (returns SUCCESS, no I/O at all: completion is read from the consume
  offsets in Redis) or ``latency`` (the body is the send time in ns; one RPUSH per call of
  ``handled_ns - sent_ns`` per message to ``bench:lat``).

The consume batch size comes from ``MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE`` (settings).
"""

from __future__ import annotations

import os
import time

import redis

from mqorder import ConsumeOrderlyStatus, orderly_listener

SUCCESS = ConsumeOrderlyStatus.SUCCESS
LAT_KEY = "bench:lat"

_r: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["MQORDER_REDIS_URL"])
    return _r


def noop(msgs, ctx):
    return SUCCESS


def latency(msgs, ctx):
    now = time.time_ns()
    _redis().rpush(LAT_KEY, *[now - int(m.body) for m in msgs])
    return SUCCESS


def lane_names(topic: str, group: str, lanes: int) -> list[tuple[str, str]]:
    if lanes <= 1:
        return [(topic, group)]
    return [(f"{topic}-{i}", f"{group}-{i}") for i in range(lanes)]


def _register() -> None:
    topic = os.environ.get("BENCH_TOPIC")
    group = os.environ.get("BENCH_GROUP")
    if not topic or not group:
        return
    func = latency if os.environ.get("BENCH_MODE", "noop") == "latency" else noop
    for t, g in lane_names(topic, group, int(os.environ.get("BENCH_LANES", "1"))):
        orderly_listener(topic=t, group=g)(func)


_register()

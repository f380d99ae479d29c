"""Orderly listeners for the benchmark workers (``MQORDER_LISTENERS=bench.listeners``).

Configured from the environment so one module serves every section:

* ``BENCH_TOPIC`` / ``BENCH_GROUP``: base names; with ``BENCH_LANES=n`` (default 1) the module
  registers ``n`` listeners on ``<topic>-<i>`` / ``<group>-<i>`` (i = 0..n-1), so one set of
  workers can serve several measured runs, each on a topic created only when the run starts;
* ``BENCH_MODE``: ``noop`` (returns SUCCESS, no I/O at all: completion is read from the consume
  offsets in Redis) or ``latency`` (the body is the send time in ns; the listener takes
  ``handled_ns - sent_ns`` per message, and ``LatencyRecorder`` pushes them to ``bench:lat``) or
  ``sleep`` (the ``keys`` section:
  ``BENCH_SLEEP_MS`` of I/O per message, counting what it finished in ``bench:ok:<group>``
  (``OkCounter``); a message of sharding key ``BENCH_FAIL_KEY`` always returns SUSPEND, on the lanes
  listed in ``BENCH_FAIL_LANES``);
* ``BENCH_ORDERING``: ``queue`` (default) or ``key``, the listeners' ``ordering``, or
  ``concurrent``: the no-op listener registered with ``@concurrent_listener`` (the ``concurrent``
  section; noop mode only);
  ``BENCH_MAX_RECONSUME`` / ``BENCH_SUSPEND_MS`` their ``max_reconsume_times`` and suspend time,
  ``BENCH_KEY_CONCURRENCY`` their ``key_concurrency``;
* ``BENCH_ASYNC=1``: the ``sleep`` listener as ``async def`` (``async_sleeper``).

The consume batch size comes from ``MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE`` (settings).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis

from mqorder import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, concurrent_listener, orderly_listener

SUCCESS = ConsumeOrderlyStatus.SUCCESS
LAT_KEY = "bench:lat"

_r: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        # Key order runs up to 16 calls per queue at once: more than redis-py's default 100 connections.
        _r = redis.Redis.from_url(os.environ["MQORDER_REDIS_URL"], max_connections=4096)
    return _r


def noop(msgs, ctx):
    return SUCCESS


def noop_concurrently(msgs, ctx):
    return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


class LatencyRecorder:
    """The send-to-handle latencies a process's ``latency`` listener took, pushed to ``bench:lat`` by
    one thread per process every ``FLUSH_S``.

    The latency is taken when the listener is called; only its recording waits. Until 2026-11-24
    the listener pushed them itself, one RPUSH round trip per call: a quarter of a stock prefork
    child's CPU at 1,000 msg/s (cProfile), spent by the measuring apparatus on a 2-core machine
    where the latency being measured is CPU queueing. Until 2026-11-27 it flushed every 10 ms:
    100 wake-ups a second of this thread, each an ``RPUSH`` through redis-py, cost ~50-75 µs per
    message of the stock workers' CPU at 1,000 msg/s (11 % of it by per-thread CPU from ``/proc``),
    counted in the trickle's worker figure as if mqorder spent it. The drivers wait for every
    latency before they read them (``bench.latency._wait_len``, ``bench.trickle_cost``): a longer
    flush delays the end of a window by at most itself, never a value."""

    FLUSH_S = 0.1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._values: list[int] = []

    def add(self, values: list[int]) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first call in this (pool) process
                self._pid, self._values = os.getpid(), []
                threading.Thread(target=self._flush_forever, daemon=True).start()
            self._values.extend(values)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(self.FLUSH_S)
            with self._lock:
                values, self._values = self._values, []
            if values:
                _redis().rpush(LAT_KEY, *values)


LATENCIES = LatencyRecorder()


#: Bodies of warm-up messages start with this: handled like the others, their latency not recorded.
WARMUP_PREFIX = b"w"


def latency(msgs, ctx):
    now = time.time_ns()
    LATENCIES.add([now - int(m.body) for m in msgs if not m.body.startswith(WARMUP_PREFIX)])
    return SUCCESS


class OkCounter:
    """Messages a process's ``sleep`` listeners finished, added to ``bench:ok:<group>`` in Redis
    every ``FLUSH_S`` by one thread per process: the listener's own work stays the sleep alone (a
    round trip per call would be I/O the benchmark does not ask for), at 10 ms of precision."""

    FLUSH_S = 0.01

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._counts: dict[str, int] = {}

    def add(self, group: str, n: int) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first call in this (pool) process
                self._pid, self._counts = os.getpid(), {}
                threading.Thread(target=self._flush_forever, daemon=True).start()
            self._counts[group] = self._counts.get(group, 0) + n

    def _flush_forever(self) -> None:
        while True:
            time.sleep(self.FLUSH_S)
            with self._lock:
                counts, self._counts = self._counts, {}
            if counts:
                pipe = _redis().pipeline(transaction=False)
                for g, n in counts.items():
                    pipe.incrby(f"bench:ok:{g}", n)
                pipe.execute()


OK_COUNTER = OkCounter()


def sleeper(group: str, fail_hash: int | None) -> Callable[[Any, Any], ConsumeOrderlyStatus]:
    """The ``sleep`` listener of one lane: I/O-bound work, and optionally one key that always fails."""
    pause = float(os.environ.get("BENCH_SLEEP_MS", "10")) / 1000

    def listener(msgs, ctx):
        if fail_hash is not None and msgs[0].key_hash == fail_hash:
            time.sleep(pause)
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        time.sleep(pause * len(msgs))
        OK_COUNTER.add(group, len(msgs))
        return SUCCESS

    return listener


class AsyncOkCounter:
    """``OkCounter`` for the async listeners: counted on the process's event loop (its one thread at
    a time, no lock) and added to ``bench:ok:<group>`` every ``FLUSH_S`` from the loop itself, over
    one asyncio connection to the bench's local Redis that writes the ``INCRBY`` commands and reads
    their replies (``_RespCounter``). Until 2026-11-26 each flush went through ``run_in_executor``
    to ``OK_COUNTER``'s lock and flush thread, two thread wake-ups per flush in every prefork
    child: about 15 µs of the child's CPU per message at 2,000 msg/s, measured in process and
    charged to the engine by the keys section (a ``redis.asyncio`` pipeline cost as much).

    Under gevent the loop runs in a native thread where a gevent-patched socket must not be used,
    and a URL with a password or TLS is not what the raw connection speaks: there the counts still
    go to ``OK_COUNTER`` through ``run_in_executor`` (greenlets of the hub under gevent)."""

    FLUSH_S = 0.01

    def __init__(self) -> None:
        self._pid = 0
        self._counts: dict[str, int] = {}
        #: The flush task, held here: the loop keeps only a weak reference to a task, and while it
        #: waits for Redis's reply nothing else refers to it (the stream's protocol holds its
        #: reader weakly), so a garbage collection destroyed it mid-run, and with it every later
        #: count of the process (a keys run waited for 6,259 counts that never came).
        self._task: asyncio.Task[None] | None = None

    def add(self, group: str, n: int) -> None:
        if self._pid != os.getpid():
            self._pid, self._counts = os.getpid(), {}
            self._task = asyncio.get_running_loop().create_task(self._flush_forever())
        self._counts[group] = self._counts.get(group, 0) + n

    async def _flush_forever(self) -> None:
        loop = asyncio.get_running_loop()
        url = urlsplit(os.environ["MQORDER_REDIS_URL"])
        raw = None
        if not _gevent_patched() and url.scheme == "redis" and not url.password and url.path in ("", "/", "/0"):
            raw = _RespCounter(*await asyncio.open_connection(url.hostname or "127.0.0.1", url.port or 6379))
        while True:
            await asyncio.sleep(self.FLUSH_S)
            if not self._counts:
                continue
            counts, self._counts = self._counts, {}
            if raw is not None:
                await raw.incrby(counts)
                continue
            for g, n in counts.items():
                await loop.run_in_executor(None, OK_COUNTER.add, g, n)


class _RespCounter:
    """``INCRBY bench:ok:<group> n`` for each group, written in one go; each reply (``:<n>``) read."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def incrby(self, counts: dict[str, int]) -> None:
        out = []
        for g, n in counts.items():
            key, num = f"bench:ok:{g}".encode(), str(n).encode()
            out.append(b"*3\r\n$6\r\nINCRBY\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, len(num), num))
        self.writer.write(b"".join(out))
        for _ in counts:
            line = await self.reader.readline()
            if not line.startswith(b":"):
                raise RuntimeError(f"INCRBY failed: {line!r}")


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


ASYNC_OK_COUNTER = AsyncOkCounter()


def async_sleeper(group: str, fail_hash: int | None) -> Callable[[Any, Any], Any]:
    """``sleeper`` as ``async def`` (``BENCH_ASYNC=1``, the keys section's async rows): the same
    I/O-bound work awaited on the worker process's event loop (issue 31)."""
    pause = float(os.environ.get("BENCH_SLEEP_MS", "10")) / 1000

    async def listener(msgs, ctx):
        if fail_hash is not None and msgs[0].key_hash == fail_hash:
            await asyncio.sleep(pause)
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        await asyncio.sleep(pause * len(msgs))
        ASYNC_OK_COUNTER.add(group, len(msgs))
        return SUCCESS

    return listener


def lane_names(topic: str, group: str, lanes: int) -> list[tuple[str, str]]:
    if lanes <= 1:
        return [(topic, group)]
    return [(f"{topic}-{i}", f"{group}-{i}") for i in range(lanes)]


def _register() -> None:
    topic = os.environ.get("BENCH_TOPIC")
    group = os.environ.get("BENCH_GROUP")
    if not topic or not group:
        return
    mode = os.environ.get("BENCH_MODE", "noop")
    func = latency if mode == "latency" else noop
    opts: dict[str, Any] = {}
    if os.environ.get("BENCH_ORDERING"):
        opts["ordering"] = os.environ["BENCH_ORDERING"]
    if os.environ.get("BENCH_MAX_RECONSUME"):
        opts["max_reconsume_times"] = int(os.environ["BENCH_MAX_RECONSUME"])
    if os.environ.get("BENCH_SUSPEND_MS"):
        opts["suspend_current_queue_time_millis"] = int(os.environ["BENCH_SUSPEND_MS"])
    if os.environ.get("BENCH_KEY_CONCURRENCY"):
        opts["key_concurrency"] = int(os.environ["BENCH_KEY_CONCURRENCY"])
    fail_key = os.environ.get("BENCH_FAIL_KEY")
    fail_lanes = {int(x) for x in os.environ.get("BENCH_FAIL_LANES", "").split(",") if x}
    lanes = lane_names(topic, group, int(os.environ.get("BENCH_LANES", "1")))
    if opts.get("ordering") == "concurrent":
        for t, g in lanes:
            concurrent_listener(topic=t, group=g)(noop_concurrently)
        return
    for i, (t, g) in enumerate(lanes):
        if mode == "sleep":
            fail = zlib.crc32(fail_key.encode()) if fail_key and i in fail_lanes else None
            func = (async_sleeper if os.environ.get("BENCH_ASYNC") == "1" else sleeper)(g, fail)
        orderly_listener(topic=t, group=g, **opts)(func)


_register()

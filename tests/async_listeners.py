"""``async def`` listeners loaded by the async end-to-end tests
(``MQORDER_LISTENERS=tests.listeners,tests.async_listeners``: beside the plain ones).

They write the same ledger lines as ``tests.listeners`` (``key|seq|queue|offset|epoch|client|pid|
start_us|end_us|reconsume|verdict``) with ``redis.asyncio``, so nothing here blocks the loop, and
take the same ``ctl:<group>`` knobs (``rand_sleep_ms``, ``fail:<key>``), awaited. Each call asks
``await ctx.still_owner_async()`` and suspends if the answer is no (on every pool).

* ``g-akeys`` on ``t-akeys``: key mode, ``key_concurrency=64``;
* ``g-aqueue`` on ``t-aqueue``: queue mode.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import redis.asyncio as aioredis

from mqorder import ConsumeOrderlyStatus, orderly_listener

_clients: dict[int, aioredis.Redis] = {}


def _r() -> aioredis.Redis:
    """One client per process (the listeners of a process all run on its one loop)."""
    c = _clients.get(os.getpid())
    if c is None:
        url = os.environ.get("MQORDER_TEST_LEDGER_URL") or os.environ["MQORDER_REDIS_URL"]
        # Blocking pool: thousands of calls in flight share a few connections (redis-py's plain
        # pool raises "Too many connections" past its cap instead of waiting).
        c = _clients[os.getpid()] = aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=32))
    return c


async def _record(group: str, msgs, ctx) -> ConsumeOrderlyStatus:
    c = _r()
    ctl = {k.decode(): v.decode() for k, v in (await c.hgetall(f"ctl:{group}")).items()}
    start = time.time_ns() // 1000
    rand_ms = float(ctl.get("rand_sleep_ms", 0))
    if rand_ms:
        await asyncio.sleep(random.random() * rand_ms / 1000)
    status = ConsumeOrderlyStatus.SUCCESS
    lines = []
    for m in msgs:
        body = json.loads(m.body)
        key, seq = str(body["k"]), int(body["s"])
        if ctl.get(f"fail:{key}"):
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        lines.append((key, seq, m))
    if not await ctx.still_owner_async():  # off the loop: a thread, or a hub greenlet under gevent
        status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
    end = time.time_ns() // 1000
    verdict = "S" if status is ConsumeOrderlyStatus.SUCCESS else "X"
    await c.rpush(f"ledger:{group}", *[
        f"{key}|{seq}|{m.queue_id}|{m.queue_offset}|{ctx.epoch}|{ctx.client_id}|{os.getpid()}|{start}|{end}|"
        f"{m.reconsume_times}|{verdict}"
        for key, seq, m in lines
    ])
    return status


@orderly_listener(topic="t-akeys", group="g-akeys", ordering="key", key_concurrency=64, max_reconsume_times=2,
                  suspend_current_queue_time_millis=50)
async def async_keyed(msgs, ctx):
    return await _record("g-akeys", msgs, ctx)


@orderly_listener(topic="t-aqueue", group="g-aqueue")
async def async_queued(msgs, ctx):
    return await _record("g-aqueue", msgs, ctx)

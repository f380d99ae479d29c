"""The chaos suite's orderly listener (``MQORDER_LISTENERS=chaos.listeners``).

Every listener call appends one ledger line per message to the list ``ledger`` of the *ledger*
Redis (``CHAOS_LEDGER_URL``): a separate ``redis-server`` that no scenario kills, so the ledger
keeps every call, including calls whose commit the Redis under test lost in a crash. Fields::

    key|seq|queue|offset|epoch|client|pid|start_us|end_us|reconsume|verdict|owner|run

* ``verdict``: ``S`` (returned SUCCESS) or ``X`` (returned SUSPEND: a poison message);
* ``owner``: ``ctx.still_owner()`` asked at the end of the call (``1``/``0``, ``?`` if the Redis
  under test did not answer): a holder paused past its lease must see ``0`` here;
* ``run``: an id of the ConsumeRequest object that made the call (found on the call stack; only
  read, never changed), so the checker can tell one run from the next.

Bodies are JSON ``{"k": key, "s": seq}``; ``{"poison": true, "id": n}`` always returns SUSPEND.
This group uses ``max_reconsume_times=3`` (instead of the default 16) so a poison message reaches
the DLQ after 3 suspends of 1 s; regular messages never suspend, so nothing else depends on it.
``CHAOS_WORK_MS`` (default 1) is the simulated work per call; ``slow:<client>`` in the ``ctl``
hash of the ledger Redis raises it for one client (used to land a SIGSTOP inside listener calls).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
import weakref

import redis

from mqorder import ConsumeOrderlyStatus, orderly_listener
from mqorder.consumer.consume_request import ConsumeRequest

TOPIC = "chaos"
GROUP = "chaos"
LEDGER = "ledger"
#: Control hash in the ledger Redis: ``slow:<client>`` = work per call in ms for that client (the
#: runner sets it for a moment before a SIGSTOP so the pause lands inside listener calls).
CTL = "ctl"
MAX_RECONSUME = 3
SUSPEND_MS = 1000

_r: redis.Redis | None = None
_runs: weakref.WeakKeyDictionary[ConsumeRequest, str] = weakref.WeakKeyDictionary()


def _ledger() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["CHAOS_LEDGER_URL"], socket_timeout=5)
    return _r


def _run_id() -> str:
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, ConsumeRequest):
            rid = _runs.get(obj)
            if rid is None:
                rid = _runs[obj] = uuid.uuid4().hex[:12]
            return rid
        f = f.f_back
    return "-"


@orderly_listener(topic=TOPIC, group=GROUP, max_reconsume_times=MAX_RECONSUME,
                  suspend_current_queue_time_millis=SUSPEND_MS)
def handle(msgs, ctx):  # noqa: ANN001, ANN201
    start = time.time_ns() // 1000
    run = _run_id()
    status = ConsumeOrderlyStatus.SUCCESS
    parsed = []
    for m in msgs:
        body = json.loads(m.body)
        if body.get("poison"):
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
            parsed.append((f"poison-{body['id']}", 0, m))
        else:
            parsed.append((str(body["k"]), int(body["s"]), m))
    work_ms = float(os.environ.get("CHAOS_WORK_MS", "1"))
    slow = _ledger().hget(CTL, f"slow:{ctx.client_id}")
    if slow:
        work_ms = max(work_ms, float(slow))
    if work_ms > 0:
        time.sleep(work_ms / 1000)
    try:
        owner = "1" if ctx.still_owner() else "0"
    except redis.RedisError:
        owner = "?"
    end = time.time_ns() // 1000
    verdict = "S" if status is ConsumeOrderlyStatus.SUCCESS else "X"
    pid = os.getpid()
    lines = [
        f"{k}|{s}|{m.queue_id}|{m.queue_offset}|{ctx.epoch}|{ctx.client_id}|{pid}|{start}|{end}|"
        f"{m.reconsume_times}|{verdict}|{owner}|{run}"
        for k, s, m in parsed
    ]
    _ledger().rpush(LEDGER, *lines)
    return status

"""The chaos suite's orderly listener (``MQORDER_LISTENERS=chaos.listeners``) and its recorders.

Everything here writes JSON records (``chaos.records``) to lists of the *ledger* Redis
(``CHAOS_LEDGER_URL``): a separate ``redis-server`` that no scenario kills, so the ledger keeps
every call, including calls whose commit the Redis under test lost in a crash.

* the listener appends one :class:`~chaos.records.Entry` per message it is handed, with the call's
  epoch, run id (``ctx.run_id``), pid, wall-clock bounds, status and ``ctx.still_owner()`` asked at
  the end of the call (a holder paused past its lease must see False there);
* :class:`RefusalRecorder`, the listener's ``ConsumeMessageHook``, appends one
  :class:`~chaos.records.Refusal` for each fenced commit or touch the engine refused: the checker
  proves fencing from these, not from the wording of a worker's log line;
* in a beat started by the runner (``CHAOS_ROLE=beat<n>``), Celery's ``before_task_publish``
  appends one :class:`~chaos.records.Published` per task the beat sends (the beat checks count
  the rebalances each beat process sent).

Bodies are JSON ``{"k": key, "s": seq}``; ``{"poison": true, "id": n}`` always returns SUSPEND.
This group uses ``max_reconsume_times=3`` (instead of the default 16) so a poison message reaches
the DLQ after 3 suspends of 1 s; regular messages never suspend, so nothing else depends on it.
``CHAOS_WORK_MS`` (default 1) is the simulated work per call; ``slow:<client>`` in the ``ctl``
hash of the ledger Redis raises it for one client (used to land a SIGSTOP inside listener calls).

``CHAOS_GROUPS=1`` (the ``groups-kill`` scenario) registers two more groups in the same workers
(``EXTRA_GROUPS``): ``chaos-b`` on the chaos topic too (two groups sharing each queue's log
stream) and ``chaos-c`` on a topic of its own. Their listeners are ``handle``'s, each recording
into its group's own list (``records.group_ledger``), so the checker judges every group alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis
from celery.signals import before_task_publish

from chaos import records
from chaos import txn as _txn  # noqa: F401 - registers the transactions scenario's checker
from mqorder import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, concurrent_listener, orderly_listener
from mqorder.consumer.context import ConsumeConcurrentlyContext, ConsumeOrderlyContext
from mqorder.consumer.hooks import ConsumeMessageHook, RefusedContext
from mqorder.model import MessageExt

TOPIC = "chaos"
GROUP = "chaos"
#: Control hash in the ledger Redis: ``slow:<client>`` = work per call in ms for that client (the
#: runner sets it for a moment before a SIGSTOP so the pause lands inside listener calls).
CTL = "ctl"
MAX_RECONSUME = 3
SUSPEND_MS = 1000
#: Set by the runner in the environment of each beat it starts (``beat0``, ``beat1``...).
ROLE_ENV = "CHAOS_ROLE"

_r: redis.Redis | None = None


def _ledger() -> redis.Redis:
    """One client per process (prefork children get their own after the fork)."""
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["CHAOS_LEDGER_URL"], socket_timeout=5)
    return _r


class RefusalRecorder(ConsumeMessageHook):
    """Writes every refused commit or touch as a :class:`~chaos.records.Refusal`.

    The hook is called in the consuming process at the moment the engine sees the refusal, so the
    record carries the run, the stale epoch and the epoch/owner that replaced it.
    """

    def consume_refused(self, context: RefusedContext) -> None:
        rec = records.Refusal(
            group=context.consumer_group, topic=context.message_queue.topic,
            queue=context.message_queue.queue_id, client=context.client_id, pid=os.getpid(),
            run=context.run_id, epoch=context.epoch, reason=context.reason,
            current_epoch=context.current_epoch, current_owner=context.current_owner,
            offset=context.offset, at=context.at,
        )
        _ledger().rpush(records.REFUSALS, rec.to_json())


def _parse(m: MessageExt) -> tuple[str, int, bool]:
    """(key, seq, poison) of a chaos message body."""
    body = json.loads(m.body)
    if body.get("poison"):
        return f"poison-{body['id']}", 0, True
    return str(body["k"]), int(body["s"]), False


def _work(ctx: ConsumeOrderlyContext | ConsumeConcurrentlyContext) -> None:
    work_ms = float(os.environ.get("CHAOS_WORK_MS", "1"))
    slow = _ledger().hget(CTL, f"slow:{ctx.client_id}")
    if slow:
        work_ms = max(work_ms, float(slow))
    if work_ms > 0:
        time.sleep(work_ms / 1000)


#: ``CHAOS_ORDERING=key`` (the key-order scenarios) registers the listener with ``ordering="key"``;
#: ``CHAOS_ORDERING=concurrent`` (the ``concurrent`` scenario) registers ``handle_concurrently`` as a
#: concurrent listener instead (no order; failures go through ``%RETRY%chaos``).
ORDERING_ENV = "CHAOS_ORDERING"


def handle(msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> ConsumeOrderlyStatus:
    return _handle(msgs, ctx, records.LEDGER)


def _handle(msgs: list[MessageExt], ctx: ConsumeOrderlyContext, ledger: str) -> ConsumeOrderlyStatus:
    """``handle``'s call, recorded into the list ``ledger`` (one per group)."""
    parsed = [(*_parse(m), m) for m in msgs]
    status = (ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT if any(p for _, _, p, _ in parsed)
              else ConsumeOrderlyStatus.SUCCESS)
    _record(parsed, ctx, status.name, ledger)
    return status


def group_listener(group: str) -> Callable[[list[MessageExt], ConsumeOrderlyContext], ConsumeOrderlyStatus]:
    """``handle`` for another group (``EXTRA_GROUPS``): its calls go to the group's own list, so a
    message of one group run by another group's listener shows as a loss in the first and a
    stranger (or a duplicate) in the second, never as one group's records hiding the other's."""
    ledger = records.group_ledger(group)

    def handle_group(msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> ConsumeOrderlyStatus:
        return _handle(msgs, ctx, ledger)

    # One name per group: the registry tells two listeners of one factory apart by their names.
    handle_group.__qualname__ = handle_group.__name__ = f"handle_{group.replace('-', '_')}"
    return handle_group


def handle_concurrently(msgs: list[MessageExt], ctx: ConsumeConcurrentlyContext) -> ConsumeConcurrentlyStatus:
    """The ``concurrent`` scenario's listener: a poison message is never acknowledged (it goes
    back through ``%RETRY%chaos`` until the DLQ); its entry is recorded as a SUSPEND."""
    parsed = [(*_parse(m), m) for m in msgs]
    failed = any(p for _, _, p, _ in parsed)
    _record(parsed, ctx, "SUSPEND_CURRENT_QUEUE_A_MOMENT" if failed else records.SUCCESS)
    return ConsumeConcurrentlyStatus.RECONSUME_LATER if failed else ConsumeConcurrentlyStatus.CONSUME_SUCCESS


def _record(parsed: list[tuple[str, int, bool, MessageExt]], ctx: ConsumeOrderlyContext | ConsumeConcurrentlyContext,
            status: str, ledger: str = records.LEDGER) -> None:
    start = time.time()
    _work(ctx)
    asked = time.time()
    try:
        still_owner: bool | None = ctx.still_owner()
    except redis.RedisError:
        still_owner = None
    end = time.time()
    pid = os.getpid()
    entries = [
        records.Entry(
            key=k, seq=s, queue=m.queue_id, offset=m.queue_offset, epoch=ctx.epoch, client=ctx.client_id,
            pid=pid, start=start, end=end, reconsume=m.reconsume_times, status=status,
            still_owner=still_owner, run=ctx.run_id, asked=asked,
        ).to_json()
        for k, s, _, m in parsed
    ]
    _ledger().rpush(ledger, *entries)


#: ``CHAOS_ASYNC=1`` (the ``async-keys-kill`` scenario) registers ``handle_async``, the same
#: listener as ``async def`` (issue 31): its calls run on each worker process's event loop.
ASYNC_ENV = "CHAOS_ASYNC"


_ar: dict[int, aioredis.Redis] = {}


def _async_ledger() -> aioredis.Redis:
    """The ledger Redis for ``handle_async``, one asyncio client per process (its loop's)."""
    c = _ar.get(os.getpid())
    if c is None:
        c = _ar[os.getpid()] = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            os.environ["CHAOS_LEDGER_URL"], max_connections=16, socket_timeout=5))
    return c


async def handle_async(msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> ConsumeOrderlyStatus:
    """``handle`` as ``async def``: the simulated work is awaited, ``ctx.still_owner_async()``
    asked, and the ledger Redis is written with ``redis.asyncio``, so nothing blocks the loop."""
    parsed = [(*_parse(m), m) for m in msgs]
    status = (ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT if any(p for _, _, p, _ in parsed)
              else ConsumeOrderlyStatus.SUCCESS)
    ledger = _async_ledger()
    start = time.time()
    work_ms = float(os.environ.get("CHAOS_WORK_MS", "1"))
    slow = await ledger.hget(CTL, f"slow:{ctx.client_id}")
    if slow:
        work_ms = max(work_ms, float(slow))
    if work_ms > 0:
        await asyncio.sleep(work_ms / 1000)
    asked = time.time()
    try:
        still_owner: bool | None = await ctx.still_owner_async()
    except redis.RedisError:
        still_owner = None
    end = time.time()
    pid = os.getpid()
    entries = [
        records.Entry(
            key=k, seq=s, queue=m.queue_id, offset=m.queue_offset, epoch=ctx.epoch, client=ctx.client_id,
            pid=pid, start=start, end=end, reconsume=m.reconsume_times, status=status.name,
            still_owner=still_owner, run=ctx.run_id, asked=asked,
        ).to_json()
        for k, s, _, m in parsed
    ]
    await ledger.rpush(records.LEDGER, *entries)
    return status


#: ``CHAOS_GROUPS=1`` (the ``groups-kill`` scenario) registers the ``EXTRA_GROUPS`` too.
GROUPS_ENV = "CHAOS_GROUPS"
#: The groups ``CHAOS_GROUPS=1`` adds, with the topic each consumes: ``chaos-b`` shares the chaos
#: topic (and so each queue's log stream) with the chaos group, ``chaos-c`` has a topic of its own.
EXTRA_GROUPS = {"chaos-b": TOPIC, "chaos-c": "chaos-c"}


def _register_groups(ordering: str) -> None:
    """The ``EXTRA_GROUPS``' orderly listeners, with the chaos group's settings and refusal hook
    (the hook's records name their group: the checker tells the groups apart by it)."""
    if ordering == "concurrent":
        raise ValueError(f"{GROUPS_ENV}=1 adds orderly groups; {ORDERING_ENV}=concurrent is not supported with it")
    for group, topic in EXTRA_GROUPS.items():
        orderly_listener(topic=topic, group=group, max_reconsume_times=MAX_RECONSUME,
                         suspend_current_queue_time_millis=SUSPEND_MS, hooks=[RefusalRecorder()],
                         ordering=ordering)(group_listener(group))


_ORDERING = os.environ.get(ORDERING_ENV, "queue")
if _ORDERING == "concurrent":
    concurrent_listener(topic=TOPIC, group=GROUP, max_reconsume_times=MAX_RECONSUME,
                        hooks=[RefusalRecorder()])(handle_concurrently)
else:
    orderly_listener(topic=TOPIC, group=GROUP, max_reconsume_times=MAX_RECONSUME,
                     suspend_current_queue_time_millis=SUSPEND_MS, hooks=[RefusalRecorder()],
                     ordering=_ORDERING)(handle_async if os.environ.get(ASYNC_ENV) == "1" else handle)
if os.environ.get(GROUPS_ENV) == "1":
    _register_groups(_ORDERING)


def _record_publish(sender: str | None = None, **_: Any) -> None:
    rec = records.Published(role=os.environ[ROLE_ENV], task=str(sender), pid=os.getpid(), at=time.time())
    _ledger().rpush(records.PUBLISHED, rec.to_json())


if os.environ.get(ROLE_ENV, "").startswith("beat"):
    # Only in a beat: workers publish a ConsumeRequest task per run and need no receiver.
    before_task_publish.connect(_record_publish, weak=False)

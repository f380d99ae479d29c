"""Listeners loaded by the test workers (``MQORDER_LISTENERS=tests.listeners``).

Every call appends one ledger line per message to ``ledger:<group>`` in Redis:
``key|seq|queue_id|offset|epoch|client|pid|start_us|end_us|reconsume`` — the raw material every
end-to-end assertion (order, loss, duplicates, overlap) is computed from. Behaviour is steered
per group through the Redis hash ``ctl:<group>`` so a test changes it without restarting workers:

* ``sleep_ms``: sleep inside every call (to widen overlap windows);
* ``suspend:<key>:<seq>``: how many more times to return SUSPEND for that message;
* ``rand_sleep_ms``: sleep a random time up to this inside every call (key mode's tests);
* ``fail:<key>``: always return SUSPEND for that key's messages (RECONSUME_LATER for the
  concurrent listener ``g-conc``);
* ``flaky:<key>:<seq>``: how many more times the concurrent listener returns RECONSUME_LATER for
  that message (its retries come back through ``%RETRY%g-conc``).

The concurrent listener's ledger lines carry the topic the listener saw as an 11th field.
"""

from __future__ import annotations

import json
import os
import random
import time

import redis

from mqorder import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, MessageModel, concurrent_listener, orderly_listener

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        # On a Redis Cluster store the ledger lives in a plain Redis of the test's own.
        _r = redis.Redis.from_url(os.environ.get("MQORDER_TEST_LEDGER_URL") or os.environ["MQORDER_REDIS_URL"])
    return _r


def _controls(c: redis.Redis, group: str) -> dict[str, str]:
    """The test's knobs for ``group`` (``ctl:<group>``), read afresh on every call."""
    return {k.decode(): v.decode() for k, v in c.hgetall(f"ctl:{group}").items()}


def _sleep_as_told(ctl: dict[str, str]) -> None:
    """Sleep ``sleep_ms`` and then a random time up to ``rand_sleep_ms``, where set."""
    sleep_ms = float(ctl.get("sleep_ms", 0))
    if sleep_ms:
        time.sleep(sleep_ms / 1000)
    rand_ms = float(ctl.get("rand_sleep_ms", 0))
    if rand_ms:
        time.sleep(random.random() * rand_ms / 1000)


def _record(group: str, msgs, ctx, status: ConsumeOrderlyStatus) -> ConsumeOrderlyStatus:
    c = r()
    ctl = _controls(c, group)
    start = time.time_ns() // 1000
    _sleep_as_told(ctl)
    lines = []
    for m in msgs:
        body = json.loads(m.body)
        key, seq = str(body["k"]), int(body["s"])
        sk = f"suspend:{key}:{seq}"
        if int(ctl.get(sk, 0)) > 0:
            c.hincrby(f"ctl:{group}", sk, -1)
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        if ctl.get(f"fail:{key}"):
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        lines.append((key, seq, m))
    end = time.time_ns() // 1000
    pipe = c.pipeline(transaction=False)
    for key, seq, m in lines:
        verdict = "S" if status is ConsumeOrderlyStatus.SUCCESS else "X"
        pipe.rpush(
            f"ledger:{group}",
            f"{key}|{seq}|{m.queue_id}|{m.queue_offset}|{ctx.epoch}|{ctx.client_id}|{os.getpid()}|{start}|{end}|{m.reconsume_times}|{verdict}",
        )
    pipe.execute()
    return status


@orderly_listener(topic="t-order", group="g-order")
def ordered(msgs, ctx):
    return _record("g-order", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-excl", group="g-excl", consume_message_batch_max_size=2)
def exclusive(msgs, ctx):
    return _record("g-excl", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-suspend", group="g-suspend", max_reconsume_times=2,
                  suspend_current_queue_time_millis=300)
def suspending(msgs, ctx):
    return _record("g-suspend", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-bcast", group="g-bcast", message_model=MessageModel.BROADCASTING)
def broadcast(msgs, ctx):
    return _record("g-bcast", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-late", group="g-late")
def late(msgs, ctx):
    """Its topic is created only after the workers started (instant pick-up of a new topic)."""
    return _record("g-late", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-from-end", group="g-from-end", consume_from_where="CONSUME_FROM_LAST_OFFSET")
def from_end(msgs, ctx):
    """A new group that starts at the end of its topic (RocketMQ's CONSUME_FROM_LAST_OFFSET)."""
    return _record("g-from-end", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@orderly_listener(topic="t-keys", group="g-keys", ordering="key", key_concurrency=16, max_reconsume_times=2,
                  suspend_current_queue_time_millis=50)
def keyed(msgs, ctx):
    """Key-ordered (issue 14): keys of one queue in parallel, one call at a time per key."""
    return _record("g-keys", msgs, ctx, ConsumeOrderlyStatus.SUCCESS)


@concurrent_listener(topic="t-conc", group="g-conc", consume_message_batch_max_size=2, consume_concurrency=16,
                     max_reconsume_times=3)
def concurrent(msgs, ctx):
    """Concurrent (issue 15): no order; what it does not acknowledge comes back via %RETRY%g-conc.
    A batch of two where only the first fails acknowledges the second (``ack_index``)."""
    c = r()
    ctl = _controls(c, "g-conc")
    start = time.time_ns() // 1000
    _sleep_as_told(ctl)
    ok = []
    for m in msgs:
        body = json.loads(m.body)
        key, seq = str(body["k"]), int(body["s"])
        fk = f"flaky:{key}:{seq}"
        failed = bool(ctl.get(f"fail:{key}")) or (int(ctl.get(fk, 0)) > 0 and c.hincrby("ctl:g-conc", fk, -1) >= 0)
        ok.append(not failed)
    ack = -1
    while ack + 1 < len(ok) and ok[ack + 1]:
        ack += 1
    end = time.time_ns() // 1000
    pipe = c.pipeline(transaction=False)
    for i, m in enumerate(msgs):
        body = json.loads(m.body)
        verdict = "S" if i <= ack else "X"
        pipe.rpush(
            "ledger:g-conc",
            f"{body['k']}|{body['s']}|{m.queue_id}|{m.queue_offset}|{ctx.epoch}|{ctx.client_id}|{os.getpid()}|{start}|{end}|{m.reconsume_times}|{verdict}|{m.topic}",
        )
    pipe.execute()
    if ack < 0:
        return ConsumeConcurrentlyStatus.RECONSUME_LATER
    ctx.ack_index = ack
    return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

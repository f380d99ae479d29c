"""``async def`` listeners end to end on the stock workers (``workers.app``): real ``celery worker``
subprocesses, the async listeners of ``tests.async_listeners`` beside the plain ones of
``tests.listeners`` in the same workers, every assertion computed from the ledger they write.

* prefork (the stock pool): per-key order with thousands of calls in flight, a plain key-mode
  listener running beside, and a ``kill -9`` of one worker mid-flight: the survivor redelivers
  only what the dead one had not committed as finished;
* gevent, threads and solo pools: key mode with a key that always fails (its messages reach the DLQ
  while the other keys finish) and queue mode (one call per queue at a time), on one worker.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import redis

from mqorder import Producer, keys
from mqorder.consumer.key_request import uncommitted_bound
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog
from tests.support import Cluster, body, check_order, ledger, wait_for

pytestmark = pytest.mark.e2e

LISTENERS = "tests.listeners,tests.async_listeners"


def _handled(r: redis.Redis, group: str, n: int) -> bool:
    return len({(e["key"], e["seq"]) for e in ledger(r, group) if e["ok"]}) >= n


def _overlaps_of_one_key(entries: list[dict]) -> list[str]:
    calls: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in entries:
        calls[e["key"]].append((e["start"], e["end"]))
    bad = []
    for key, cs in calls.items():
        ordered = sorted(set(cs))
        for (_, e1), (s2, _) in zip(ordered, ordered[1:], strict=False):
            if s2 < e1:
                bad.append(f"key {key}: a call started at {s2} before the previous one ended at {e1}")
    return bad


def _max_parallel_per_queue(entries: list[dict]) -> int:
    best = 0
    by_q: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in {(e["queue"], e["start"], e["end"], e["offset"]): e for e in entries}.values():
        by_q[e["queue"]] += [(e["start"], 1), (e["end"], -1)]
    for events in by_q.values():
        n = 0
        for _, d in sorted(events):
            n += d
            best = max(best, n)
    return best


def test_prefork_async_keys_beside_plain_ones_survive_a_kill_9_mid_flight(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-akeys", queues=4)
    p.create_topic("t-keys", queues=4)
    r.hset("ctl:g-akeys", "rand_sleep_ms", 20)
    r.hset("ctl:g-keys", "rand_sleep_ms", 4)
    w1 = cluster.start_worker("w1", pool="prefork", concurrency=2, MQORDER_LISTENERS=LISTENERS)
    w2 = cluster.start_worker("w2", pool="prefork", concurrency=2, MQORDER_LISTENERS=LISTENERS)
    akeys = [f"acct-{i}" for i in range(400)]
    for seq in range(1, 7):
        p.send_orderly_batch("t-akeys", [(k, body(k, seq)) for k in akeys])
    pkeys = [f"plain-{i}" for i in range(40)]
    for seq in range(1, 6):
        p.send_orderly_batch("t-keys", [(k, body(k, seq)) for k in pkeys])
    # Killed mid-flight once it consumes: a sixth handled, some by w1 (on a loaded machine w2 could
    # handle a sixth from its own queues before w1's children had started).
    wait_for(lambda: _handled(r, "g-akeys", 400) and any(e["client"] == w1.hostname for e in ledger(r, "g-akeys")),
             timeout=60, what="a sixth handled, some by w1", interval=0.05)
    w1.kill()  # kill -9, mid-flight
    killed_us = time.time_ns() // 1000
    wait_for(lambda: _handled(r, "g-akeys", 2400), timeout=90, what="all 2400 async handled after the kill")
    wait_for(lambda: _handled(r, "g-keys", 200), timeout=60, what="the 200 plain ones handled")
    entries = ledger(r, "g-akeys")
    violations, handled, dups = check_order(entries)
    assert violations == [] and handled == 2400
    assert _overlaps_of_one_key([e for e in entries if e["client"] != w1.hostname]) == []
    assert _max_parallel_per_queue(entries) > 16  # many keys of one queue in flight on one loop
    assert dups <= 4 * uncommitted_bound(32, 64)  # only what was not committed as finished
    w1_queues = {e["queue"] for e in entries if e["client"] == w1.hostname}
    taken_over = {e["queue"] for e in entries if e["client"] == w2.hostname and e["start"] > killed_us}
    assert w1_queues & taken_over
    plain = ledger(r, "g-keys")
    assert check_order(plain)[0] == [] and check_order(plain)[1] == 200
    log = MessageLog(p.brokers)
    wait_for(lambda: sum(log.lag("g-akeys", mq) for mq in p.describe_topic("t-akeys").message_queues) == 0,
             timeout=30, what="every async queue committed to its end")
    p.close()


POOLS = [("gevent", 16), ("threads", 4), ("solo", 1)]


@pytest.mark.parametrize(("pool", "concurrency"), POOLS, ids=[p for p, _ in POOLS])
def test_async_key_and_queue_modes_on_one_worker_of_each_pool(
    cluster: Cluster, r: redis.Redis, pool: str, concurrency: int
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-akeys", queues=2)
    p.create_topic("t-aqueue", queues=2)
    r.hset("ctl:g-akeys", mapping={"rand_sleep_ms": 5, "fail:bad": 1})
    r.hset("ctl:g-aqueue", "rand_sleep_ms", 2)
    cluster.start_worker("w1", pool=pool, concurrency=concurrency, MQORDER_LISTENERS=LISTENERS)
    ks = ["bad", *(f"ok-{i}" for i in range(100))]
    for seq in range(1, 4):
        p.send_orderly_batch("t-akeys", [(k, body(k, seq)) for k in ks])
    qs = [f"q-{i}" for i in range(10)]
    for seq in range(1, 6):
        p.send_orderly_batch("t-aqueue", [(k, body(k, seq)) for k in qs])
    wait_for(lambda: _handled(r, "g-akeys", 300), timeout=60, what="the good keys' 300 messages")
    wait_for(lambda: _handled(r, "g-aqueue", 50), timeout=60, what="the 50 queue-mode messages")
    log = MessageLog(p.brokers)
    dlq = MessageQueue(keys.dlq_topic("g-akeys"), "broker-a", 0)
    wait_for(lambda: len(log.read(dlq, 0, 10)) == 3, timeout=60, what="bad's 3 messages in the DLQ")
    entries = ledger(r, "g-akeys")
    assert check_order(entries)[0] == []
    bad = [(e["seq"], e["reconsume"]) for e in entries if e["key"] == "bad"]
    assert bad == [(s, n) for s in (1, 2, 3) for n in (0, 1, 2)]
    assert max(e["end"] for e in entries if e["key"] != "bad") < max(e["end"] for e in entries if e["key"] == "bad")
    assert _max_parallel_per_queue(entries) > 1
    queued = ledger(r, "g-aqueue")
    assert check_order(queued)[0] == [] and check_order(queued)[1] == 50
    assert _max_parallel_per_queue(queued) == 1  # queue mode: one call per queue at a time
    p.close()

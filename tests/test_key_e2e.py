"""Key-ordered listeners (``ordering="key"``) end to end: real ``celery worker`` subprocesses on
the prefork, threads and gevent pools, a listener that sleeps a random time, and every assertion
computed from the ledger the listener writes (``tests/listeners.py``, group ``g-keys``)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import redis

from mqorder import Producer, keys
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog
from tests.support import Cluster, body, check_order, ledger, wait_for

pytestmark = pytest.mark.e2e

GROUP = "g-keys"


def _handled(r: redis.Redis, n: int) -> bool:
    return len({(e["key"], e["seq"]) for e in ledger(r, GROUP) if e["ok"]}) >= n


def _overlaps_of_one_key(entries: list[dict]) -> list[str]:
    """Calls of one key that overlapped in time (on any worker, process or thread)."""
    calls: dict[str, set[tuple[int, int, str]]] = defaultdict(set)
    for e in entries:
        calls[e["key"]].add((e["start"], e["end"], f"{e['client']}/{e['pid']}"))
    bad = []
    for key, cs in calls.items():
        ordered = sorted(cs)
        for (_, e1, w1), (s2, _, w2) in zip(ordered, ordered[1:], strict=False):
            if s2 < e1:
                bad.append(f"key {key}: call by {w2} started at {s2} before the call by {w1} ended at {e1}")
    return bad


def _max_parallel_in_a_queue(entries: list[dict]) -> int:
    """The most calls of one queue running at one moment (1 means queue order, not key order)."""
    best = 0
    by_q: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in entries:
        by_q[e["queue"]].append((e["start"], 1))
        by_q[e["queue"]].append((e["end"], -1))
    for events in by_q.values():
        n = 0
        for _, d in sorted(events, key=lambda x: (x[0], x[1])):
            n += d
            best = max(best, n)
    return best


POOLS = [("prefork", 2), ("threads", 8), ("gevent", 64)]


@pytest.mark.parametrize(("pool", "concurrency"), POOLS, ids=[p for p, _ in POOLS])
def test_keys_in_order_never_two_calls_of_one_key_on_each_pool(
    cluster: Cluster, r: redis.Redis, pool: str, concurrency: int
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-keys", queues=4)
    r.hset(f"ctl:{GROUP}", "rand_sleep_ms", 8)
    cluster.start_worker("w1", pool=pool, concurrency=concurrency)
    cluster.start_worker("w2", pool=pool, concurrency=concurrency)
    keys_ = [f"acct-{i}" for i in range(200)]
    for seq in range(1, 6):  # step 1 of every key, then step 2...: keys interleave in each queue
        p.send_orderly_batch("t-keys", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: _handled(r, 1000), timeout=120, what="1000 messages handled")
    entries = ledger(r, GROUP)
    violations, handled, _ = check_order(entries)
    assert violations == []
    assert handled == 1000
    assert _overlaps_of_one_key(entries) == []
    assert _max_parallel_in_a_queue(entries) > 1  # keys of one queue really ran side by side
    log = MessageLog(p.brokers)
    wait_for(lambda: sum(log.lag(GROUP, mq) for mq in p.describe_topic("t-keys").message_queues) == 0,
             timeout=30, what="every queue committed to its end")


def test_a_key_that_always_fails_reaches_the_dlq_while_the_other_keys_of_its_queue_finish(
    cluster: Cluster, r: redis.Redis
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-keys", queues=1)
    r.hset(f"ctl:{GROUP}", mapping={"rand_sleep_ms": 2, "fail:bad": 1})
    cluster.start_worker("w1", pool="threads", concurrency=4)
    keys_ = ["bad", *(f"ok-{i}" for i in range(30))]
    for seq in range(1, 4):
        p.send_orderly_batch("t-keys", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: _handled(r, 90), timeout=60, what="the 90 messages of the good keys handled")
    dlq_q = MessageQueue(keys.dlq_topic(GROUP), "broker-a", 0)
    log = MessageLog(p.brokers)
    wait_for(lambda: len(log.read(dlq_q, 0, 10)) == 3, timeout=60, what="bad's 3 messages in the DLQ")
    entries = ledger(r, GROUP)
    assert check_order(entries)[0] == []
    bad = [(e["seq"], e["reconsume"]) for e in entries if e["key"] == "bad"]
    assert bad == [(s, n) for s in (1, 2, 3) for n in (0, 1, 2)]  # in order, 1 + max_reconsume_times each
    assert [json_seq(m.body) for m in log.read(dlq_q, 0, 10)] == [1, 2, 3]
    # The good keys did not wait for bad's retries: all done before bad's last message went to the DLQ.
    last_good = max(e["end"] for e in entries if e["key"] != "bad")
    last_bad = max(e["end"] for e in entries if e["key"] == "bad")
    assert last_good < last_bad
    wait_for(lambda: log.lag(GROUP, MessageQueue("t-keys", "broker-a", 0)) == 0, timeout=30, what="committed")


def json_seq(raw: bytes) -> int:
    import json

    return int(json.loads(raw)["s"])


def test_kill_9_of_a_worker_mid_flight_keeps_per_key_order_and_loses_nothing(cluster: Cluster, r: redis.Redis) -> None:
    """The surviving worker takes the dead one's queues (new epoch) and redelivers only what the
    dead one had not committed as finished: every key in order, nothing lost, few redeliveries."""
    import time

    from mqorder.consumer.key_request import uncommitted_bound

    p = Producer(cluster.url)
    p.create_topic("t-keys", queues=4)
    r.hset(f"ctl:{GROUP}", "rand_sleep_ms", 10)
    w1 = cluster.start_worker("w1", pool="threads", concurrency=4)
    w2 = cluster.start_worker("w2", pool="threads", concurrency=4)
    keys_ = [f"acct-{i}" for i in range(600)]
    for seq in range(1, 7):
        p.send_orderly_batch("t-keys", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: _handled(r, 600), timeout=60, what="a sixth handled", interval=0.02)
    w1.kill()  # kill -9, mid-flight
    killed_us = time.time_ns() // 1000
    wait_for(lambda: _handled(r, 3600), timeout=120, what="all 3600 handled after the kill")
    entries = ledger(r, GROUP)
    violations, handled, dups = check_order(entries)
    assert violations == [] and handled == 3600
    assert _overlaps_of_one_key([e for e in entries if e["client"] != w1.hostname]) == []
    assert dups <= 4 * uncommitted_bound(32, 16)  # only what was not committed as finished
    w1_queues = {e["queue"] for e in entries if e["client"] == w1.hostname}
    taken_over = {e["queue"] for e in entries if e["client"] == w2.hostname and e["start"] > killed_us}
    assert w1_queues & taken_over  # the dead worker's queues went on, on the survivor

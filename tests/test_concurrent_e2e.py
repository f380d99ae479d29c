"""Concurrent listeners (``@concurrent_listener``) end to end: real ``celery worker`` subprocesses
on the prefork, threads and gevent pools, the retry topic and the DLQ through the workers' own
delay mover, and a kill -9 mid-flight. Every assertion is computed from the ledger the listener
writes (``tests/listeners.py``, group ``g-conc``)."""

from __future__ import annotations

import json
import time
import zlib
from collections import Counter, defaultdict

import pytest
import redis

from mqorder import Producer, keys
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog
from tests.support import Cluster, body, ledger, wait_for

pytestmark = pytest.mark.e2e

GROUP = "g-conc"
TOPIC = "t-conc"
#: Fast retries for the tests: every delay level 200 ms, the mover every 100 ms.
FAST_RETRY = {"MQORDER_MESSAGE_DELAY_LEVEL": " ".join(["200ms"] * 18), "MQORDER_DELAY_MOVE_INTERVAL_MS": "100"}


def _ok(entries: list[dict]) -> set[tuple[str, int]]:
    return {(e["key"], e["seq"]) for e in entries if e["ok"]}


def _max_parallel_in_a_queue(entries: list[dict]) -> int:
    best = 0
    by_q: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in entries:
        if e["topic"] == TOPIC:
            by_q[e["queue"]].append((e["start"], 1))
            by_q[e["queue"]].append((e["end"], -1))
    for events in by_q.values():
        n = 0
        for _, d in sorted(events):
            n += d
            best = max(best, n)
    return best


def _lag(p: Producer) -> int:
    log = MessageLog(p.brokers)
    return sum(log.lag(GROUP, mq) for mq in p.describe_topic(TOPIC).message_queues)


POOLS = [("prefork", 2), ("threads", 8), ("gevent", 64)]


@pytest.mark.parametrize(("pool", "concurrency"), POOLS, ids=[p for p, _ in POOLS])
def test_every_message_is_handled_once_with_calls_of_one_queue_in_parallel(
    cluster: Cluster, r: redis.Redis, pool: str, concurrency: int
) -> None:
    p = Producer(cluster.url)
    p.create_topic(TOPIC, queues=4)
    r.hset(f"ctl:{GROUP}", "rand_sleep_ms", 8)
    cluster.start_worker("w1", pool=pool, concurrency=concurrency)
    cluster.start_worker("w2", pool=pool, concurrency=concurrency)
    sent = [(f"k{i}", s) for s in range(1, 3) for i in range(400)]
    p.send_orderly_batch(TOPIC, [(k, body(k, s)) for k, s in sent])
    wait_for(lambda: len(_ok(ledger(r, GROUP))) >= len(sent), timeout=120, what="800 messages handled")
    entries = ledger(r, GROUP)
    counts = Counter((e["key"], e["seq"]) for e in entries)
    assert set(counts) == set(sent) and max(counts.values()) == 1  # each once: no failure, no crash
    assert _max_parallel_in_a_queue(entries) > 1  # messages of one queue really ran side by side
    wait_for(lambda: _lag(p) == 0, timeout=30, what="every queue committed to its end")


def _keys_on(queue_id: int, n: int, queues: int = 2) -> list[str]:
    """``n`` sharding keys that land on ``queue_id`` (crc32 mod queues, the producer's default; a
    retry goes to the retry queue of the same index when both have as many queues)."""
    out, i = [], 0
    while len(out) < n:
        if zlib.crc32(f"k{i}".encode()) % queues == queue_id:
            out.append(f"k{i}")
        i += 1
    return out


def test_failures_come_back_through_the_retry_topic_and_the_hopeless_go_to_the_dlq(
    cluster: Cluster, r: redis.Redis
) -> None:
    """``flaky`` messages fail twice, then succeed from %RETRY%g-conc with growing reconsume times
    and their own topic; ``bad`` always fails: 1 + max_reconsume_times (3) calls, then the DLQ.
    ``bad`` is alone in its queue (and so in its retry queue): a batch is acknowledged as a prefix
    (``ack_index``), so a good message batched behind a failing one is retried with it."""
    p = Producer(cluster.url)
    p.create_topic(TOPIC, queues=2)
    bad = _keys_on(1, 1)[0]
    good_keys = _keys_on(0, 40)
    flaky = {f"flaky:{k}:1": 2 for k in good_keys[::7]}
    r.hset(f"ctl:{GROUP}", mapping={**flaky, f"fail:{bad}": 1})
    cluster.start_worker("w1", pool="threads", concurrency=4, MQORDER_RETRY_QUEUE_NUMS="2", **FAST_RETRY)
    sent = [(bad, 1), *((k, 1) for k in good_keys)]
    p.send_orderly_batch(TOPIC, [(k, body(k, s)) for k, s in sent])
    good = {x for x in sent if x[0] != bad}
    wait_for(lambda: _ok(ledger(r, GROUP)) >= good, timeout=60, what="every good message handled")
    dlq = MessageQueue(keys.dlq_topic(GROUP), "broker-a", 0)
    log = MessageLog(p.brokers)
    wait_for(lambda: log.read(dlq, 0, 10), timeout=60, what="the bad message in the DLQ")
    entries = ledger(r, GROUP)
    assert sorted(e["reconsume"] for e in entries if e["key"] == bad) == [0, 1, 2, 3]
    assert {e["topic"] for e in entries} == {TOPIC}  # retries arrive under their own topic
    for name in flaky:
        key = name.split(":")[1]
        tries = sorted((e["reconsume"], e["ok"]) for e in entries if e["key"] == key)
        n = len(tries) - 1
        assert n >= 2 and tries == [*((i, False) for i in range(n)), (n, True)]  # failed, came back, done
    assert len(_ok(entries)) == len(good)  # none twice
    dead = log.read(dlq, 0, 10)
    assert [json.loads(m.body)["k"] for m in dead] == [bad]
    assert dead[0].properties["RECONSUME_TIMES"] == "3" and dead[0].properties["ORIGIN_TOPIC"] == TOPIC
    retry_q = p.describe_topic(keys.retry_topic(GROUP)).message_queues
    assert len(retry_q) == 2
    wait_for(lambda: _lag(p) == 0 and sum(log.lag(GROUP, q) for q in retry_q) == 0, timeout=30,
             what="the topic and its retry topic committed to their ends")


def test_kill_9_mid_flight_loses_nothing_and_skips_nothing(cluster: Cluster, r: redis.Redis) -> None:
    """kill -9 of one of two workers mid-flight: every message is handled successfully at least
    once (nothing skipped by the committed offset), redeliveries stay within what was not
    committed as finished, and the survivor takes the dead worker's queues."""
    from mqorder.consumer.key_request import uncommitted_bound

    p = Producer(cluster.url)
    p.create_topic(TOPIC, queues=4)
    r.hset(f"ctl:{GROUP}", "rand_sleep_ms", 10)
    w1 = cluster.start_worker("w1", pool="threads", concurrency=4)
    w2 = cluster.start_worker("w2", pool="threads", concurrency=4)
    sent = {(f"k{i}", s) for s in range(1, 4) for i in range(1000)}
    p.send_orderly_batch(TOPIC, [(k, body(k, s)) for k, s in sorted(sent, key=lambda x: (x[1], x[0]))])

    def a_sixth_handled_by_both() -> bool:
        # Both workers must own work when w1 dies: on a loaded machine w2 can take every queue
        # before w1 is up, and a w1 that handled nothing leaves nothing to take over.
        entries = ledger(r, GROUP)
        return len(_ok(entries)) >= 500 and {w1.hostname, w2.hostname} <= {e["client"] for e in entries}

    wait_for(a_sixth_handled_by_both, timeout=60, what="a sixth handled, by both workers", interval=0.02)
    w1.kill()
    killed_us = time.time_ns() // 1000
    wait_for(lambda: _ok(ledger(r, GROUP)) >= sent, timeout=120, what="all 3000 handled after the kill")
    entries = ledger(r, GROUP)
    dups = len([e for e in entries if e["ok"]]) - len(sent)
    assert dups <= 4 * uncommitted_bound(32, 16, batch_max=2)
    w1_queues = {e["queue"] for e in entries if e["client"] == w1.hostname}
    taken_over = {e["queue"] for e in entries if e["client"] == w2.hostname and e["start"] > killed_us}
    assert w1_queues & taken_over
    wait_for(lambda: _lag(p) == 0, timeout=60, what="every queue committed to its end")

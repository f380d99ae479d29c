"""PullConsumer against a real redis-server: balance, pull, fenced update_offset, and a stale
holder refused after a rebalance moved its queue."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from mqorder import Producer, keys
from mqorder.client.pull_consumer import PullConsumer, PullStatus
from mqorder.errors import OffsetFencedError, OffsetIllegalError, TopicNotFoundError
from mqorder.model import MessageQueue
from mqorder.rebalance.service import RebalanceService
from mqorder.settings import load_settings
from mqorder.store.replies import text


@pytest.fixture
def fast(redis_url: str):
    return load_settings(redis_url=redis_url, heartbeat_interval_ms=200, heartbeat_timeout_ms=1000)


@pytest.fixture
def producer(fast):
    p = Producer(settings=fast)
    p.create_topic("orders", queues=4)
    yield p
    p.close()


def drain(c: PullConsumer, topic: str) -> dict[MessageQueue, list[bytes]]:
    """The application's loop: pull each queue in balance from its committed offset, commit."""
    seen: dict[MessageQueue, list[bytes]] = {}
    for mq in c.fetch_message_queues_in_balance(topic):
        offset = c.fetch_consume_offset(mq)
        while True:
            res = c.pull(mq, offset, 3)
            if res.pull_status is not PullStatus.FOUND:
                break
            seen.setdefault(mq, []).extend(m.body for m in res.msg_found_list)
            c.update_offset(mq, res.next_begin_offset)
            offset = res.next_begin_offset
    return seen


def test_one_consumer_holds_every_queue_and_drains_in_order(fast, producer: Producer) -> None:
    for i in range(20):
        producer.send_orderly("orders", f"k{i % 5}:{i}".encode(), sharding_key=f"k{i % 5}")
    with PullConsumer("audit", settings=fast, client_id="p1") as c:
        seen = drain(c, "orders")
        assert c.fetch_message_queues_in_balance("orders") == producer.describe_topic("orders").message_queues
        assert sum(len(v) for v in seen.values()) == 20
        for bodies in seen.values():
            idx = [int(b.split(b":")[1]) for b in bodies]
            assert idx == sorted(idx)  # per queue, in send order
        for mq in seen:
            assert c.fetch_consume_offset(mq) == len(seen[mq])
        assert drain(c, "orders") == {}  # committed: nothing again


def test_default_client_ids_differ_within_a_process(fast) -> None:
    a, b = PullConsumer("audit", settings=fast), PullConsumer("audit", settings=fast)
    assert a.client_id != b.client_id and a.client_id.startswith("pull-")
    a.shutdown()
    b.shutdown()


def test_two_consumers_split_the_queues_and_a_leaver_hands_its_queues_over(fast, producer: Producer) -> None:
    a = PullConsumer("audit", settings=fast, client_id="pa")
    b = PullConsumer("audit", settings=fast, client_id="pb")
    a.fetch_message_queues_in_balance("orders")
    qb = b.fetch_message_queues_in_balance("orders")
    qa = a.fetch_message_queues_in_balance("orders")
    assert len(qa) == len(qb) == 2 and not set(qa) & set(qb)
    a.shutdown()
    assert len(b.fetch_message_queues_in_balance("orders")) == 4
    b.shutdown()


def test_a_consumer_whose_namesake_left_registers_again_and_gets_its_queues(fast, producer: Producer) -> None:
    """A second consumer under the same client id that shuts down unregisters the id. The one
    still running heartbeated on as a member with no subscriptions, so rebalances gave it no
    queue, for good; it now notices at its next heartbeat and registers again."""
    a = PullConsumer("audit", settings=fast, client_id="same")
    b = PullConsumer("audit", settings=fast, client_id="same")
    try:
        assert len(a.fetch_message_queues_in_balance("orders")) == 4
        b.fetch_message_queues_in_balance("orders")
        b.shutdown()
        deadline = time.monotonic() + 5
        held: list[MessageQueue] = []
        while time.monotonic() < deadline:
            held = a.fetch_message_queues_in_balance("orders")
            if len(held) == 4 and a.registry.heartbeat_and_watch("same").registered:
                break
            time.sleep(0.1)
        assert len(held) == 4
        assert a.registry.heartbeat_and_watch("same").registered
    finally:
        a.shutdown()


def test_a_stale_holder_cannot_commit_after_its_queue_moved(fast, producer: Producer, r: redis.Redis) -> None:
    for i in range(6):
        producer.send_orderly("orders", f"{i}".encode(), sharding_key="k")
    a = PullConsumer("audit", settings=fast, client_id="pa")
    (mq,) = [q for q in a.fetch_message_queues_in_balance("orders") if a.log.max_offset(q)]
    res = a.pull(mq, 0, 3)
    a.update_offset(mq, res.next_begin_offset)  # a holds it: committed
    a._stop.set()  # a is paused: no heartbeat from now on
    time.sleep(1.3)  # its heartbeat lapses
    b = PullConsumer("audit", settings=fast, client_id="pb")
    assert mq in b.fetch_message_queues_in_balance("orders")
    # a wakes up and commits what it pulled in the meantime: refused in the same step as the write
    with pytest.raises(OffsetFencedError, match="stale"):
        a.update_offset(mq, 6)
    assert b.fetch_consume_offset(mq) == 3
    res = b.pull(mq, b.fetch_consume_offset(mq), 32)
    assert [m.body for m in res.msg_found_list] == [b"3", b"4", b"5"]
    b.update_offset(mq, res.next_begin_offset)
    assert int(r.hget(keys.sub_state(mq.tag, "audit"), "offset")) == 6
    with pytest.raises(OffsetFencedError, match="not in this consumer's balance"):
        a.update_offset(mq, 6)  # and it stays out until it fetches its balance again
    b.shutdown()
    a.shutdown()


def test_bad_offsets_are_refused_and_pull_reports_illegal_offsets(fast, producer: Producer) -> None:
    r0 = producer.send_orderly("orders", b"x", sharding_key="k")
    mq = r0.message_queue
    with PullConsumer("audit", settings=fast, client_id="p1") as c:
        assert mq in c.fetch_message_queues_in_balance("orders")
        assert c.pull(mq, 5, 10).pull_status is PullStatus.OFFSET_ILLEGAL
        assert c.pull(mq, 5, 10).next_begin_offset == 1
        huge = c.pull(mq, 2**64, 10)  # past any stream id: once a raw "Invalid stream ID" ResponseError
        assert (huge.pull_status, huge.next_begin_offset) == (PullStatus.OFFSET_ILLEGAL, 1)
        assert c.pull(mq, 1, 10).pull_status is PullStatus.NO_NEW_MSG
        with pytest.raises(OffsetIllegalError, match="max_nums"):
            c.pull(mq, 0, 0)
        with pytest.raises(OffsetIllegalError, match="below 1 only"):
            c.update_offset(mq, 2)
        c.update_offset(mq, 1)
        with pytest.raises(OffsetIllegalError, match="only move forward"):
            c.update_offset(mq, 0)
        with pytest.raises(TopicNotFoundError):
            c.fetch_message_queues_in_balance("nope")


def test_a_queue_its_topic_does_not_have_is_refused(fast, producer: Producer) -> None:
    """Once NO_NEW_MSG and offset 0 for ever, as if a quiet queue: a typo looked like no traffic."""
    with PullConsumer("audit", settings=fast, client_id="p1") as c:
        for bad in (MessageQueue("orders", "broker-a", 99), MessageQueue("orders", "broker-x", 0)):
            with pytest.raises(TopicNotFoundError, match=r"has no queue .* its queues are 4 on broker-a \(0-3\)"):
                c.pull(bad, 0, 3)
            with pytest.raises(TopicNotFoundError, match="has no queue"):
                c.fetch_consume_offset(bad)
        with pytest.raises(TopicNotFoundError, match="nope"):
            c.pull(MessageQueue("nope", "broker-a", 0), 0, 3)
        assert c.pull(MessageQueue("orders", "broker-a", 3), 0, 3).pull_status is PullStatus.NO_NEW_MSG


def test_pull_blocks_until_a_message_arrives(fast, producer: Producer) -> None:
    mq = producer.send_orderly("orders", b"first", sharding_key="k").message_queue
    with PullConsumer("audit", settings=fast, client_id="p1") as c:
        c.fetch_message_queues_in_balance("orders")
        threading.Timer(0.3, lambda: producer.send_orderly("orders", b"second", sharding_key="k")).start()
        t0 = time.monotonic()
        res = c.pull(mq, 1, 10, block_ms=3000)
        assert res.pull_status is PullStatus.FOUND and [m.body for m in res.msg_found_list] == [b"second"]
        assert 0.2 < time.monotonic() - t0 < 2.5


def test_no_consume_request_is_ever_dispatched_to_a_pull_consumer(fast, producer: Producer) -> None:
    for i in range(8):
        producer.send_orderly("orders", b"x", sharding_key=f"k{i}")
    with PullConsumer("audit", settings=fast, client_id="p1") as c:
        c.fetch_message_queues_in_balance("orders")
        svc = RebalanceService(producer.brokers, fast.model_copy(update={"pending_ttl_ms": 200}))
        for mq in producer.describe_topic("orders").message_queues:  # make every queue movable again
            svc.locks.unlock_batch("audit", [mq], "p1", force=True)
        report = svc.rebalance()
        assert report.assigned == 4 and report.moved == 4 and report.dispatches == []
        time.sleep(0.3)  # the pending tokens assign.lua gave lapse: the central sweep would re-dispatch
        assert svc.sweep(["audit"]) == []


@pytest.mark.e2e
def test_a_pull_consumer_beside_real_workers_and_beat_drains_its_group_in_order(cluster, r: redis.Redis) -> None:
    """Workers and beat rebalance every lane, the pull group's too, every second: the pull consumer
    keeps its queues (never fenced, never sent a ConsumeRequest) while a worker group drains the
    same topic."""
    from tests.support import body, ledger, wait_for

    fast = load_settings(redis_url=cluster.url, heartbeat_interval_ms=200, heartbeat_timeout_ms=1000)
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4)
    cluster.start_worker("w1")
    cluster.start_beat(MQORDER_REBALANCE_INTERVAL_MS="1000", MQORDER_LOCK_INTERVAL_MS="1000")
    got: dict[str, list[int]] = {}
    with PullConsumer("audit", settings=fast, client_id="puller") as c:
        c.fetch_message_queues_in_balance("t-order")
        last_rebalance = r.get(keys.rebalance_last())
        n = 0
        deadline = time.monotonic() + 60
        while sum(len(v) for v in got.values()) < 200 and time.monotonic() < deadline:
            if n < 200:
                for _ in range(20):
                    p.send_orderly("t-order", body(f"k{n % 7}", n // 7 + 1), sharding_key=f"k{n % 7}")
                    n += 1
            for mq in c.fetch_message_queues_in_balance("t-order"):
                res = c.pull(mq, c.fetch_consume_offset(mq), 32)
                for m in res.msg_found_list:
                    d = json.loads(m.body)
                    got.setdefault(d["k"], []).append(d["s"])
                if res.pull_status is PullStatus.FOUND:
                    c.update_offset(mq, res.next_begin_offset)  # never fenced: it raises otherwise
            time.sleep(0.3)
        assert r.get(keys.rebalance_last()) != last_rebalance  # the workers' rebalance ran meanwhile
        assert got == {f"k{i}": list(range(1, len(got[f'k{i}']) + 1)) for i in range(7)}
        assert sum(len(v) for v in got.values()) == 200
        assigned = {text(v) for v in r.hvals(keys.assignment("audit"))}
        assert assigned == {"puller"}
    wait_for(lambda: len([e for e in ledger(r, "g-order") if e["ok"]]) >= 200, timeout=60, what="the worker group")
    p.close()


def test_an_unreachable_redis_is_one_clear_error(fast) -> None:
    from mqorder.errors import BrokerUnavailableError

    dead = fast.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    c = PullConsumer("audit", settings=dead, client_id="p1")
    with pytest.raises(BrokerUnavailableError, match="did not answer .* Retry when it is back"):
        c.fetch_message_queues_in_balance("orders")
    with pytest.raises(BrokerUnavailableError, match="fetch_consume_offset"):
        c.fetch_consume_offset(MessageQueue("orders", "broker-a", 0))
    c.shutdown()


def test_commits_over_entries_other_writers_stored_are_checked_by_their_decoded_id(fast, r: redis.Redis) -> None:
    """``update_offset`` names the msg id it pulled at ``offset - 1`` (after a failover the store
    may hold another message there). Entries some other writer stored: a poison header whose id
    is not a string is pulled as a poison message (once a bug: ``pull`` raised AttributeError on
    it, and the queue could not be read past it) and committed unchecked; a header in another
    JSON spacing is compared by its decoded id, not refused for its bytes."""
    p = Producer(settings=fast)
    p.create_topic("raw", queues=1)
    c = PullConsumer("audit", settings=fast, client_id="pr")
    (mq,) = c.fetch_message_queues_in_balance("raw")
    log = keys.queue_log(mq.tag)
    r.xadd(log, {"h": json.dumps({"i": 7, "b": 1}), "b": b"poison", "s": 1}, id="0-1")
    r.xadd(log, {"h": '{ "i" : "X2", "b" : 1 }', "b": b"spaced", "s": 1}, id="1-1")
    r.set(keys.queue_next(mq.tag), 2)
    res = c.pull(mq, 0, 32)
    assert [m.body for m in res.msg_found_list] == [b"poison", b"spaced"]
    assert res.msg_found_list[0].decode_error
    c.update_offset(mq, 1)  # over the poison entry: unchecked
    c.update_offset(mq, 2)  # X2 is X2, whatever the spacing
    assert c.fetch_consume_offset(mq) == 2
    # Another message at offset 1 than the one pulled there: refused, nothing committed.
    r.xadd(log, {"h": '{"i":"X3","b":1}', "b": b"next", "s": 1}, id="2-1")
    r.set(keys.queue_next(mq.tag), 3)
    assert [m.msg_id for m in c.pull(mq, 2, 32).msg_found_list] == ["X3"]
    r.delete(log)
    for off, mid in ((0, "a"), (1, "b"), (2, "Y3")):
        r.xadd(log, {"h": json.dumps({"i": mid, "b": 1}), "b": b"x", "s": 1}, id=f"{off}-1")
    with pytest.raises(OffsetFencedError, match="offset 2 is Y3, not X3"):
        c.update_offset(mq, 3)
    assert c.fetch_consume_offset(mq) == 2
    c.shutdown()
    p.close()

"""RebalanceLockManager and the fenced commit, against a real redis-server."""

from __future__ import annotations

import time

import pytest

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry

MQS = [MessageQueue("t", "broker-a", i) for i in range(4)]


@pytest.fixture
def brokers(redis_url: str):  # noqa: ANN201
    b = BrokerRegistry(redis_url)
    yield b
    b.close()


@pytest.fixture
def locks(brokers: BrokerRegistry) -> RebalanceLockManager:
    return RebalanceLockManager(brokers, lock_max_live_time_ms=60_000)


def commit(brokers: BrokerRegistry, sub: str, mq: MessageQueue, client: str, epoch: int, offset: int):  # noqa: ANN201
    """Run commit.lua as a ConsumeRequest holding ``token`` would."""
    c = brokers.default.client
    st = keys.sub_state(mq.tag, sub)
    c.hset(st, "pending", "tok")
    return brokers.default.scripts.commit(
        keys=[st, keys.queue_next(mq.tag), keys.sub_retries(mq.tag, sub)],
        args=[client, epoch, "tok", offset, 60_000, 60_000, "0"],
    )


def test_try_lock_batch_locks_free_queues_with_first_epoch(locks: RebalanceLockManager) -> None:
    got = locks.try_lock_batch("g", MQS, "c1")
    assert got == {mq: 1 for mq in MQS}
    assert all(locks.is_locked("g", mq, "c1") for mq in MQS)


def test_renewing_own_lock_keeps_epoch(locks: RebalanceLockManager) -> None:
    first = locks.try_lock_batch("g", MQS[:2], "c1")
    again = locks.try_lock_batch("g", MQS[:2], "c1")
    assert first == again


def test_live_lock_of_another_client_is_refused(locks: RebalanceLockManager) -> None:
    locks.try_lock_batch("g", MQS[:2], "c1")
    got = locks.try_lock_batch("g", MQS, "c2")
    assert set(got) == set(MQS[2:])
    assert locks.lock_entry("g", MQS[0]).owner == "c1"


def test_expired_lock_is_taken_over_with_a_new_epoch(brokers: BrokerRegistry) -> None:
    short = RebalanceLockManager(brokers, lock_max_live_time_ms=150)
    assert short.try_lock_batch("g", MQS[:1], "c1") == {MQS[0]: 1}
    assert short.try_lock_batch("g", MQS[:1], "c2") == {}
    time.sleep(0.25)
    assert short.try_lock_batch("g", MQS[:1], "c2") == {MQS[0]: 2}
    assert short.lock_entry("g", MQS[0]).owner == "c2"


def test_lease_is_judged_by_redis_clock_not_the_callers(brokers: BrokerRegistry) -> None:
    short = RebalanceLockManager(brokers, lock_max_live_time_ms=150)
    short.try_lock_batch("g", MQS[:1], "c1")
    lease = int(brokers.default.client.hget(keys.sub_state(MQS[0].tag, "g"), "lease"))
    sec, usec = brokers.default.client.time()
    redis_now = sec * 1000 + usec // 1000
    assert 0 < lease - redis_now <= 150


def test_groups_are_isolated(locks: RebalanceLockManager) -> None:
    assert locks.try_lock_batch("g1", MQS, "c1") == {mq: 1 for mq in MQS}
    assert locks.try_lock_batch("g2", MQS, "c2") == {mq: 1 for mq in MQS}
    assert locks.lock_entry("g1", MQS[0]).owner == "c1"
    assert locks.lock_entry("g2", MQS[0]).owner == "c2"


def test_each_change_of_owner_increments_the_epoch(locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    epochs = []
    for client in ("c1", "c2", "c3"):
        locks.unlock_batch("g", [mq], locks.lock_entry("g", mq).owner or "x", force=True)
        epochs.append(locks.try_lock_batch("g", [mq], client)[mq])
    assert epochs == [1, 2, 3]


def test_unlock_only_releases_own_idle_locks(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    locks.try_lock_batch("g", MQS[:2], "c1")
    assert locks.unlock_batch("g", MQS[:2], "c2") == set()
    # A running ConsumeRequest (run mark in the future) keeps its queue locked.
    brokers.default.client.hset(keys.sub_state(MQS[0].tag, "g"), "run", 2**50)
    assert locks.unlock_batch("g", MQS[:2], "c1") == {MQS[1]}
    assert locks.unlock_batch("g", MQS[:2], "c1", force=True) == {MQS[0]}


def test_stale_epoch_commit_is_refused_and_offset_unchanged(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    e1 = locks.try_lock_batch("g", [mq], "c1")[mq]
    assert commit(brokers, "g", mq, "c1", e1, 5)[0] == b"OK"
    locks.unlock_batch("g", [mq], "c1", force=True)
    e2 = locks.try_lock_batch("g", [mq], "c2")[mq]
    assert e2 == e1 + 1
    refused = commit(brokers, "g", mq, "c1", e1, 9)
    assert refused[0] == b"FENCED" and int(refused[1]) == e2
    assert int(brokers.default.client.hget(keys.sub_state(mq.tag, "g"), "offset")) == 5
    # Even the same client id with an old epoch is refused (a paused earlier incarnation).
    assert commit(brokers, "g", mq, "c2", e1, 9)[0] == b"FENCED"
    assert commit(brokers, "g", mq, "c2", e2, 9)[0] == b"OK"


def test_offset_only_moves_forward(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    e = locks.try_lock_batch("g", [mq], "c1")[mq]
    assert commit(brokers, "g", mq, "c1", e, 7)[0] == b"OK"
    back = commit(brokers, "g", mq, "c1", e, 3)
    assert back[0] == b"BACKWARD"
    assert int(brokers.default.client.hget(keys.sub_state(mq.tag, "g"), "offset")) == 7


def test_take_of_free_queue_is_refused_when_assigned_to_another(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    brokers.default.client.hset(keys.sub_state(mq.tag, "g"), "assignee", "c2")
    assert locks.try_lock_batch("g", [mq], "c1") == {}
    assert locks.try_lock_batch("g", [mq], "c2") == {mq: 1}


def test_assign_moves_idle_lock_and_waits_for_running_owner(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    a, b = MQS[0], MQS[1]
    locks.try_lock_batch("g", [a, b], "c1")
    brokers.default.client.hset(keys.sub_state(b.tag, "g"), "run", 2**50)  # b is being consumed
    res = locks.assign("g", [(a, "c2", "t1"), (b, "c2", "t2")])
    assert res == {a: "MOVED", b: "BUSY"}
    assert locks.lock_entry("g", a).owner == "c2"
    assert locks.lock_entry("g", a).epoch == 2
    assert locks.lock_entry("g", b).owner == "c1"


def test_assign_takes_queues_of_dead_clients_at_once(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    locks.try_lock_batch("g", [mq], "c1")
    brokers.default.client.hset(keys.sub_state(mq.tag, "g"), "run", 2**50)  # dead mid-run
    brokers.default.client.set(keys.queue_next(mq.tag), 3)  # a backlog
    res = locks.assign("g", [(mq, "c2", "tok")], dead_clients=["c1"])
    assert res == {mq: "DISPATCH"}
    st = brokers.default.client.hgetall(keys.sub_state(mq.tag, "g"))
    assert st[b"owner"] == b"c2" and st[b"pending"] == b"tok" and st[b"epoch"] == b"2"

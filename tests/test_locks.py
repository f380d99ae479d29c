"""RebalanceLockManager and the fenced commit, against a real redis-server."""

from __future__ import annotations

import time

import pytest
import redis

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager, Redispatch
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.scripts import NAMES, lua_string, source
from mqorder.testing.embedded import RedisServer, wait_online_replicas
from tests.support import grant_floor

MQS = [MessageQueue("t", "broker-a", i) for i in range(4)]


@pytest.fixture
def brokers(redis_url: str):
    b = BrokerRegistry(redis_url)
    yield b
    b.close()


@pytest.fixture
def locks(brokers: BrokerRegistry) -> RebalanceLockManager:
    return RebalanceLockManager(brokers, lock_max_live_time_ms=60_000)


def commit(brokers: BrokerRegistry, sub: str, mq: MessageQueue, client: str, epoch: int, offset: int):
    """Run commit.lua as a ConsumeRequest holding ``token`` would."""
    c = brokers.default.client
    st = keys.sub_state(mq.tag, sub)
    c.hset(st, "pending", "tok")
    return brokers.default.scripts.commit(
        keys=[st, keys.queue_next(mq.tag), keys.sub_retries(mq.tag, sub)],
        args=[client, epoch, "tok", offset, 60_000, 60_000, "0", "", 0],
    )


def begin(brokers: BrokerRegistry, sub: str, mq: MessageQueue, client: str, token: str):
    """Run begin.lua as the ConsumeRequest carrying ``token`` does when it starts."""
    tag = mq.tag
    return brokers.default.scripts.begin(
        keys=[keys.sub_state(tag, sub), keys.queue_log(tag), keys.queue_next(tag), keys.sub_retries(tag, sub)],
        args=[client, token, 60_000, 60_000, 0, "runner-1"],
    )


def finish(brokers: BrokerRegistry, sub: str, mq: MessageQueue, client: str, token: str):
    """Run finish.lua as the ConsumeRequest carrying ``token`` does when its run ends."""
    return brokers.default.scripts.finish(
        keys=[keys.sub_state(mq.tag, sub), keys.queue_next(mq.tag)],
        args=[client, token, "done", "next-tok", 30_000, 60_000],
    )


def test_try_lock_batch_locks_free_queues_with_a_clock_epoch(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    floor = grant_floor(brokers.default.client)
    got = locks.try_lock_batch("g", MQS, "c1")
    assert set(got) == set(MQS) and all(floor <= e < floor + 60_000_000 for e in got.values())
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
    e1 = short.try_lock_batch("g", MQS[:1], "c1")[MQS[0]]
    assert short.try_lock_batch("g", MQS[:1], "c2") == {}
    time.sleep(0.25)
    assert short.try_lock_batch("g", MQS[:1], "c2")[MQS[0]] > e1
    assert short.lock_entry("g", MQS[0]).owner == "c2"


def test_lease_is_judged_by_redis_clock_not_the_callers(brokers: BrokerRegistry) -> None:
    short = RebalanceLockManager(brokers, lock_max_live_time_ms=150)
    short.try_lock_batch("g", MQS[:1], "c1")
    lease = int(brokers.default.client.hget(keys.sub_state(MQS[0].tag, "g"), "lease"))
    sec, usec = brokers.default.client.time()
    redis_now = sec * 1000 + usec // 1000
    assert 0 < lease - redis_now <= 150


def test_groups_are_isolated(locks: RebalanceLockManager) -> None:
    assert set(locks.try_lock_batch("g1", MQS, "c1")) == set(MQS)
    assert set(locks.try_lock_batch("g2", MQS, "c2")) == set(MQS)
    assert locks.lock_entry("g1", MQS[0]).owner == "c1"
    assert locks.lock_entry("g2", MQS[0]).owner == "c2"


def test_each_change_of_owner_increments_the_epoch(locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    epochs = []
    for client in ("c1", "c2", "c3"):
        locks.unlock_batch("g", [mq], locks.lock_entry("g", mq).owner or "x", force=True)
        epochs.append(locks.try_lock_batch("g", [mq], client)[mq])
    assert epochs == sorted(set(epochs))  # strictly increasing


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
    assert e2 > e1
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
    assert set(locks.try_lock_batch("g", [mq], "c2")) == {mq}


def test_assign_moves_idle_lock_and_waits_for_running_owner(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    a, b = MQS[0], MQS[1]
    e1 = locks.try_lock_batch("g", [a, b], "c1")[a]
    brokers.default.client.hset(keys.sub_state(b.tag, "g"), "run", 2**50)  # b is being consumed
    res = locks.assign("g", [(a, "c2", "t1"), (b, "c2", "t2")])
    assert res == {a: "MOVED", b: "BUSY"}
    assert locks.lock_entry("g", a).owner == "c2"
    assert locks.lock_entry("g", a).epoch > e1
    assert locks.lock_entry("g", b).owner == "c1"


def test_assign_takes_queues_of_dead_clients_at_once(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq = MQS[0]
    e1 = locks.try_lock_batch("g", [mq], "c1")[mq]
    brokers.default.client.hset(keys.sub_state(mq.tag, "g"), "run", 2**50)  # dead mid-run
    brokers.default.client.set(keys.queue_next(mq.tag), 3)  # a backlog
    res = locks.assign("g", [(mq, "c2", "tok")], dead_clients=["c1"])
    assert res == {mq: "DISPATCH"}
    st = brokers.default.client.hgetall(keys.sub_state(mq.tag, "g"))
    assert st[b"owner"] == b"c2" and st[b"pending"] == b"tok" and int(st[b"epoch"]) > e1


# -- releasing a lock: one rule, and what happens to the pending ConsumeRequest ----------------------


def test_unlock_keeps_the_pending_request_which_retakes_the_lock_when_it_runs(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq = MQS[0]
    c, st = brokers.default.client, keys.sub_state(MQS[0].tag, "g")
    c.set(keys.queue_next(mq.tag), 2)  # a backlog
    assert locks.assign("g", [(mq, "c1", "tok")]) == {mq: "DISPATCH"}  # request "tok" is pending
    e1 = locks.lock_entry("g", mq).epoch
    pend_until = c.hget(st, "pend_until")
    assert locks.unlock_batch("g", [mq], "c1") == {mq}
    state = c.hgetall(st)
    assert (state[b"owner"], state[b"lease"], state[b"run"]) == (b"", b"0", b"0")
    assert (state[b"pending"], state[b"pend_until"]) == (b"tok", pend_until)
    # The kept request is still the queue's one request: when it runs, it retakes the free lock of
    # its own queue at a new epoch (tryLockLaterAndReconsume) instead of being dropped as STALE.
    res = begin(brokers, "g", mq, "c1", "tok")
    assert res[0] == b"OK" and int(res[1]) > e1
    assert locks.lock_entry("g", mq).owner == "c1"


def test_unlocked_queue_gets_no_second_request_while_the_kept_one_is_pending(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq = MQS[0]
    brokers.default.client.set(keys.queue_next(mq.tag), 2)
    locks.assign("g", [(mq, "c1", "tok")], pending_ttl_ms=300)
    e1 = locks.lock_entry("g", mq).epoch
    locks.unlock_batch("g", [mq], "c1")
    assert locks.try_lock_batch("g", [mq], "c1")[mq] > e1  # lock_all takes it back
    assert locks.sweep("g", [(mq, "again")], "c1", pending_ttl_ms=300) == []  # "tok" is pending
    time.sleep(0.4)  # "tok" presumed lost (its worker died with it): the sweep replaces it
    assert locks.sweep("g", [(mq, "again")], "c1", pending_ttl_ms=300) == [Redispatch(mq, "c1", "again")]


def test_unassigned_lane_releases_an_idle_lock_and_drops_its_pending_request(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq = MQS[0]
    c, st = brokers.default.client, keys.sub_state(MQS[0].tag, "g")
    c.set(keys.queue_next(mq.tag), 2)
    locks.assign("g", [(mq, "c1", "tok")])
    assert locks.assign("g", [(mq, keys.NOBODY, "x")]) == {mq: "UNASSIGNED"}
    state = c.hgetall(st)
    assert state[b"assignee"] == keys.NOBODY.encode()
    assert (state[b"owner"], state[b"lease"], state[b"run"]) == (b"", b"0", b"0")
    assert (state[b"pending"], state[b"pend_until"]) == (b"", b"0")
    assert begin(brokers, "g", mq, "c1", "tok")[0] == b"STALE"  # the lane is retired


def test_run_ending_on_an_unassigned_lane_releases_the_lock_and_its_own_token(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq = MQS[0]
    c, st = brokers.default.client, keys.sub_state(MQS[0].tag, "g")
    c.set(keys.queue_next(mq.tag), 2)
    locks.assign("g", [(mq, "c1", "tok")])
    c.hset(st, "run", 2**50)  # "tok" is running
    assert locks.assign("g", [(mq, keys.NOBODY, "x")]) == {mq: "UNASSIGNED"}
    assert locks.lock_entry("g", mq).owner == "c1"  # a running owner keeps its lock until its run ends
    assert finish(brokers, "g", mq, "c1", "tok") == [b"IDLE"]
    state = c.hgetall(st)
    assert (state[b"owner"], state[b"lease"], state[b"run"]) == (b"", b"0", b"0")
    assert (state[b"pending"], state[b"pend_until"]) == (b"", b"0")


# -- the shared Lua preludes ---------------------------------------------------------------------------


def test_nobody_reaches_lua_from_the_python_constant() -> None:
    for name in ("assign", "finish"):
        assert source(name).startswith(f"local NOBODY = '{keys.NOBODY}'\n")
        assert "'~'" not in source(name).split("\n", 1)[1]  # no second spelling in the scripts


def test_a_constant_that_would_need_escaping_is_refused() -> None:
    for bad in ("a'b", "a\\b", "a\nb"):
        with pytest.raises(ValueError, match="Lua"):
            lua_string(bad)
    assert lua_string("~") == "'~'"


def test_every_script_compiles_with_its_preludes(r: redis.Redis) -> None:
    for name in NAMES:
        assert len(r.script_load(source(name))) == 40


# -- the sweep, through the lock manager -----------------------------------------------------------------


def test_sweep_redispatches_an_owned_backlog_once(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    mq, other = MQS[0], MQS[1]
    locks.try_lock_batch("g", [mq, other], "c1")
    brokers.default.client.set(keys.queue_next(mq.tag), 3)  # a backlog on mq only
    assert locks.sweep("g", [(mq, "t0"), (other, "t1")], "c2") == []  # not c2's queues
    assert locks.sweep("g", [(mq, "t0"), (other, "t1")], "c1") == [Redispatch(mq, "c1", "t0")]
    assert brokers.default.client.hget(keys.sub_state(mq.tag, "g"), "pending") == b"t0"
    assert locks.sweep("g", [(mq, "t2"), (other, "t3")]) == []  # t0 pending: no second request


def test_sweep_lanes_sweeps_each_lane_in_one_round_trip_and_answers_per_lane(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    """Several subscriptions swept at once (a worker of many groups, issue 27): each lane's state
    is its own, the answers come back per lane, and a queue without a backlog is never dispatched."""
    mq, other = MQS[0], MQS[1]
    for sub in ("g", "h"):
        locks.try_lock_batch(sub, [mq, other], "c1")
    c = brokers.default.client
    c.set(keys.queue_next(mq.tag), 3)
    c.set(keys.queue_next(other.tag), 2)
    c.hset(keys.sub_state(other.tag, "h"), "offset", 2)  # h consumed other's backlog already
    got = locks.sweep_lanes([("g", [(mq, "g0"), (other, "g1")]), ("h", [(mq, "h0"), (other, "h1")]), ("e", [])], "c1")
    assert got == [[Redispatch(mq, "c1", "g0"), Redispatch(other, "c1", "g1")], [Redispatch(mq, "c1", "h0")], []]
    assert c.hget(keys.sub_state(mq.tag, "h"), "pending") == b"h0"
    assert c.hget(keys.sub_state(other.tag, "h"), "pending") in (None, b"")
    assert locks.sweep_lanes([("g", [(mq, "x")]), ("h", [(other, "y")])], "c1") == [[], []]


def script_calls(monkeypatch: pytest.MonkeyPatch, brokers: BrokerRegistry, script: str) -> list[int]:
    """The number of ``script`` calls in each pipelined round trip the default broker sends from
    now on (the real calls still run)."""
    calls: list[int] = []
    real = brokers.default.scripts.run_each  # what the lock manager's steps send their calls with

    def counted(name: str, batch: list) -> list:
        if name == script:
            calls.append(len(batch))
        return real(name, batch)

    monkeypatch.setattr(brokers.default.scripts, "run_each", counted)
    return calls


@pytest.mark.parametrize("per_call", [1024, 3])
def test_the_lanes_of_a_plain_redis_share_sweep_calls_and_answers_stay_per_lane(
    brokers: BrokerRegistry, locks: RebalanceLockManager, monkeypatch: pytest.MonkeyPatch, per_call: int
) -> None:
    """On a plain Redis the lanes' queues go to ``sweep.lua`` in as few calls as its slices allow
    (64 groups of 16 queues cost 64 calls per sweep before, issue 27), and each redispatch still
    comes back in its own lane, with its own token."""
    import mqorder.rebalance.lock_manager as lm

    monkeypatch.setattr(lm, "SWEEP_CALL_QUEUES", per_call)
    lanes = {sub: MQS[:4] for sub in ("g", "h", "i")}
    for sub, mqs in lanes.items():
        locks.try_lock_batch(sub, mqs, "c1")
    c = brokers.default.client
    for mq in MQS[:4]:
        c.set(keys.queue_next(mq.tag), 1)
    c.hset(keys.sub_state(MQS[1].tag, "g"), "offset", 1)  # g consumed queue 1
    c.hset(keys.sub_state(MQS[2].tag, "h"), "offset", 1)  # h consumed queue 2
    for mq in MQS[:4]:  # i consumed everything
        c.hset(keys.sub_state(mq.tag, "i"), "offset", 1)
    calls = script_calls(monkeypatch, brokers, "sweep")
    locks._recorded.clear()
    first = locks.sweep_lanes([(sub, [(mq, f"{sub}{mq.queue_id}") for mq in mqs]) for sub, mqs in lanes.items()], "c1")
    assert first == [
        [Redispatch(MQS[i], "c1", f"g{MQS[i].queue_id}") for i in (0, 2, 3)],
        [Redispatch(MQS[i], "c1", f"h{MQS[i].queue_id}") for i in (0, 1, 3)],
        [],
    ]
    assert c.hget(keys.sub_state(MQS[1].tag, "h"), "pending") == f"h{MQS[1].queue_id}".encode()
    assert calls == [(12 + per_call - 1) // per_call]  # one round trip; the queues sliced per call


def test_try_lock_lanes_answers_per_lane_as_try_lock_batch_does(brokers: BrokerRegistry, locks: RebalanceLockManager) -> None:
    """Leases of several subscriptions renewed in one round trip (issue 27): per lane, the same
    epochs try_lock_batch gives, and a queue locked by another client is refused in its own lane only."""
    mq, other = MQS[0], MQS[1]
    assert locks.try_lock_batch("h", [other], "c2") == {other: locks.lock_entry("h", other).epoch}
    got = locks.try_lock_lanes([("g", [mq, other]), ("h", [mq, other]), ("e", [])], "c1")
    assert got[0] == {mq: locks.lock_entry("g", mq).epoch, other: locks.lock_entry("g", other).epoch}
    assert got[1] == {mq: locks.lock_entry("h", mq).epoch}  # other is c2's on lane h
    assert got[2] == {}
    again = locks.try_lock_lanes([("g", [mq, other]), ("h", [mq])], "c1")
    assert again == [got[0], got[1]]  # renewed, not granted again
    assert locks.try_lock_batch("g", [mq, other], "c1") == got[0]


def test_a_sweep_over_more_queues_than_one_mget_reads_finds_each_backlog(locks: RebalanceLockManager,
                                                                         brokers: BrokerRegistry) -> None:
    """sweep.lua reads the next counters a few hundred per MGET (issue 27's idle cost): a backlog
    in the first chunk, in a later one and at the very end is found, and nothing else."""
    mqs = [MessageQueue("wide", "broker-a", i) for i in range(1203)]
    locks.assign("g", [(mq, "c1", f"t{i}") for i, mq in enumerate(mqs)])
    locks.try_lock_batch("g", mqs, "c1")
    client = brokers.default.client
    for i in (3, 777, 1202):
        client.set(keys.queue_next(mqs[i].tag), 2)
    got = locks.sweep("g", [(mq, f"s{i}") for i, mq in enumerate(mqs)], "c1")
    assert got == [Redispatch(mqs[i], "c1", f"s{i}") for i in (3, 777, 1202)]


@pytest.mark.parametrize("per_call", [1024, 3])
def test_the_lanes_of_a_plain_redis_share_lease_renewal_calls(
    brokers: BrokerRegistry, locks: RebalanceLockManager, monkeypatch: pytest.MonkeyPatch, per_call: int
) -> None:
    """``try_lock_lanes`` on a plain Redis: the lanes' queues in as few ``lock_batch.lua`` calls as
    its slices allow (a worker of 64 groups made 64 per renewal, issue 27), the same answers per
    lane, a queue another client holds refused in its own lane only."""
    import mqorder.rebalance.lock_manager as lm

    monkeypatch.setattr(lm, "LOCK_CALL_QUEUES", per_call)
    assert locks.try_lock_batch("h", [MQS[2]], "c2") == {MQS[2]: locks.lock_entry("h", MQS[2]).epoch}
    calls = script_calls(monkeypatch, brokers, "lock_batch")
    got = locks.try_lock_lanes([("g", MQS[:4]), ("h", MQS[:4]), ("i", MQS[:2])], "c1")
    assert got == [{mq: locks.lock_entry("g", mq).epoch for mq in MQS[:4]},
                   {mq: locks.lock_entry("h", mq).epoch for mq in MQS[:4] if mq != MQS[2]},
                   {mq: locks.lock_entry("i", mq).epoch for mq in MQS[:2]}]
    assert all(e > 0 for lane in got for e in lane.values())
    assert calls == [(10 + per_call - 1) // per_call]


# -- grouping by broker ------------------------------------------------------------------------------------


def test_group_by_broker_keeps_first_seen_order() -> None:
    a0, b0, a1 = MessageQueue("t", "broker-a", 0), MessageQueue("t", "broker-b", 0), MessageQueue("t", "broker-a", 1)
    assert group_by_broker([b0, a0, a1]) == {"broker-b": [b0], "broker-a": [a0, a1]}
    assert list(group_by_broker([b0, a0, a1])) == ["broker-b", "broker-a"]
    triples = [(a1, "c1", "t1"), (b0, "c2", "t2"), (a0, "c1", "t3")]
    assert group_by_broker(triples, lambda t: t[0]) == {"broker-a": [triples[0], triples[2]], "broker-b": [triples[1]]}


def test_lock_manager_batches_spanning_two_brokers(redis_url: str) -> None:
    two = BrokerRegistry(redis_url, {"broker-b": redis_url})
    try:
        locks = RebalanceLockManager(two)
        mqs = [MessageQueue("t", "broker-a", 0), MessageQueue("t", "broker-b", 0), MessageQueue("t", "broker-a", 1)]
        assert locks.assign("g", [(mq, "c1", f"t{i}") for i, mq in enumerate(mqs)]) == {mq: "MOVED" for mq in mqs}
        granted = {mq: locks.lock_entry("g", mq).epoch for mq in mqs}
        assert locks.try_lock_batch("g", mqs, "c1") == granted  # renewed, not granted again
        two.get("broker-b").client.set(keys.queue_next(mqs[1].tag), 1)
        assert locks.sweep("g", [(mq, f"s{i}") for i, mq in enumerate(mqs)], "c1") == [Redispatch(mqs[1], "c1", "s1")]
        assert locks.unlock_batch("g", mqs, "c1") == set(mqs)
    finally:
        two.close()


# -- a run mark the promoted replica kept (sweep.lua's node identity) ------------------------------------


def _sweep_on(brokers: BrokerRegistry, mq: MessageQueue, node: str, token: str) -> list:
    """sweep.lua for c1's lane "g" as a sweep on the node identified by ``node`` sends it."""
    return brokers.default.scripts.sweep(
        keys=[keys.sub_state(mq.tag, "g"), keys.queue_next(mq.tag)], args=["c1", 30_000, node, token])


def _grace_passed(client: redis.Redis, mq: MessageQueue) -> None:
    """As if sweep.lua's SUSPECT_GRACE_MS (5 s) had passed since it noted ``mq``'s run mark."""
    client.hincrby(keys.sub_state(mq.tag, "g"), "suspect_at", -5_001)


def _run_started(brokers: BrokerRegistry, locks: RebalanceLockManager, mq: MessageQueue) -> int:
    """c1 holds ``mq`` with a backlog and a run that has begun (run mark live for 60 s): its epoch."""
    brokers.default.client.set(keys.queue_next(mq.tag), 5)
    locks.assign("g", [(mq, "c1", "tok")])
    assert begin(brokers, "g", mq, "c1", "tok")[0] == b"OK"
    return locks.lock_entry("g", mq).epoch


def test_a_run_mark_from_another_node_not_renewed_by_the_next_sweep_is_fenced_and_redispatched(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq = MQS[0]
    c = brokers.default.client
    c.set(keys.queue_next(mq.tag), 5)
    locks.assign("g", [(mq, "c1", "tok")])
    assert _sweep_on(brokers, mq, "node-a", "s0") == []  # the request is pending: records node-a
    epoch = _run_started(brokers, locks, mq)
    assert c.hget(keys.sub_state(mq.tag, "g"), "run_node") == b"node-a"
    assert _sweep_on(brokers, mq, "node-a", "s1") == []  # the run is live on its own node: untouched
    assert _sweep_on(brokers, mq, "node-a", "s1") == []
    # node-b is a promoted replica: the run mark came from node-a, whose run ended there (finish.lua
    # lost in the failover) or goes on here. The first sweep notes the mark; the next one finds it
    # not renewed. Without the identity the queue would wait out the 60 s run lease.
    assert _sweep_on(brokers, mq, "node-b", "s2") == []
    assert _sweep_on(brokers, mq, "", "s2") == []  # within the grace: a cut run may still be retrying
    assert locks.lock_entry("g", mq).epoch == epoch
    _grace_passed(c, mq)
    assert _sweep_on(brokers, mq, "", "s3") == [1, b"c1", b"s3"]  # recorded already: passed no more
    assert locks.lock_entry("g", mq).epoch > epoch  # fenced: the old run's commits are refused
    assert commit(brokers, "g", mq, "c1", epoch, 3)[0] == b"FENCED"
    assert _sweep_on(brokers, mq, "node-b", "s4") == []  # s3 pending: one request, not a storm


def test_a_run_from_another_node_that_renews_its_mark_goes_on(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    """A run that began on the new primary before its first sweep copied the old node, but it
    commits: its mark moves between the two sweeps, and it is not fenced (no needless redelivery)."""
    mq = MQS[1]
    c = brokers.default.client
    c.set(keys.queue_next(mq.tag), 5)
    locks.assign("g", [(mq, "c1", "tok")])
    assert _sweep_on(brokers, mq, "node-a", "s0") == []
    epoch = _run_started(brokers, locks, mq)
    assert _sweep_on(brokers, mq, "node-b", "s1") == []  # noted
    time.sleep(0.01)
    assert commit(brokers, "g", mq, "c1", epoch, 2)[0] == b"OK"  # renews the run mark
    _grace_passed(c, mq)
    assert _sweep_on(brokers, mq, "node-b", "s2") == []
    assert _sweep_on(brokers, mq, "node-b", "s3") == []
    assert locks.lock_entry("g", mq).epoch == epoch
    assert c.hget(keys.sub_state(mq.tag, "g"), "suspect") == b""


def test_a_held_idle_queue_first_swept_on_another_node_gets_a_new_epoch(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    """Redis restored from an older snapshot (or a failover that lost a re-grant to the same
    holder) can hold an epoch older than one the holder already used; a renewal keeps the stored
    epoch, so the holder went on under it and a sink fencing on ``ctx.epoch`` refused everything
    (a durability walk-through: a message to the DLQ every 16 s). The first sweep on the new node
    grants a held queue with no run a new epoch, which the holder's next begin takes."""
    mq = MQS[3]
    c = brokers.default.client
    locks.assign("g", [(mq, "c1", "tok")])
    assert _sweep_on(brokers, mq, "node-a", "s0") == []
    before = locks.lock_entry("g", mq).epoch
    assert _sweep_on(brokers, mq, "node-a", "s1") == []  # the same node: nothing changes
    assert locks.lock_entry("g", mq).epoch == before
    assert _sweep_on(brokers, mq, "node-b", "s2") == []  # restarted or promoted: a new grant
    after = locks.lock_entry("g", mq).epoch
    assert after > before and locks.lock_entry("g", mq).owner == "c1"
    c.set(keys.queue_next(mq.tag), 2)
    assert _sweep_on(brokers, mq, "", "s3") == [1, b"c1", b"s3"]  # dispatched under the new epoch
    assert locks.lock_entry("g", mq).epoch == after
    assert begin(brokers, "g", mq, "c1", "s3")[0] == b"OK"
    assert locks.lock_entry("g", mq).epoch == after


def test_a_queue_without_a_backlog_at_the_sweeps_is_recorded_and_its_stale_mark_noted(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    """A trickle rarely has a backlog at the instant of a sweep: the node is recorded and a stale
    run mark noted all the same, and the first sweep that finds a backlog fences it."""
    mq = MQS[2]
    c = brokers.default.client
    locks.assign("g", [(mq, "c1", "tok")])
    assert _sweep_on(brokers, mq, "node-a", "s0") == []  # no backlog: recorded all the same
    assert c.hget(keys.sub_state(mq.tag, "g"), "node") == b"node-a"
    c.hset(keys.sub_state(mq.tag, "g"), "pending", "tok")  # a request woken by a send, drained since
    assert begin(brokers, "g", mq, "c1", "tok")[0] == b"OK"
    epoch = locks.lock_entry("g", mq).epoch
    assert _sweep_on(brokers, mq, "node-b", "s1") == []  # the failover: noted, nothing to dispatch
    assert c.hget(keys.sub_state(mq.tag, "g"), "suspect") == c.hget(keys.sub_state(mq.tag, "g"), "run")
    assert _sweep_on(brokers, mq, "", "s2") == []  # recorded: the idle path, nothing to do
    c.set(keys.queue_next(mq.tag), 3)  # a send; its wake-up found the dead run's token pending
    _grace_passed(c, mq)
    assert _sweep_on(brokers, mq, "", "s3") == [1, b"c1", b"s3"]
    assert locks.lock_entry("g", mq).epoch > epoch


def test_a_run_begun_on_this_node_and_a_queue_never_swept_are_judged_by_leases_alone(
    brokers: BrokerRegistry, locks: RebalanceLockManager
) -> None:
    mq, fresh = MQS[0], MQS[1]
    c = brokers.default.client
    c.set(keys.queue_next(mq.tag), 5)
    locks.assign("g", [(mq, "c1", "tok")])
    assert _sweep_on(brokers, mq, "node-a", "s0") == []
    assert _sweep_on(brokers, mq, "node-b", "s1") == []  # nothing ran: the node recorded, nothing fenced
    epoch = _run_started(brokers, locks, mq)
    assert c.hget(keys.sub_state(mq.tag, "g"), "run_node") == b"node-b"
    assert _sweep_on(brokers, mq, "node-b", "s2") == []
    assert locks.lock_entry("g", mq).epoch == epoch
    # A queue no sweep recorded yet (a new deployment, or one from before the identity): a live
    # run there is left alone, whatever node sweeps first.
    fresh_epoch = _run_started(brokers, locks, fresh)
    assert _sweep_on(brokers, fresh, "node-c", "s3") == []
    assert locks.lock_entry("g", fresh).epoch == fresh_epoch
    assert c.hget(keys.sub_state(fresh.tag, "g"), "node") == b"node-c"
    assert _sweep_on(brokers, fresh, "", "s4") == []  # '' = identity unknown: leases only


def test_a_replica_promoted_without_the_runs_finish_is_swept_without_the_run_lease(redis_server: RedisServer) -> None:
    """Real replication: the run begins on the primary, the replica is promoted (REPLICAOF NO ONE,
    a new replication id) before the run's finish.lua reaches it, and the second sweep on the
    promoted node dispatches the queue instead of waiting out the 60 s run lease."""
    redis_server.flushall()
    mq = MQS[2]
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(redis_server.port)]) as replica:
        wait_online_replicas(redis_server, 1)
        old, new = BrokerRegistry(redis_server.url), BrokerRegistry(replica.url)
        try:
            locks_old, locks_new = RebalanceLockManager(old), RebalanceLockManager(new)
            old.default.client.set(keys.queue_next(mq.tag), 5)
            locks_old.assign("g", [(mq, "c1", "tok")])
            assert locks_old.sweep("g", [(mq, "s0")], "c1") == []  # records the primary's identity
            assert begin(old, "g", mq, "c1", "tok")[0] == b"OK"
            assert old.default.client.wait(1, 5000) == 1  # the run mark is on the replica
            replica_client = new.default.client
            replica_client.execute_command("REPLICAOF", "NO", "ONE")
            assert finish(old, "g", mq, "c1", "tok")[0] == b"REQUEUE"  # on the old primary only
            state = replica_client.hgetall(keys.sub_state(mq.tag, "g"))
            assert int(state[b"run"]) > time.time() * 1000 + 50_000  # the promoted node's run mark is live
            assert locks_new.sweep("g", [(mq, "s1")], "c1") == []  # noted
            assert locks_new.sweep("g", [(mq, "s1")], "c1") == []  # within the grace
            replica_client.hincrby(keys.sub_state(mq.tag, "g"), "suspect_at", -5_001)  # 5 s later
            assert locks_new.sweep("g", [(mq, "s1")], "c1") == [Redispatch(mq, "c1", "s1")]  # not renewed
            assert locks_old.sweep("g", [(mq, "s2")], "c1") == []  # the old primary: next-tok pending
        finally:
            old.close()
            new.close()


def test_a_user_refused_info_is_swept_by_leases_alone(redis_server: RedisServer, brokers: BrokerRegistry) -> None:
    """An ACL user without INFO (a locked-down managed Redis) gets no node identity: its sweeps go on
    as before the identity existed, rather than failing every sweep interval."""
    admin = brokers.default.client
    admin.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info")
    limited = BrokerRegistry(f"redis://noinfo:pw@127.0.0.1:{redis_server.port}/0")
    try:
        mq = MQS[3]
        assert limited.default.node_identity(mq.tag) == ""
        assert brokers.default.node_identity(mq.tag) != ""
        locks = RebalanceLockManager(limited)
        admin.set(keys.queue_next(mq.tag), 2)
        locks.assign("g", [(mq, "c1", "tok")], pending_ttl_ms=100)
        time.sleep(0.2)  # "tok" presumed lost
        assert locks.sweep("g", [(mq, "again")], "c1") == [Redispatch(mq, "c1", "again")]
    finally:
        limited.close()
        admin.execute_command("ACL", "DELUSER", "noinfo")


def test_the_sweep_records_a_nodes_identity_on_a_queue_once(brokers: BrokerRegistry,
                                                              locks: RebalanceLockManager) -> None:
    """The identity goes to sweep.lua once per queue and identity (its idle path stays two plain
    reads): a record changed behind the manager's back stays as it is until the identity changes."""
    mq = MQS[0]
    c = brokers.default.client
    locks.assign("g", [(mq, "c1", "tok")])
    state = keys.sub_state(mq.tag, "g")
    assert locks.sweep("g", [(mq, "s0")], "c1") == []
    assert c.hget(state, "node") == brokers.default.node_identity(mq.tag).encode()
    c.hset(state, "node", "elsewhere")
    assert locks.sweep("g", [(mq, "s1")], "c1") == []
    assert c.hget(state, "node") == b"elsewhere"
    fresh = RebalanceLockManager(brokers)  # a restarted worker records again
    assert fresh.sweep("g", [(mq, "s2")], "c1") == []
    assert c.hget(state, "node") == brokers.default.node_identity(mq.tag).encode()

"""The offset map of key-ordered consumption: encoding, the in-memory tracker, and its fenced
commit (key_commit.lua) against a real redis-server."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqorder import keys
from mqorder.consumer.offset_map import OffsetTracker, decode_done, encode_done
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry

MQ = MessageQueue("t", "broker-a", 0)


@given(st.integers(0, 10**9), st.sets(st.integers(1, 3000)))
def test_done_offsets_round_trip_whatever_the_encoding(base: int, rel: set[int]) -> None:
    done = sorted(base + r for r in rel)
    raw = encode_done(base, done)
    assert decode_done(raw, base) == set(done)


def test_the_shorter_encoding_is_chosen_and_stays_bounded_by_the_span() -> None:
    assert encode_done(10, [12, 13, 14]) == "10:be"  # bits 1..3 of offsets 11..14
    assert encode_done(10, range(511, 611)) == "10:r500,100"  # one long run far above: run lengths
    alternating = list(range(11, 2011, 2))  # every other offset of a 2,000 span
    raw = encode_done(10, alternating)
    assert raw.startswith("10:b") and len(raw) <= 2000 // 4 + 8


def test_a_map_is_void_once_the_offset_moved_without_it() -> None:
    raw = encode_done(10, [12])
    assert decode_done(raw, 10) == {12}
    assert decode_done(raw, 11) == set()  # a queue-mode commit, a reset or a trim moved the offset
    assert decode_done("garbage", 10) == set() and decode_done(b"10:x1", 10) == set()


@pytest.mark.parametrize("raw", ["0:b-1", "0:b-ff", "0:r0,10000000000", "0:r5,-1,3", "0:bzz", "0:x12", "0:"])
def test_a_malformed_map_decodes_to_nothing_at_once(raw: str) -> None:
    """A hand-edited or corrupted ``done`` field: ``-1`` once looped for ever at the run's start,
    and a run of ten billion offsets would have been built as a set."""
    assert decode_done(raw, 0) == set()


def test_tracker_commits_the_lowest_unfinished_offset_and_maps_what_finished_above() -> None:
    t = OffsetTracker(100)
    for o in (100, 101, 103, 104):  # 102 was trimmed from the log
        assert t.pulled(o)
    t.finish(101)
    t.finish(104)
    assert t.base == 100 and t.done_offsets() == [101, 102, 104]
    t.finish(100)
    assert t.base == 103 and t.done_offsets() == [104]
    t.finish(103)
    assert t.base == 105 and t.done_offsets() == [] and t.span == 0


def test_tracker_skips_what_a_previous_owner_finished_and_keeps_it_mapped_until_pulled() -> None:
    t = OffsetTracker(5, inherited={7, 9})
    assert t.pulled(5) and t.pulled(6)
    assert t.done_offsets() == [7, 9]  # not pulled yet: still recorded
    assert not t.pulled(7)  # finished before the failover: not handed out again
    assert t.pulled(8) and not t.pulled(9)
    t.finish(5)
    t.finish(8)
    assert t.base == 6 and t.done_offsets() == [7, 8, 9]
    assert t.skipped == 2


def test_tracker_against_a_model_of_random_finishing_orders() -> None:
    rng = random.Random(7)
    for _ in range(50):
        base = rng.randrange(1000)
        offs = [base + i for i in range(rng.randrange(1, 60))]
        t = OffsetTracker(base)
        for o in offs:
            t.pulled(o)
        finished: set[int] = set()
        for o in rng.sample(offs, rng.randrange(len(offs) + 1)):
            t.finish(o)
            finished.add(o)
            low = min((x for x in offs if x not in finished), default=offs[-1] + 1)
            assert t.base == low
            assert set(t.done_offsets()) == {x for x in finished if x > low}
            assert decode_done(t.encoded(), low) == {x for x in finished if x > low}


# -- key_commit.lua, fenced ---------------------------------------------------------------------


@pytest.fixture
def brokers(redis_url: str):
    b = BrokerRegistry(redis_url)
    yield b
    b.close()


def key_commit(brokers: BrokerRegistry, client: str, epoch: int, offset: int, done: str, *retries: object,
               token: str = "tok", limit: int = 4096, skipped: int = 0, read_to: int = 0):
    tag = MQ.tag
    return brokers.default.scripts.key_commit(
        keys=[keys.sub_state(tag, "g"), keys.queue_next(tag), keys.sub_retries(tag, "g")],
        args=[client, epoch, token, offset, 60_000, 60_000, "0", done, limit, skipped, read_to, *retries],
    )


def begin(brokers: BrokerRegistry, client: str, token: str):
    tag = MQ.tag
    return brokers.default.scripts.begin(
        keys=[keys.sub_state(tag, "g"), keys.queue_log(tag), keys.queue_next(tag), keys.sub_retries(tag, "g")],
        args=[client, token, 60_000, 60_000, 0, "runner-" + token],
    )


def owned_by(brokers: BrokerRegistry, client: str) -> int:
    """Lock MQ for ``client`` with a pending token ``tok``; its epoch."""
    locks = RebalanceLockManager(brokers, lock_max_live_time_ms=60_000)
    locks.assign("g", [(MQ, client, "tok")])
    brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
    return int(brokers.default.client.hget(keys.sub_state(MQ.tag, "g"), "epoch"))


def test_key_commit_stores_offset_and_map_together_and_begin_returns_the_map(brokers: BrokerRegistry) -> None:
    epoch = owned_by(brokers, "c1")
    raw = encode_done(3, [5, 6])
    assert key_commit(brokers, "c1", epoch, 3, raw, 4, 2, 7, 1)[0] == b"OK"
    st_ = brokers.default.client.hgetall(keys.sub_state(MQ.tag, "g"))
    assert (st_[b"offset"], st_[b"done"]) == (b"3", raw.encode())
    brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), "run", 0)  # that run ended; the next begins
    res = begin(brokers, "c1", "tok")
    assert res[0] == b"OK" and int(res[2]) == 3 and decode_done(res[6], int(res[2])) == {5, 6}
    # A retry count of 0 deletes the offset's count (it finished); others are kept.
    assert key_commit(brokers, "c1", epoch, 3, raw, 4, 0)[0] == b"OK"
    assert brokers.default.client.hgetall(keys.sub_retries(MQ.tag, "g")) == {b"7": b"1"}


def test_key_commit_refuses_a_stale_epoch_and_leaves_offset_and_map_untouched(brokers: BrokerRegistry) -> None:
    epoch = owned_by(brokers, "c1")
    assert key_commit(brokers, "c1", epoch, 3, encode_done(3, [5]), skipped=2)[0] == b"OK"
    # Failover: c2 takes the queue (a new epoch); the paused c1 wakes and tries to commit more.
    brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), mapping={"lease": 0})
    epoch2 = owned_by(brokers, "c2")
    assert epoch2 > epoch
    res = key_commit(brokers, "c1", epoch, 9, encode_done(9, [10, 11]), skipped=4)
    assert res[0] == b"FENCED" and int(res[1]) == epoch2
    st_ = brokers.default.client.hgetall(keys.sub_state(MQ.tag, "g"))
    assert (st_[b"offset"], decode_done(st_[b"done"], 3)) == (b"3", {5})
    assert st_[b"skipped"] == b"2"  # the retention skip of the refused commit is not counted either


def test_key_commit_refuses_a_map_not_relative_to_its_offset_or_too_large(brokers: BrokerRegistry) -> None:
    epoch = owned_by(brokers, "c1")
    assert key_commit(brokers, "c1", epoch, 4, encode_done(3, [5]))[0] == b"BADMAP"
    assert key_commit(brokers, "c1", epoch, 3, encode_done(3, list(range(5, 900, 2))), limit=64)[0] == b"BADMAP"
    assert key_commit(brokers, "c1", epoch, 2, "")[0] == b"OK"
    assert key_commit(brokers, "c1", epoch, 1, "")[0] == b"BACKWARD"


def test_an_offset_reset_voids_the_map_and_the_suspended_keys(brokers: BrokerRegistry) -> None:
    epoch = owned_by(brokers, "c1")
    assert key_commit(brokers, "c1", epoch, 3, encode_done(3, [5]))[0] == b"OK"
    tag = MQ.tag
    brokers.default.client.hset(keys.sub_state(tag, "g"), "held", "4:1795909404818")
    brokers.default.scripts.reset_offset(keys=[keys.sub_state(tag, "g"), keys.sub_retries(tag, "g")], args=[3])
    assert brokers.default.client.hmget(keys.sub_state(tag, "g"), "done", "held") == [None, None]


def test_the_committed_offset_moves_past_inherited_finished_offsets_not_pulled_yet() -> None:
    """Found by the keys-poison chaos scenario: everything pulled finished and the next offsets
    were finished by a previous owner; the committed offset is past them, and the map never
    names the committed offset itself."""
    t = OffsetTracker(100, inherited={101, 102, 105})
    assert t.pulled(100)
    t.finish(100)
    assert t.base == 103 and t.done_offsets() == [105]
    assert decode_done(t.encoded(), 103) == {105}
    assert not t.pulled(101) and not t.pulled(102) and t.base == 103  # pulled later: skipped, no step back
    assert t.pulled(103) and t.pulled(104) and not t.pulled(105)
    t.finish(104)
    assert t.base == 103 and t.done_offsets() == [104, 105]
    t.finish(103)
    assert t.base == 106 and t.done_offsets() == []


@given(st.integers(0, 50), st.sets(st.integers(1, 40)), st.lists(st.integers(0, 2), min_size=1, max_size=60))
def test_the_map_always_encodes_whatever_the_inherited_offsets_and_finishing_order(
    base: int, inherited_rel: set[int], plan: list[int]
) -> None:
    """Steps: 0 pulls the next offset, 2 skips one (trimmed from the log: never read back),
    1 finishes a pending one."""
    t = OffsetTracker(base, {base + r for r in inherited_rel})
    pending: list[int] = []
    o = base
    for step in plan:
        if step == 2:
            o += 1
        elif step == 0 or not pending:
            if t.pulled(o):
                pending.append(o)
            o += 1
        else:
            t.finish(pending.pop(0 if len(pending) % 2 else -1))
        done = t.done_offsets()
        assert all(x > t.base for x in done)
        assert not set(done) & set(pending)  # nothing unfinished is ever marked done
        assert {x for x in range(t.base + 1, t.pulled_to) if x not in pending} <= set(done)
        assert decode_done(t.encoded(), t.base) == set(done)
        assert t.base == min(pending, default=t.base)

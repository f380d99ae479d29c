"""Unit tests of the queue allocation strategies (no Redis, no Celery)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqorder.errors import ConfigError
from mqorder.model import MessageQueue
from mqorder.rebalance.allocate import (
    AllocateMessageQueueAveragely,
    AllocateMessageQueueAveragelyByCircle,
    AllocateMessageQueueByConfig,
    AllocateMessageQueueByMachineRoom,
    AllocateMessageQueueConsistentHash,
    allocate_all,
    strategy_from_settings,
)
from mqorder.settings import load_settings

GROUP = "group-1"


def queues(n: int, topic: str = "T", broker: str = "broker-a") -> list[MessageQueue]:
    return [MessageQueue(topic, broker, i) for i in range(n)]


def clients(c: int) -> list[str]:
    # zero padded so that sorted order == index order
    return [f"cid-{i:02d}" for i in range(c)]


def per_client(strategy, mq_all, cid_all) -> list[list[MessageQueue]]:
    return [strategy.allocate(GROUP, cid, mq_all, cid_all) for cid in cid_all]


def qids(mqs: list[MessageQueue]) -> list[int]:
    return [mq.queue_id for mq in mqs]


def mixed_queues() -> list[MessageQueue]:
    """Queues of two topics on two brokers in two rooms, in a non-sorted order."""
    out = []
    for broker in ("room2@broker-b", "room1@broker-a"):
        for topic in ("orders", "audit"):
            out += [MessageQueue(topic, broker, i) for i in (7, 0, 11, 3, 2)]
    return out


ALL_STRATEGIES = [
    pytest.param(AllocateMessageQueueAveragely(), id="averagely"),
    pytest.param(AllocateMessageQueueAveragelyByCircle(), id="by_circle"),
    pytest.param(AllocateMessageQueueByMachineRoom(["room1", "room2"]), id="by_machine_room"),
    pytest.param(AllocateMessageQueueConsistentHash(), id="consistent_hash"),
]
COVERING_STRATEGIES = ALL_STRATEGIES  # each of these hands out every queue of mq_all


# -- averagely ------------------------------------------------------------------------------------


def test_averagely_8_queues_3_clients_matches_rocketmq_contiguous_layout() -> None:
    got = per_client(AllocateMessageQueueAveragely(), queues(8), clients(3))
    assert [qids(g) for g in got] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_averagely_10_queues_4_clients_gives_extra_queue_to_first_clients() -> None:
    got = per_client(AllocateMessageQueueAveragely(), queues(10), clients(4))
    assert [qids(g) for g in got] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_averagely_more_clients_than_queues_leaves_last_clients_idle() -> None:
    got = per_client(AllocateMessageQueueAveragely(), queues(3), clients(5))
    assert [qids(g) for g in got] == [[0], [1], [2], [], []]


# -- by circle ------------------------------------------------------------------------------------


def test_by_circle_client_i_gets_i_plus_multiples_of_client_count() -> None:
    got = per_client(AllocateMessageQueueAveragelyByCircle(), queues(8), clients(3))
    assert [qids(g) for g in got] == [[0, 3, 6], [1, 4, 7], [2, 5]]


def test_by_circle_more_clients_than_queues_leaves_last_clients_idle() -> None:
    got = per_client(AllocateMessageQueueAveragelyByCircle(), queues(2), clients(4))
    assert [qids(g) for g in got] == [[0], [1], [], []]


# -- property: averagely and by circle cover everything, balanced --------------------------------


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200), c=st.integers(1, 20))
def test_averagely_covers_every_queue_once_in_contiguous_balanced_blocks(n: int, c: int) -> None:
    mq_all, cid_all = queues(n), clients(c)
    got = per_client(AllocateMessageQueueAveragely(), mq_all, cid_all)
    # concatenating the clients' blocks in client order gives back mq_all: each queue exactly once,
    # in contiguous blocks
    assert [mq for block in got for mq in block] == mq_all
    sizes = [len(g) for g in got]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the bigger blocks go to the first clients
    assignment = allocate_all(AllocateMessageQueueAveragely(), GROUP, mq_all, cid_all)
    assert set(assignment) == set(mq_all)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200), c=st.integers(1, 20))
def test_by_circle_covers_every_queue_once_with_balanced_sizes(n: int, c: int) -> None:
    mq_all, cid_all = queues(n), clients(c)
    got = per_client(AllocateMessageQueueAveragelyByCircle(), mq_all, cid_all)
    counts = Counter(mq for g in got for mq in g)
    assert set(counts) == set(mq_all)
    assert set(counts.values()) == {1}
    sizes = [len(g) for g in got]
    assert max(sizes) - min(sizes) <= 1
    for i, g in enumerate(got):
        assert qids(g) == list(range(i, n, c))


# -- every strategy -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", COVERING_STRATEGIES)
def test_every_queue_is_assigned_to_exactly_one_client(strategy) -> None:
    mq_all = sorted(mixed_queues())
    cid_all = clients(3)
    got = per_client(strategy, mq_all, cid_all)
    counts = Counter(mq for g in got for mq in g)
    assert set(counts) == set(mq_all)
    assert set(counts.values()) == {1}
    assert set(allocate_all(strategy, GROUP, mq_all, cid_all)) == set(mq_all)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_allocate_all_is_independent_of_input_order_and_duplicate_clients(strategy, data) -> None:
    mq_all = mixed_queues()
    cid_all = ["worker-b@host2", "worker-a@host1", "worker-c@host1", "worker-d@host3"]
    reference = allocate_all(strategy, GROUP, sorted(mq_all), sorted(cid_all))
    shuffled_mqs = data.draw(st.permutations(mq_all))
    shuffled_cids = data.draw(st.permutations(cid_all + cid_all[:2]))  # duplicates too
    assert allocate_all(strategy, GROUP, shuffled_mqs, shuffled_cids) == reference


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_client_not_in_cid_all_gets_nothing(strategy) -> None:
    mq_all = sorted(mixed_queues())
    assert strategy.allocate(GROUP, "ghost", mq_all, clients(3)) == []
    assert "ghost" not in allocate_all(strategy, GROUP, mq_all, clients(3)).values()


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_no_queues_means_nothing_to_allocate(strategy) -> None:
    assert strategy.allocate(GROUP, "cid-00", [], clients(3)) == []
    assert allocate_all(strategy, GROUP, [], clients(3)) == {}


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_empty_current_cid_is_refused(strategy) -> None:
    with pytest.raises(ValueError, match="current_cid is empty"):
        strategy.allocate(GROUP, "", queues(4), clients(2))


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_no_clients_leaves_every_queue_unassigned(strategy) -> None:
    assert allocate_all(strategy, GROUP, queues(4), []) == {}


# -- by config ------------------------------------------------------------------------------------


def test_by_config_hands_out_exactly_the_configured_queues() -> None:
    mq_all = queues(5)
    strategy = AllocateMessageQueueByConfig(
        {
            "cid-a": ["T:broker-a:0", "T:broker-a:2"],
            "cid-b": ["T:broker-a:1", "T:broker-a:99", "Other:broker-a:0"],  # unknown keys are ignored
        }
    )
    assert qids(strategy.allocate(GROUP, "cid-a", mq_all, ["cid-a", "cid-b"])) == [0, 2]
    assert qids(strategy.allocate(GROUP, "cid-b", mq_all, ["cid-a", "cid-b"])) == [1]
    assert strategy.allocate(GROUP, "cid-c", mq_all, ["cid-a", "cid-b", "cid-c"]) == []
    assignment = allocate_all(strategy, GROUP, list(reversed(mq_all)), ["cid-c", "cid-b", "cid-a"])
    assert assignment == {mq_all[0]: "cid-a", mq_all[2]: "cid-a", mq_all[1]: "cid-b"}
    # queues 3 and 4 are configured for nobody and stay unassigned


def test_by_config_client_absent_from_cid_all_gets_nothing_from_allocate_all() -> None:
    mq_all = queues(3)
    strategy = AllocateMessageQueueByConfig({"cid-a": ["T:broker-a:0"], "dead": ["T:broker-a:1", "T:broker-a:2"]})
    assert allocate_all(strategy, GROUP, mq_all, ["cid-a"]) == {mq_all[0]: "cid-a"}


def test_by_config_refuses_non_dict_config() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        AllocateMessageQueueByConfig(["T:broker-a:0"])  # type: ignore[arg-type]


# -- by machine room ------------------------------------------------------------------------------


def room_queues() -> list[MessageQueue]:
    return sorted(queues(4, broker="room1@broker-a") + queues(4, broker="room2@broker-b"))


def test_by_machine_room_hands_out_only_queues_of_consuming_rooms() -> None:
    mq_all = room_queues()
    strategy = AllocateMessageQueueByMachineRoom(["room1"])
    assignment = allocate_all(strategy, GROUP, mq_all, clients(3))
    assert set(assignment) == {mq for mq in mq_all if mq.broker_name == "room1@broker-a"}
    got = per_client(strategy, mq_all, clients(3))
    counts = Counter(mq for g in got for mq in g)
    assert set(counts.values()) == {1}
    assert all(mq.broker_name.startswith("room1@") for mq in counts)
    sizes = [len(g) for g in got]
    assert max(sizes) - min(sizes) <= 1


def test_by_machine_room_matches_rocketmq_layout() -> None:
    # 4 room1 queues over 3 clients: mod=1, rem=1 -> client 0 gets [0] plus the remainder [3]
    got = per_client(AllocateMessageQueueByMachineRoom(["room1"]), room_queues(), clients(3))
    assert [qids(g) for g in got] == [[0, 3], [1], [2]]
    assert {mq.broker_name for g in got for mq in g} == {"room1@broker-a"}


def test_by_machine_room_with_no_matching_room_hands_out_nothing() -> None:
    assert allocate_all(AllocateMessageQueueByMachineRoom(["room3"]), GROUP, room_queues(), clients(2)) == {}


def test_by_machine_room_with_all_rooms_covers_every_queue() -> None:
    mq_all = room_queues()
    assignment = allocate_all(AllocateMessageQueueByMachineRoom(["room1", "room2"]), GROUP, mq_all, clients(3))
    assert set(assignment) == set(mq_all)


# -- consistent hash ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 64), c=st.integers(2, 8), data=st.data())
def test_consistent_hash_removing_a_client_moves_only_its_queues(n: int, c: int, data) -> None:
    strategy = AllocateMessageQueueConsistentHash()
    mq_all, cid_all = queues(n), clients(c)
    before = allocate_all(strategy, GROUP, mq_all, cid_all)
    assert set(before) == set(mq_all)
    gone = data.draw(st.sampled_from(cid_all))
    after = allocate_all(strategy, GROUP, mq_all, [cid for cid in cid_all if cid != gone])
    assert set(after) == set(mq_all)
    for mq in mq_all:
        if before[mq] == gone:
            assert after[mq] != gone
        else:
            assert after[mq] == before[mq], f"{mq} moved from {before[mq]} to {after[mq]}"


def test_consistent_hash_adding_a_client_only_moves_queues_to_it() -> None:
    strategy = AllocateMessageQueueConsistentHash()
    mq_all = queues(64)
    before = allocate_all(strategy, GROUP, mq_all, clients(4))
    after = allocate_all(strategy, GROUP, mq_all, clients(5))
    moved = {mq for mq in mq_all if before[mq] != after[mq]}
    assert moved, "a new client should take some of 64 queues"
    assert {after[mq] for mq in moved} == {"cid-04"}


def test_consistent_hash_is_stable_across_instances() -> None:
    # md5-based, so it does not depend on Python's per-process hash seed
    a = allocate_all(AllocateMessageQueueConsistentHash(7), GROUP, mixed_queues(), clients(3))
    b = allocate_all(AllocateMessageQueueConsistentHash(7), GROUP, mixed_queues(), clients(3))
    assert a == b


def test_consistent_hash_refuses_zero_virtual_nodes() -> None:
    with pytest.raises(ConfigError, match="at least 1 virtual node"):
        AllocateMessageQueueConsistentHash(0)


# -- strategy_from_settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("averagely", AllocateMessageQueueAveragely),
        ("averagely_by_circle", AllocateMessageQueueAveragelyByCircle),
        ("AVERAGELY-BY-CIRCLE", AllocateMessageQueueAveragelyByCircle),
        ("by_config", AllocateMessageQueueByConfig),
        ("by_machine_room", AllocateMessageQueueByMachineRoom),
        ("consistent_hash", AllocateMessageQueueConsistentHash),
    ],
)
def test_strategy_from_settings_picks_strategy_by_name(name: str, cls: type) -> None:
    strategy = strategy_from_settings(load_settings(allocate_strategy=name))
    assert type(strategy) is cls
    assert strategy.name == name.lower().replace("-", "_")


def test_strategy_from_settings_passes_strategy_options() -> None:
    by_config = strategy_from_settings(
        load_settings(allocate_strategy="by_config", allocate_config={"cid-a": ["T:broker-a:1"]})
    )
    assert qids(by_config.allocate(GROUP, "cid-a", queues(3), ["cid-a"])) == [1]
    by_room = strategy_from_settings(
        load_settings(allocate_strategy="by_machine_room", allocate_machine_rooms=["room2"])
    )
    assert {mq.broker_name for mq in by_room.allocate(GROUP, "cid-00", room_queues(), clients(1))} == {"room2@broker-b"}
    ch = strategy_from_settings(load_settings(allocate_strategy="consistent_hash", consistent_hash_virtual_nodes=3))
    assert ch.virtual_nodes == 3


def test_unknown_strategy_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown strategy"):
        load_settings(allocate_strategy="random")

    class Fake:
        allocate_strategy = "random"

    with pytest.raises(ConfigError, match="unknown allocation strategy 'random'"):
        strategy_from_settings(Fake())

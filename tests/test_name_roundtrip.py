"""Every name the rules allow round-trips through every stored format, and every allocation
strategy works with such names.

The names are drawn from the whole charset and, above all, from its corners: the characters the
stored formats join or split on (``:``, ``|``, ``%``, ``@``, ``#``, ``%BC%``, commas, quotes...).
Formats stored in Redis (a client's registration, the stats hash, the assignment hash and the lock
table written by a rebalance) are checked against the real redis-server of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mqorder import keys
from mqorder.consumer.stats import COUNTERS, ConsumerStatsManager, parse_stats_field, stats_field
from mqorder.errors import InvalidNameError
from mqorder.model import MessageModel, MessageQueue
from mqorder.names import check_broker, check_client_id, check_group, check_topic, machine_room
from mqorder.rebalance.allocate import (
    AllocateMessageQueueAveragely,
    AllocateMessageQueueAveragelyByCircle,
    AllocateMessageQueueByConfig,
    AllocateMessageQueueByMachineRoom,
    AllocateMessageQueueConsistentHash,
    allocate_all,
)
from mqorder.rebalance.membership import (
    ClientRegistry,
    Subscription,
    decode_subscriptions,
    encode_subscriptions,
)
from mqorder.rebalance.service import RebalanceService
from mqorder.settings import load_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager

# -- names the rules allow -------------------------------------------------------------------------


def _valid(check: Callable[[str], str]) -> Callable[[str], bool]:
    def ok(value: str) -> bool:
        try:
            check(value)
        except InvalidNameError:
            return False
        return True

    return ok


#: RocketMQ's charset, weighted towards the characters stored formats could trip on.
_NAME_CHARS = "%|_.-BCDLQa0"


def _names(check: Callable[[str], str], extra: str = "") -> st.SearchStrategy[str]:
    alphabet = _NAME_CHARS + extra
    return st.one_of(
        st.from_regex(keys.NAME_RE, fullmatch=True),
        st.text(alphabet=alphabet, min_size=1, max_size=12),
        st.text(alphabet=alphabet, min_size=120, max_size=127),
        # Right at the rules' edges: each is valid for some kinds of name and must round-trip
        # there, or invalid and filtered out (so a rule that wrongly lets one pass shows up).
        st.sampled_from(["|", "%", "a|b|CLUSTERING", "g%B", "g%BC", "%BC", "x%DLQ%", "%DLQ%", "room@b", "@", "a@b@c"]),
    ).filter(_valid(check))


groups = _names(check_group)
topics = _names(check_topic)
brokers = _names(check_broker, extra="@@")
#: Celery node names hold anything but whitespace, control characters and braces.
client_ids = st.one_of(
    st.text(alphabet=_NAME_CHARS + '@:#,~"\\\'/é', min_size=1, max_size=40),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters="{}"),
            min_size=1, max_size=255),
    st.from_regex(r"[a-z0-9_-]{1,20}@[a-z0-9.-]{1,40}", fullmatch=True),
    st.sampled_from(["w1@host", "a,b", "c%BC%d", "g:b:1", "~", "~x", "#ok", "x@room1@b", "BC%x"]),
).filter(_valid(check_client_id))
queue_ids = st.integers(min_value=0, max_value=10**6)
message_queues = st.builds(MessageQueue, topics, brokers, queue_ids)
models = st.sampled_from(list(MessageModel))
subscriptions = st.builds(Subscription, groups, topics, models)


def cluster_hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: between the first ``{`` and the next ``}``."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]


# -- formats that live in Python strings --------------------------------------------------------------


@given(mq=message_queues, sub=st.one_of(groups, st.builds(keys.broadcast_sub, groups, client_ids)))
def test_a_queue_key_reads_back_as_its_queue_and_is_the_hash_tag_of_every_queue_key(
    mq: MessageQueue, sub: str
) -> None:
    assert MessageQueue.from_key(mq.key) == mq
    assert keys.parse_queue_key(mq.key) == (mq.topic, mq.broker_name, mq.queue_id)
    assert mq.tag == "{" + mq.key + "}"
    for key in (keys.queue_log(mq.tag), keys.queue_next(mq.tag), keys.queue_ids(mq.tag),
                keys.sub_state(mq.tag, sub), keys.sub_retries(mq.tag, sub)):
        assert cluster_hash_tag(key) == mq.key  # one slot per queue, whatever the names


@given(a=message_queues, b=message_queues)
def test_two_queues_never_share_a_key(a: MessageQueue, b: MessageQueue) -> None:
    assert (a.key == b.key) == (a == b)


@pytest.mark.parametrize(
    "key", ["", "t:b", "t:b:1:2", ":b:1", "t::1", "t:b:", "t:b:01", "t:b:-1", "t:b:+1", "t:b:1_0", "t:b:١", "t:b: 1"]
)
def test_a_string_that_is_not_a_queue_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="not a queue key"):
        MessageQueue.from_key(key)


@given(group=groups, client_id=client_ids)
def test_a_broadcast_subscription_id_reads_back_as_its_group(group: str, client_id: str) -> None:
    sub = keys.broadcast_sub(group, client_id)
    assert keys.group_of_sub(sub) == group
    assert sub == group + keys.BROADCAST_SEP + client_id
    # A clustering lane's id is the group itself, told apart by having no separator.
    assert keys.group_of_sub(group) == group
    assert keys.BROADCAST_SEP not in group and keys.BROADCAST_SEP in sub


@given(group=groups)
def test_the_dead_letter_topic_of_every_group_is_a_topic(group: str) -> None:
    assert check_topic(keys.dlq_topic(group), allow_dlq=True) == keys.dlq_topic(group)


@given(subs=st.lists(subscriptions, max_size=6), seed=st.integers())
def test_subscriptions_round_trip_through_their_json_and_encode_canonically(
    subs: list[Subscription], seed: int
) -> None:
    raw = encode_subscriptions(subs)
    assert set(decode_subscriptions(raw)) == set(subs)
    assert len(decode_subscriptions(raw)) == len(set(subs))
    shuffled = subs[:]
    random.Random(seed).shuffle(shuffled)
    assert encode_subscriptions(shuffled) == raw


@pytest.mark.parametrize(
    "raw", ['["g|t|CLUSTERING"]', "{}", '[{"group": "g", "topic": "t"}]', '[{"group": "g", "topic": 1, "model": "X"}]',
            '[{"group": "g", "topic": "t", "model": "FANOUT"}]', "not json"],
)
def test_what_is_not_a_subscription_list_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        decode_subscriptions(raw)


@given(mq=message_queues, counter=st.sampled_from(COUNTERS))
def test_a_stats_field_reads_back_as_its_queue_and_counter(mq: MessageQueue, counter: str) -> None:
    assert parse_stats_field(stats_field(mq.key, counter)) == (mq.key, counter)


def test_the_machine_room_is_what_comes_before_the_first_at_sign() -> None:
    assert machine_room("room1@broker-a") == "room1"
    assert machine_room("room1@b@c") == "room1"
    assert machine_room("broker-a") == "broker-a"


# -- formats stored in Redis -------------------------------------------------------------------------

REDIS_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@REDIS_SETTINGS
@given(client_id=client_ids, subs=st.lists(subscriptions, min_size=1, max_size=4))
def test_a_registration_reads_back_from_redis(r: redis.Redis, client_id: str, subs: list[Subscription]) -> None:
    registry = ClientRegistry(r, heartbeat_timeout_ms=60_000)
    registry.register(client_id, subs)
    try:
        infos, dead, _ = registry.clients()
        assert [i.client_id for i in infos] == [client_id] and dead == []
        assert set(infos[0].subscriptions) == set(subs)
        assert json.loads(registry.membership_fingerprint()) == [client_id]
    finally:
        registry.unregister(client_id)


def test_the_membership_fingerprint_tells_apart_ids_holding_commas(r: redis.Redis) -> None:
    registry = ClientRegistry(r, heartbeat_timeout_ms=60_000)
    fingerprints = []
    for members in (["a,b", "c"], ["a", "b,c"]):
        for cid in members:
            registry.register(cid, [])
        fingerprints.append(registry.membership_fingerprint())
        for cid in members:
            registry.unregister(cid)
    assert fingerprints[0] != fingerprints[1]


def test_a_message_queue_pickles_as_its_three_fields_and_spells_itself_after() -> None:
    """``MessageQueue`` keeps its key and tag in slots (issue 27's idle cost), yet pickles, copies
    and shows itself as its three fields only: a pickle does not depend on what it caches."""
    import copy
    import dataclasses
    import pickle

    mq = MessageQueue("orders", "broker-a", 7)
    assert pickle.loads(pickle.dumps(mq)) == mq and pickle.loads(pickle.dumps(mq)).tag == "{orders:broker-a:7}"
    assert b"_tag" not in pickle.dumps(mq) and b"_key" not in pickle.dumps(mq)
    assert copy.deepcopy(mq).key == "orders:broker-a:7" == dataclasses.replace(mq, queue_id=8).key[:-1] + "7"
    assert dataclasses.asdict(mq) == {"topic": "orders", "broker_name": "broker-a", "queue_id": 7}
    assert [f.name for f in dataclasses.fields(mq)] == ["topic", "broker_name", "queue_id"]
    assert sorted([MessageQueue("t", "b", 2), MessageQueue("t", "b", 10)])[1].queue_id == 10
    assert len({MessageQueue("t", "b", 1), MessageQueue("t", "b", 1)}) == 1


def test_a_heartbeat_and_watch_heartbeats_and_reads_what_the_separate_reads_would(r: redis.Redis) -> None:
    """The idle worker's one-pipeline heartbeat (issue 27) pushes the deadline forward as
    ``heartbeat`` does, and gives the fingerprint and the watched keys' values that their own reads
    give (a lapsed client is not live; an unset key is ``None``)."""
    registry = ClientRegistry(r, heartbeat_timeout_ms=60_000)
    registry.register("c,1", [])
    r.zadd(keys.clients(), {"lapsed": 1})
    r.set("mqorder-test:watched", "v1")
    try:
        before = r.zscore(keys.clients(), "c,1")
        time.sleep(0.01)
        beat = registry.heartbeat_and_watch("c,1", ("mqorder-test:watched", "mqorder-test:unset"))
        assert r.zscore(keys.clients(), "c,1") == beat.now_ms + 60_000 > before
        assert beat.fingerprint == registry.membership_fingerprint() == json.dumps(["c,1"])
        assert beat.watched == [b"v1", None]
    finally:
        registry.unregister("c,1")
        r.delete("mqorder-test:watched")
        r.zrem(keys.clients(), "lapsed")


def test_a_registration_written_by_an_older_version_gives_no_queues_and_stops_nothing(r: redis.Redis) -> None:
    registry = ClientRegistry(r, heartbeat_timeout_ms=60_000)
    registry.register("new@host", [Subscription("g", "t", MessageModel.CLUSTERING)])
    registry.register("old@host", [])
    r.hset(keys.client_info("old@host"), "subs", '["g|t|CLUSTERING"]')  # the pre-JSON format
    infos = {i.client_id: i.subscriptions for i in registry.clients()[0]}
    assert infos == {"new@host": (Subscription("g", "t", MessageModel.CLUSTERING),), "old@host": ()}


@REDIS_SETTINGS
@given(
    sub=st.one_of(groups, st.builds(keys.broadcast_sub, groups, client_ids)),
    counts=st.dictionaries(
        message_queues,
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 1000)),
        min_size=1, max_size=5,
    ),
)
def test_stats_flushed_to_redis_read_back_per_queue(
    r: redis.Redis, sub: str, counts: dict[MessageQueue, tuple[int, int, int, int]]
) -> None:
    stats = ConsumerStatsManager()
    expected: dict[str, dict[str, float]] = {}
    for mq, (ok, failed, rt_eighths, calls) in counts.items():
        stats.inc_consume_ok(sub, mq.key, ok)
        stats.inc_consume_failed(sub, mq.key, failed)
        if calls:
            stats.inc_consume_rt_total(sub, mq.key, rt_eighths / 8, calls)
        # Only what happened is written: a counter that stayed 0 has no field.
        want = {"ok": ok, "failed": failed} | ({"rt_ms": rt_eighths / 8, "rt_n": calls} if calls else {})
        want = {k: float(v) for k, v in want.items() if v or k == "rt_ms"}
        if want:
            expected[mq.key] = want
    r.delete(keys.stats(sub))
    stats.flush(r)
    assert ConsumerStatsManager.read(r, sub) == expected


def test_stats_fields_of_the_pre_separator_format_are_skipped(r: redis.Redis) -> None:
    r.hset(keys.stats("g"), mapping={"t:b:0|ok": 5, "t:b:0#ok": 7, "t:b:0#nonsense": 1})
    assert ConsumerStatsManager.read(r, "g") == {"t:b:0": {"ok": 7.0}}


# -- allocation with every name the rules allow ---------------------------------------------------

ROOMS = ["room1", "r|%.-_2"]


def _strategies(mqs: list[MessageQueue], cids: list[str]) -> dict[str, tuple[object, set[MessageQueue]]]:
    """Each strategy with the queues it must hand out: all of them, or those it is told to."""
    config: dict[str, list[str]] = {cid: [] for cid in cids}
    for i, mq in enumerate(mqs):
        if i % 3:  # every third queue is configured for nobody
            config[cids[i % len(cids)]].append(mq.key)
    return {
        "averagely": (AllocateMessageQueueAveragely(), set(mqs)),
        "averagely_by_circle": (AllocateMessageQueueAveragelyByCircle(), set(mqs)),
        "by_config": (AllocateMessageQueueByConfig(config), {MessageQueue.from_key(k) for ks in config.values() for k in ks}),
        "by_machine_room": (AllocateMessageQueueByMachineRoom(ROOMS), {mq for mq in mqs if machine_room(mq.broker_name) in ROOMS}),
        "consistent_hash": (AllocateMessageQueueConsistentHash(), set(mqs)),
    }


room_brokers = st.one_of(
    brokers, st.builds(lambda room, name: f"{room}@{name}", st.sampled_from([*ROOMS, "room3"]), brokers)
).filter(_valid(check_broker))


@settings(max_examples=150, deadline=None)
@given(
    mqs=st.lists(st.builds(MessageQueue, topics, room_brokers, st.integers(0, 40)), min_size=1, max_size=40, unique=True),
    cids=st.lists(client_ids, min_size=1, max_size=6, unique=True),
    seed=st.integers(),
)
def test_every_strategy_assigns_each_queue_it_hands_out_to_exactly_one_client(
    mqs: list[MessageQueue], cids: list[str], seed: int
) -> None:
    shuffled_mqs, shuffled_cids = mqs[:], cids[:]
    random.Random(seed).shuffle(shuffled_mqs)
    random.Random(seed).shuffle(shuffled_cids)
    for name, (strategy, handed_out) in _strategies(sorted(mqs), sorted(cids)).items():
        assignment = allocate_all(strategy, "g", mqs, cids)
        assert set(assignment) == handed_out, name
        assert set(assignment.values()) <= set(cids), name
        per_client = Counter(mq for cid in sorted(cids) for mq in strategy.allocate("g", cid, sorted(mqs), sorted(cids)))
        assert set(per_client) == handed_out and set(per_client.values()) <= {1}, name
        assert allocate_all(strategy, "g", shuffled_mqs, shuffled_cids) == assignment, f"{name} is not deterministic"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    topic=topics,
    group=groups,
    broadcast_group=groups,
    broker_names=st.lists(room_brokers, min_size=1, max_size=3, unique=True),
    cids=st.lists(client_ids, min_size=1, max_size=4, unique=True),
    strategy=st.sampled_from(["averagely", "averagely_by_circle", "by_machine_room", "consistent_hash"]),
)
def test_a_rebalance_stores_and_reads_back_assignments_and_locks_for_any_valid_names(
    r: redis.Redis, redis_url: str, topic: str, group: str, broadcast_group: str, broker_names: list[str],
    cids: list[str], strategy: str,
) -> None:
    """The assignment hash (queue key -> client), the lock table and broadcast lanes, end to end."""
    assume(group != broadcast_group)
    r.flushdb()
    s = load_settings(redis_url=redis_url, allocate_strategy=strategy, allocate_machine_rooms=ROOMS)
    registry = BrokerRegistry(redis_url, {b: redis_url for b in broker_names})
    try:
        TopicManager(registry).create_topic(topic, 3, brokers=broker_names)
        svc = RebalanceService(registry, s)
        for cid in cids:
            subs = [Subscription(group, topic, MessageModel.CLUSTERING),
                    Subscription(broadcast_group, topic, MessageModel.BROADCASTING)]
            for sub in subs:
                svc.topics.subscribe(sub.group, sub.topic, sub.model)
            svc.registry.register(cid, subs)
        svc.rebalance()
        mqs = svc.topics.describe_topic(topic).message_queues
        expected = allocate_all(svc.strategy, group, mqs, cids)
        assert {mq: c for c in cids for mq in svc.assigned_queues(group, c)} == expected
        assert svc.assigned_queues(group) == sorted(expected)
        for mq, cid in expected.items():
            entry = svc.locks.lock_entry(group, mq)
            assert (entry.owner, entry.assignee) == (cid, cid)
        for cid in cids:  # a broadcasting client owns every queue of its private lane
            lane = keys.broadcast_sub(broadcast_group, cid)
            assert svc.assigned_queues(lane, cid) == sorted(mqs)
            assert {svc.locks.lock_entry(lane, mq).owner for mq in mqs} == {cid}
    finally:
        registry.close()


def test_by_machine_room_runs_with_real_brokers_named_after_their_rooms(r: redis.Redis, redis_url: str) -> None:
    """Brokers named ``room@name`` are accepted, and only the consuming rooms' queues are handed out."""
    names = ["room1@broker-a", "r|%.-_2@broker-b", "room3@broker-c"]
    s = load_settings(redis_url=redis_url, allocate_strategy="by_machine_room", allocate_machine_rooms=ROOMS)
    registry = BrokerRegistry(redis_url, {b: redis_url for b in names})
    try:
        TopicManager(registry).create_topic("orders", 4, brokers=names)
        svc = RebalanceService(registry, s)
        svc.topics.subscribe("g", "orders", MessageModel.CLUSTERING)
        for cid in ("w1@host", "w2@host", "w3@host"):
            svc.registry.register(cid, [Subscription("g", "orders", MessageModel.CLUSTERING)])
        svc.rebalance()
        assigned = svc.assigned_queues("g")
        assert {mq.broker_name for mq in assigned} == {"room1@broker-a", "r|%.-_2@broker-b"}
        assert len(assigned) == 8
        per_client = Counter(svc.locks.lock_entry("g", mq).owner for mq in assigned)
        assert sorted(per_client.values()) == [2, 3, 3]
    finally:
        registry.close()

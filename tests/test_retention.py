"""Retention against a real redis-server: what each policy trims, what it must never trim, and how a
consumer that falls below the first stored offset moves on (fenced, in order, counted)."""

from __future__ import annotations

import time

import pytest

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.admin.common import Admin
from mqorder.admin.status import group_status
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.key_request import KeyConsumeRequest
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.offset_map import encode_done
from mqorder.consumer.run_types import Stop
from mqorder.consumer.stats import ConsumerStatsManager
from mqorder.errors import ConfigError
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.retention.policy import RetentionPolicy, TopicRetention
from mqorder.retention.trimmer import RetentionTrimmer
from mqorder.settings import load_settings
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager
from tests.test_engine import drain as run_queue

S = ConsumeOrderlyStatus
MQ = MessageQueue("t", "broker-a", 0)


def offsets_stored(r, mq: MessageQueue = MQ) -> list[int]:
    return [int(e[0].split(b"-")[0]) for e in r.xrange(keys.queue_log(mq.tag))]


def send(p: Producer, n: int, topic: str = "t", start: int = 0) -> None:
    p.send_orderly_batch(topic, [("k", str(start + i).encode()) for i in range(n)])


# -- time policy ----------------------------------------------------------------------------------


def test_time_policy_trims_exactly_what_is_older_than_retention_and_offsets_keep_their_meaning(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 1000})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    send(p, 30)
    time.sleep(1.1)
    send(p, 5, start=30)
    report = RetentionTrimmer(p.brokers, s).run()
    assert report.trimmed == 30
    assert offsets_stored(r) == list(range(30, 35))
    # The message at offset 31 is still the 32nd one sent, and the next send gets offset 35.
    assert r.xrange(keys.queue_log(MQ.tag), "31-1", "31-1")[0][1][b"b"] == b"31"
    assert p.send_orderly("t", b"35", sharding_key="k").queue_offset == 35
    assert RetentionTrimmer(p.brokers, s).run().trimmed == 0  # nothing more is due
    p.close()


def test_each_script_call_trims_at_most_one_chunk_and_the_pass_finishes_the_job(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 1000, "retention_trim_chunk": 7})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    send(p, 50)
    time.sleep(1.1)
    report = RetentionTrimmer(p.brokers, s).run()
    assert report.trimmed == 50
    assert report.calls >= 50 // 7  # bounded chunks, not one call removing all
    assert offsets_stored(r) == []
    p.close()


def test_max_messages_caps_each_queue_under_the_time_policy(settings, r) -> None:
    p = Producer(settings=settings)
    p.create_topic("t", queues=1, retention_max_messages=10)
    send(p, 25)
    RetentionTrimmer(p.brokers, settings).run()
    assert offsets_stored(r) == list(range(15, 25))
    p.close()


# -- consumed policy --------------------------------------------------------------------------------


def commit_offset(p: Producer, sub: str, offset: int) -> None:
    p.brokers.meta.hset(keys.sub_state(MQ.tag, sub), "offset", offset)


def test_consumed_policy_never_trims_what_a_lagging_group_has_not_consumed(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 1000, "retention_min_ms": 0})
    p = Producer(settings=s)
    p.create_topic("t", queues=1, retention_policy="consumed")
    p.topics.subscribe("fast", "t", MessageModel.CLUSTERING)
    p.topics.subscribe("slow", "t", MessageModel.CLUSTERING)
    send(p, 40)
    commit_offset(p, "fast", 40)
    commit_offset(p, "slow", 12)
    time.sleep(1.1)  # every message is older than retention_ms: the time policy would take them all
    trimmer = RetentionTrimmer(p.brokers, s)
    report = trimmer.run()
    assert report.holders["t"] == ["fast", "slow"]
    assert offsets_stored(r) == list(range(12, 40))  # only below the lowest committed offset
    commit_offset(p, "slow", 30)
    trimmer.run()
    assert offsets_stored(r) == list(range(30, 40))
    p.close()


def test_consumed_policy_keeps_retention_min_ms_for_replay(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 60_000, "retention_min_ms": 1000})
    p = Producer(settings=s)
    p.create_topic("t", queues=1, retention_policy="consumed")
    p.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    send(p, 10)
    commit_offset(p, "g", 10)
    trimmer = RetentionTrimmer(p.brokers, s)
    assert trimmer.run().trimmed == 0  # consumed, but younger than retention_min_ms
    time.sleep(1.1)
    send(p, 5, start=10)
    assert trimmer.run().trimmed == 10
    assert offsets_stored(r) == list(range(10, 15))
    p.close()


def test_a_group_gone_for_longer_than_retention_stops_holding_data_back(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 1000, "retention_min_ms": 0})
    p = Producer(settings=s)
    p.create_topic("t", queues=1, retention_policy="consumed")
    p.topics.subscribe("gone", "t", MessageModel.CLUSTERING)
    send(p, 20)
    time.sleep(1.1)
    trimmer = RetentionTrimmer(p.brokers, s)
    # Never seen by a trimmer before: it holds for a whole retention from now.
    assert trimmer.run().trimmed == 0
    assert trimmer.run().holders["t"] == ["gone"]
    # Last seen live long ago: it no longer holds anything back.
    r.hset(keys.retention_seen(), "gone", int(time.time() * 1000) - 5000)
    report = trimmer.run()
    assert report.holders["t"] == []
    assert report.trimmed == 20
    p.close()


# -- consumers behind the first stored offset -------------------------------------------------------


def assert_skipped_15_and_consumed_to_25(eng, r, settings) -> None:
    """Queue ``t``/0 held offsets 0..24, the group had consumed 0..4 and 5..19 were trimmed: the
    run committed 25 and counted the 15 skipped in its state, its stats and ``mqorder status``."""
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 25
    assert int(r.hget(keys.sub_state(MQ.tag, "g"), "skipped")) == 15
    eng.stats.flush(eng.brokers.meta)
    assert ConsumerStatsManager.read(eng.brokers.meta, "g")[MQ.key]["skipped"] == 15
    with Admin.open(settings) as admin:
        (q,) = group_status(admin, "g").queues
    assert (q.skipped, q.first_offset, q.committed, q.lag) == (15, 20, 25, 0)


def test_a_group_below_the_first_stored_offset_moves_forward_fenced_and_counts_the_skip(env, settings, r) -> None:
    p, eng = env
    p.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    send(p, 25)
    commit_offset(p, "g", 5)  # the group consumed 0..4, then fell behind
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="20", approximate=False)  # what the time policy does
    seen: list[int] = []

    def listener(msgs, ctx):
        seen.extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    outs = run_queue(eng, ListenerSpec(listener, "t", "g"))
    assert seen == list(range(20, 25))  # in order, from the first stored offset
    assert outs[-1].verb == "IDLE"
    assert_skipped_15_and_consumed_to_25(eng, r, settings)


def test_a_queue_trimmed_to_its_end_is_skipped_to_its_next_offset_without_a_listener_call(env, r) -> None:
    p, eng = env
    send(p, 12)
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="12", approximate=False)  # everything went
    calls: list[int] = []

    def listener(msgs, ctx):
        calls.extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    outs = run_queue(eng, ListenerSpec(listener, "t", "g"))
    assert calls == []
    assert outs[-1].verb == "IDLE"  # no redispatch loop over a backlog that no longer exists
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 12
    assert int(r.hget(keys.sub_state(MQ.tag, "g"), "skipped")) == 12
    send(p, 1, start=12)
    r.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok1")  # the wake-up the send would give the owner
    ConsumeRequest(eng, ListenerSpec(listener, "t", "g"), "g", MQ, "tok1").run()
    assert calls == [12]


def test_a_stale_holder_cannot_commit_a_skip(env, r) -> None:
    """The skip rides on the fenced commit: a run whose epoch was replaced moves nothing."""
    p, eng = env
    send(p, 10)
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="6", approximate=False)
    spec = ListenerSpec(lambda msgs, ctx: S.SUCCESS, "t", "g")
    locks = RebalanceLockManager(eng.brokers)
    locks.assign("g", [(MQ, "c1", "tok0")])
    req = ConsumeRequest(eng, spec, "g", MQ, "tok0")
    assert req._check() is None
    r.hincrby(keys.sub_state(MQ.tag, "g"), "epoch", 1)  # a new owner took over meanwhile
    req._consume_loop()
    assert r.hget(keys.sub_state(MQ.tag, "g"), "skipped") is None
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 0


# -- odds and ends ----------------------------------------------------------------------------------


def test_ids_of_trimmed_idempotent_appends_are_dropped_with_them(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 1000})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    from mqorder.codec import encode_header

    entries = [(encode_header(f"id-{i}"), b"x") for i in range(8)]
    p.appender.append(MQ, entries, ids=[f"id-{i}" for i in range(8)])
    assert r.hlen(keys.queue_ids(MQ.tag)) == 8
    time.sleep(1.1)
    later = [(encode_header(f"id-{i}"), b"y") for i in range(8, 10)]
    p.appender.append(MQ, later, ids=["id-8", "id-9"])
    RetentionTrimmer(p.brokers, s).run()
    assert sorted(r.hkeys(keys.queue_ids(MQ.tag))) == [b"id-8", b"id-9"]
    p.close()


def test_retention_settings_and_topic_options_refuse_bad_values_clearly(settings) -> None:
    p = Producer(settings=settings)
    with pytest.raises(ConfigError, match="retention policy must be 'time'.*or 'consumed'"):
        p.create_topic("t", queues=1, retention_policy="forever")
    with pytest.raises(ConfigError, match="retention_ms must be a whole number of milliseconds"):
        p.create_topic("t", queues=1, retention_ms=-5)
    with pytest.raises(ConfigError, match="retention_min_ms .* must not exceed retention_ms"):
        p.create_topic("t", queues=1, retention_ms=5000, retention_min_ms=10_000)
    with pytest.raises(ConfigError, match="retention_max_messages must be a whole number"):
        p.create_topic("t", queues=1, retention_max_messages="lots")  # type: ignore[arg-type]
    assert p.topics.list_topics() == []  # nothing was created by a refused call
    with pytest.raises(ConfigError, match="MQORDER_RETENTION_POLICY"):
        load_settings(redis_url=settings.redis_url, retention_policy="sometimes")
    with pytest.raises(ConfigError, match="MQORDER_MAX_MEMORY_RATIO"):
        load_settings(redis_url=settings.redis_url, max_memory_ratio=1.5)
    p.close()


def test_update_retention_keeps_what_it_does_not_name(settings) -> None:
    p = Producer(settings=settings)
    p.create_topic("t", queues=1, retention_policy="consumed", retention_ms=5000)
    route = p.topics.update_retention("t", TopicRetention.of(retention_max_messages=100))
    assert route.retention == TopicRetention(RetentionPolicy.CONSUMED, 5000, None, 100)
    rule = route.retention.resolve(settings.retention_defaults)
    assert (rule.policy, rule.retention_ms, rule.retention_min_ms, rule.retention_max_messages) == (
        RetentionPolicy.CONSUMED, 5000, 5000, 100)  # the default replay window is cut to the retention
    p.close()


def test_only_one_worker_runs_a_pass_per_interval(settings, r) -> None:
    p = Producer(settings=settings)
    trimmer = RetentionTrimmer(p.brokers, settings)
    assert not trimmer.run_if_due("w1").skipped
    assert trimmer.run_if_due("w2").skipped
    p.close()


# -- with real workers ------------------------------------------------------------------------------


@pytest.mark.e2e
def test_trimming_behind_real_workers_under_load_loses_nothing_and_keeps_order(cluster, r) -> None:
    """Consumed policy, no replay window, a trim pass every 0.5 s in 20-entry chunks, while a
    producer sends and two prefork workers consume (one leaves and comes back mid-stream)."""
    import threading

    from tests.support import body, check_order, ledger, wait_for

    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4, retention_policy="consumed", retention_ms=60_000, retention_min_ms=0)
    fast_trim = {"MQORDER_RETENTION_INTERVAL_MS": "500", "MQORDER_RETENTION_TRIM_CHUNK": "20"}
    cluster.start_worker("w1", **fast_trim)
    cluster.start_worker("w2", **fast_trim)
    r.hset("ctl:g-order", "sleep_ms", 1)
    keys_ = [f"k{i}" for i in range(200)]
    total = 0

    def produce() -> None:
        nonlocal total
        for seq in range(1, 11):
            p.send_orderly_batch("t-order", [(k, body(k, seq)) for k in keys_])
            total += len(keys_)
            time.sleep(0.4)

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(1.5)
    cluster.workers["w2"].stop(timeout=30)  # a graceful leave mid-stream: its queues move to w1
    cluster.start_worker("w2b", **fast_trim)
    t.join()
    wait_for(lambda: len({(e["key"], e["seq"]) for e in ledger(r, "g-order") if e["ok"]}) >= 2000,
             timeout=120, what="2000 messages handled")
    violations, handled, _ = check_order(ledger(r, "g-order"))
    assert violations == []
    assert handled == 2000
    from mqorder.retention.trimmer import first_offsets

    mqs = p.describe_topic("t-order").message_queues
    # Trimming really ran behind the consumers (a pass every 0.5 s takes what all of them consumed).
    wait_for(lambda: sum(first_offsets(p.brokers, mqs).values()) >= 1000, timeout=10, what="consumed messages trimmed")
    p.close()


def test_many_trimmers_at_once_trim_exactly_once_and_never_what_is_held(settings, r) -> None:
    """Four trimmers in parallel (the mutex bypassed, as `mqorder retention run` does) over a
    consumed-policy topic while a producer appends: each script call decides from what it reads in
    the same atomic step, so together they trim exactly what one would."""
    import threading

    s = settings.model_copy(update={"retention_ms": 60_000, "retention_min_ms": 0, "retention_trim_chunk": 13})
    p = Producer(settings=s)
    p.create_topic("t", queues=1, retention_policy="consumed")
    p.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    send(p, 400)
    commit_offset(p, "g", 250)
    errors: list[BaseException] = []
    totals: list[int] = []

    def trim() -> None:
        try:
            t = RetentionTrimmer(p.brokers, s)
            totals.append(sum(t.run().trimmed for _ in range(3)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=trim) for _ in range(4)]
    for t in threads:
        t.start()
    send(p, 100, start=400)
    for t in threads:
        t.join(30)
    assert errors == []
    assert sum(totals) == 250  # each message trimmed by exactly one of them
    assert offsets_stored(r) == list(range(250, 500))
    p.close()


def test_a_key_ordered_queue_trimmed_to_its_end_moves_on_too(env, r) -> None:
    p, eng = env
    send(p, 9)
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="9", approximate=False)
    calls: list[int] = []

    def listener(msgs, ctx):
        calls.extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    out = KeyConsumeRequest(eng, ListenerSpec(listener, "t", "g", ordering="key"), "g", MQ, "tok0").run()
    assert calls == [] and out.verb == "IDLE"  # not a redispatch over a backlog that is gone
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 9
    assert int(r.hget(keys.sub_state(MQ.tag, "g"), "skipped")) == 9  # counted as in queue mode
    eng.stats.flush(eng.brokers.meta)
    assert ConsumerStatsManager.read(eng.brokers.meta, "g")[MQ.key]["skipped"] == 9


def send_keys(p: Producer, n: int, n_keys: int = 3) -> None:
    """``n`` messages over ``n_keys`` sharding keys, body = the message's number."""
    p.send_orderly_batch("t", [(f"k{i % n_keys}", str(i).encode()) for i in range(n)])


def test_a_key_ordered_group_below_the_first_stored_offset_counts_the_skip_in_state_stats_and_status(
    env, settings, r
) -> None:
    """Key mode counts trimmed messages exactly as queue mode does: in the fenced commit that moves
    past them (``skipped`` in the state), in the stats, and in `mqorder status`."""
    p, eng = env
    p.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    send_keys(p, 25)
    commit_offset(p, "g", 5)  # the group consumed 0..4, then fell behind
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="20", approximate=False)  # what the time policy does
    seen: dict[str, list[int]] = {}

    def listener(msgs, ctx):
        for m in msgs:
            seen.setdefault(m.keys[0], []).append(m.queue_offset)
        return S.SUCCESS

    outs = run_queue(eng, ListenerSpec(listener, "t", "g", ordering="key"))
    assert sorted(o for offs in seen.values() for o in offs) == list(range(20, 25))
    assert all(offs == sorted(offs) for offs in seen.values())  # each key in order
    assert outs[-1].verb == "IDLE"
    assert_skipped_15_and_consumed_to_25(eng, r, settings)


def test_a_key_ordered_run_counts_a_gap_trimmed_under_it_once_its_commit_moves_past_it(env, r) -> None:
    """Retention trims ahead of a running key-ordered run (``time`` policy): the next pull finds a
    gap. It is counted when the committed offset (the lowest unfinished one) passes it, not
    before, and offsets a previous owner finished (its offset map) were consumed, not skipped."""
    p, eng = env
    send_keys(p, 30)
    st_key = keys.sub_state(MQ.tag, "g")
    # A previous owner committed 0 with offsets 9 and 10 finished above it (key_commit's map).
    r.hset(st_key, mapping={"offset": 0, "done": encode_done(0, [9, 10])})
    seen: list[int] = []
    skipped_at_call: dict[int, bytes | None] = {}

    def listener(msgs, ctx):
        for m in msgs:
            seen.append(m.queue_offset)
            skipped_at_call[m.queue_offset] = r.hget(st_key, "skipped")
            if m.queue_offset == 0:
                r.xtrim(keys.queue_log(MQ.tag), minid="12", approximate=False)  # 4..11 go unread
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", ordering="key", pull_batch_size=4, key_concurrency=1)
    outs = run_queue(eng, spec)
    assert seen == [0, 1, 2, 3, *range(12, 30)]
    assert outs[-1].verb == "IDLE"
    assert skipped_at_call[3] is None  # offset 3 unfinished: nothing past the gap committed yet
    # 8 offsets trimmed, 2 of them finished by the previous owner: 6 the group never consumed.
    assert int(r.hget(st_key, "skipped")) == 6
    eng.stats.flush(eng.brokers.meta)
    assert ConsumerStatsManager.read(eng.brokers.meta, "g")[MQ.key]["skipped"] == 6
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 30


def test_a_stale_key_ordered_holder_commits_no_skip(env, r) -> None:
    """The skip rides on the fenced key_commit.lua: a run whose epoch was replaced counts nothing,
    neither in the state nor in the stats."""
    p, eng = env
    send_keys(p, 10)
    p.brokers.meta.xtrim(keys.queue_log(MQ.tag), minid="6", approximate=False)
    spec = ListenerSpec(lambda msgs, ctx: S.SUCCESS, "t", "g", ordering="key")
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    req = KeyConsumeRequest(eng, spec, "g", MQ, "tok0")
    assert req._check() is None
    r.hincrby(keys.sub_state(MQ.tag, "g"), "epoch", 1)  # a new owner took over meanwhile
    assert req._consume_loop().stop is Stop.FENCED
    assert r.hget(keys.sub_state(MQ.tag, "g"), "skipped") is None
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 0
    eng.stats.flush(eng.brokers.meta)
    assert "skipped" not in ConsumerStatsManager.read(eng.brokers.meta, "g").get(MQ.key, {})


# -- idle queues: the quiet skip (issue 27) -------------------------------------------------------


def test_a_trimmer_skips_queues_that_cannot_have_anything_due_and_trims_them_on_time(settings, r) -> None:
    """One call learns how long nothing can go (the head's age against the rule): the same trimmer's
    next passes skip the queue until then, and trim it as soon as it is due."""
    s = settings.model_copy(update={"retention_ms": 1500})
    p = Producer(settings=s)
    p.create_topic("t", queues=2)  # queue 0 gets messages, queue 1 stays empty
    p.send_orderly_batch("t", [("k", b"0"), ("k", b"1")], selector=lambda mqs, _m, _k: mqs[0])
    trimmer = RetentionTrimmer(p.brokers, s)
    first = trimmer.run()
    assert (first.calls, first.quiet_skipped, first.trimmed) == (2, 0, 0)
    again = trimmer.run()
    assert (again.calls, again.quiet_skipped) == (0, 2)  # neither queue can have anything due yet
    # A new trimmer knows nothing (the CLI's `mqorder retention run`): it calls every queue.
    assert RetentionTrimmer(p.brokers, s).run().calls == 2
    deadline = time.monotonic() + 10
    trimmed = 0
    while trimmed < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        trimmed += trimmer.run().trimmed
    assert trimmed == 2 and offsets_stored(r) == []
    p.close()


def test_a_changed_rule_or_cap_is_checked_at_once_despite_the_skip(settings, r) -> None:
    s = settings.model_copy(update={"retention_ms": 3_600_000})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    send(p, 20)
    trimmer = RetentionTrimmer(p.brokers, s)
    assert trimmer.run().trimmed == 0
    assert trimmer.run().quiet_skipped == 1
    # A cap makes appends alone due: the rule changed, so the queue is called at once, and with a
    # cap it is never skipped.
    TopicManager(p.brokers, s.retention_defaults).update_retention("t", TopicRetention.of(retention_max_messages=5))
    report = trimmer.run()
    assert (report.trimmed, report.quiet_skipped) == (15, 0)
    send(p, 3, start=20)
    report = trimmer.run()
    assert (report.trimmed, report.quiet_skipped) == (3, 0)
    assert offsets_stored(r) == list(range(18, 23))
    p.close()


def test_describe_topics_parses_a_route_again_only_when_it_changed(redis_url: str) -> None:
    """A pass over every topic (the trimmer's, every 5 s) parses each route once per change of its
    stored fields (issue 27's idle cost): an unchanged route is the one parsed before, a changed
    permission or retention is seen at once, and a deleted topic is left out."""
    from mqorder.store.brokers import BrokerRegistry

    brokers = BrokerRegistry(redis_url)
    try:
        topics = TopicManager(brokers)
        topics.create_topic("routes-a", 3)
        topics.create_topic("routes-b", 2)
        first = topics.describe_topics(["routes-a", "routes-b"])
        again = topics.describe_topics(["routes-a", "routes-b"])
        assert again["routes-a"] is first["routes-a"] and again["routes-b"] is first["routes-b"]
        assert [mq.queue_id for mq in again["routes-a"].message_queues] == [0, 1, 2]
        topics.update_perm("routes-a", "r")
        topics.update_retention("routes-b", TopicRetention(retention_ms=60_000))
        changed = topics.describe_topics(["routes-a", "routes-b"])
        assert changed["routes-a"].perm == "r" and changed["routes-b"].retention.retention_ms == 60_000
        r = brokers.meta
        r.delete(keys.topic_route("routes-b"))
        assert list(topics.describe_topics(["routes-a", "routes-b"])) == ["routes-a"]
    finally:
        brokers.close()


def test_a_broadcast_client_that_stopped_keeps_holding_what_it_has_not_consumed(settings, r) -> None:
    """A broadcasting worker's warm shutdown took its lane out of the topic's subscribers, so the
    next pass of the consumed policy trimmed what it missed while stopped (a broadcast walk-through:
    a restart after 300 sends received none of them, where a kill -9 lost none). It now holds for
    retention_ms since it was last seen, as after a crash."""
    import tests.listeners  # noqa: F401 - registers g-bcast (BROADCASTING) on t-bcast
    from mqorder.consumer.client_instance import ClientInstance

    s = settings.model_copy(update={"retention_ms": 60_000, "retention_min_ms": 0})
    p = Producer(settings=s)
    p.create_topic("t-bcast", queues=1, retention_policy="consumed")
    client = ClientInstance("b1@test", s, dispatch=lambda *a: True)
    client._register()
    lane = keys.broadcast_sub("g-bcast", "b1@test")
    mq = MessageQueue("t-bcast", "broker-a", 0)
    client.stop()
    assert lane in p.topics.subs_of_topic("t-bcast")
    send(p, 30, topic="t-bcast")
    report = RetentionTrimmer(p.brokers, s).run()
    assert lane in report.holders["t-bcast"]
    assert offsets_stored(r, mq) == list(range(30))  # kept for the stopped client
    time.sleep(0.01)
    with Admin.open(s) as admin:  # its backlog waits for it: not stuck (`status --check` passes)
        (q,) = group_status(admin, "g-bcast", stuck_after_s=0).queues
    assert (q.sub, q.lag, q.client_gone, q.stuck) == (lane, 30, True, False)
    # Gone longer than retention_ms: it holds nothing back, and leaves the topic's subscribers
    # (worker names never seen again piled up there); its offsets stay.
    r.hset(keys.retention_seen(), lane, int(time.time() * 1000) - 61_000)
    report = RetentionTrimmer(p.brokers, s).run()
    assert report.forgotten_lanes == 1 and lane not in p.topics.subs_of_topic("t-bcast")
    assert lane not in report.holders["t-bcast"]
    client.brokers.close()
    p.close()


def test_a_lane_starting_at_the_end_is_placed_once(settings, r) -> None:
    """consume_from_where="last_offset" decides a lane's start once: a restart before its first
    commit (or a topic created after the lane) must not move it to the end again, which skipped
    what it had not consumed (a review of the first version)."""
    from mqorder.rebalance.start_position import start_new_lane_at_end

    p = Producer(settings=settings)
    topics = TopicManager(p.brokers)
    assert start_new_lane_at_end(p.brokers, topics, "late-g", "t-later") == 0  # no topic yet
    p.create_topic("t-later", queues=1)
    send(p, 5, topic="t-later")
    assert start_new_lane_at_end(p.brokers, topics, "late-g", "t-later") == 0  # decided: from 0
    mq0 = MessageQueue("t-later", "broker-a", 0)
    assert r.hget(keys.sub_state(mq0.tag, "late-g"), "offset") is None
    p.create_topic("t-now", queues=1)
    send(p, 3, topic="t-now")
    mq1 = MessageQueue("t-now", "broker-a", 0)
    assert start_new_lane_at_end(p.brokers, topics, "now-g", "t-now") == 1
    send(p, 2, topic="t-now", start=3)
    assert start_new_lane_at_end(p.brokers, topics, "now-g", "t-now") == 0  # a restart: not moved again
    assert int(r.hget(keys.sub_state(mq1.tag, "now-g"), "offset")) == 3
    p.close()

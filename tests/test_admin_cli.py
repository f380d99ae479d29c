"""The admin command line (``mqorder topic|status|consumers|dlq|offsets|message|produce``) through
typer's CliRunner, against a real redis-server. Queue state is produced by the real engine
(``ConsumeRequest`` runs in this process) and the real scripts, never written by hand; the tests
with real Celery workers are in ``tests/test_admin_live.py``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from typer.testing import CliRunner, Result

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.admin.common import Admin
from mqorder.admin.offsets import Target
from mqorder.cli import app
from mqorder.client.selector import queue_index
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager, Redispatch
from mqorder.rebalance.membership import ClientDetails, ClientRegistry, Subscription
from mqorder.rebalance.service import RebalanceService
from mqorder.settings import Settings
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager

S = ConsumeOrderlyStatus


def cli(*args: str, input: bytes | str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=input, catch_exceptions=False)


def cli_json(*args: str) -> Any:
    res = cli(*args, "--json")
    assert res.exit_code == 0, res.stderr + res.stdout
    return json.loads(res.stdout)


@pytest.fixture
def producer(settings: Settings) -> Iterator[Producer]:
    p = Producer(settings=settings)
    yield p
    p.close()


@pytest.fixture
def engine(settings: Settings) -> Iterator[ConsumerEngine]:
    eng = ConsumerEngine(settings, "c1")
    yield eng
    eng.brokers.close()


def key_for(queue: int, queues: int, prefix: str = "k") -> str:
    """A sharding key that the default selector sends to ``queue``."""
    return next(f"{prefix}{i}" for i in range(10_000) if queue_index(f"{prefix}{i}", queues) == queue)


def consume(engine: ConsumerEngine, group: str, mq: MessageQueue, listener: Any, token: str) -> Outcome:
    """One real ConsumeRequest run of ``group`` on ``mq`` (assigned to client c1 first)."""
    spec = ListenerSpec(listener, mq.topic, group, max_reconsume_times=-1)
    return ConsumeRequest(engine, spec, group, mq, token).run()


def assign(engine: ConsumerEngine, group: str, mqs: list[MessageQueue], client: str = "c1") -> dict[MessageQueue, str]:
    tokens = [(mq, client, f"tok-{mq.queue_id}") for mq in mqs]
    return RebalanceLockManager(engine.brokers).assign(group, tokens)


def ok(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
    return S.SUCCESS


def suspend(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
    return S.SUSPEND_CURRENT_QUEUE_A_MOMENT


# -- topics ------------------------------------------------------------------------------------------


def test_topic_create_list_describe_report_queues_brokers_offsets_and_size(redis_url: str, producer: Producer) -> None:
    created = cli_json("topic", "create", "orders", "--queues", "3")
    assert created["queue_count"] == 3 and created["messages"] == 0
    k0, k2 = key_for(0, 3), key_for(2, 3)
    for i in range(5):
        producer.send_orderly("orders", f"a{i}".encode(), sharding_key=k0)
    producer.send_orderly("orders", b"b", sharding_key=k2)
    info = cli_json("topic", "describe", "orders")
    assert [(q["broker"], q["queue_id"], q["min_offset"], q["max_offset"], q["messages"]) for q in info["queues"]] == [
        ("broker-a", 0, 0, 5, 5), ("broker-a", 1, 0, 0, 0), ("broker-a", 2, 0, 1, 1),
    ]
    assert info["queues"][0]["bytes"] > info["queues"][1]["bytes"] and info["messages"] == 6
    listed = cli_json("topic", "list")
    assert [(t["topic"], t["queue_count"], t["messages"]) for t in listed] == [("orders", 3, 6)]
    human = cli("topic", "describe", "orders")
    assert human.exit_code == 0 and "broker-a" in human.stdout and "orders" in human.stdout
    assert cli_json("topic", "perm", "orders", "r")["perm"] == "r"
    assert producer.topics.describe_topic("orders").perm == "r"
    bad = cli("topic", "perm", "orders", "x")
    assert bad.exit_code == 2 and "topic permission must be one of rw, r, w" in bad.stderr


def test_topic_delete_is_refused_while_a_group_subscribes_and_forced_removes_everything(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("doomed", queues=2)
    producer.create_topic("kept", queues=1)
    TopicManager(engine.brokers).subscribe("g", "doomed", MessageModel.CLUSTERING)
    TopicManager(engine.brokers).subscribe("h", "doomed", MessageModel.CLUSTERING)
    TopicManager(engine.brokers).subscribe("h", "kept", MessageModel.CLUSTERING)
    for i in range(4):
        producer.send_orderly("doomed", b"x", sharding_key=key_for(i % 2, 2))
    producer.send_orderly("kept", b"y", sharding_key="1")
    mqs = producer.describe_topic("doomed").message_queues
    ClientRegistry(engine.brokers.meta, 60_000).register("c1", [Subscription("g", "doomed", MessageModel.CLUSTERING)])
    report = RebalanceService(engine.brokers, engine.settings).rebalance()  # writes the assignment hints
    for d in report.dispatches:
        consume(engine, "g", d.mq, ok, d.token)
    topology = int(r.get(keys.topology_version()) or 0)

    refused = cli("topic", "delete", "doomed")
    assert refused.exit_code == 1 and "subscribed by group(s) g, h; live consumers: c1" in refused.stderr
    assert "--force" in refused.stderr
    assert r.exists(keys.topic_route("doomed")) and r.exists(keys.queue_log(mqs[0].tag))

    dry = cli_json("topic", "delete", "doomed", "--dry-run")
    assert dry["dry_run"] and dry["keys_by_kind"]["log"] == 2 and dry["keys_by_kind"]["state"] == 4
    assert r.exists(keys.topic_route("doomed"))

    done = cli_json("topic", "delete", "doomed", "--force")
    assert done["groups"] == ["g", "h"] and done["messages"] == 4 and done["assignment_fields"] == 2
    # Only the marks that make the queues refuse producers still holding the route, for a while.
    assert set(r.scan_iter(match="mqorder:{doomed:*")) == {keys.queue_gone(mq.tag).encode() for mq in mqs}
    assert 0 < r.pttl(keys.queue_gone(mqs[0].tag)) <= keys.GONE_TTL_MS
    assert not r.exists(keys.topic_route("doomed")) and not r.sismember(keys.topics(), "doomed")
    assert not any(k.startswith(b"doomed:") for k in r.hkeys(keys.assignment("g")))
    assert json.loads(r.hget(keys.groups(), "h")) == {"kept": "CLUSTERING"} and not r.hexists(keys.groups(), "g")
    assert int(r.get(keys.topology_version())) == topology + 1  # workers rebalance at once
    assert r.exists(keys.queue_log(MessageQueue("kept", "broker-a", 0).tag))  # nothing else touched
    assert cli("topic", "describe", "doomed").exit_code == 2


def test_a_topic_delete_stopped_half_way_takes_its_marks_back(
    redis_url: str, r: redis.Redis, producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: a delete that stopped after marking (a timeout, Ctrl-C) left a live topic that
    refused every send for 10 minutes, and create_topic did not help."""
    from mqorder.admin import topics as admin_topics

    producer.create_topic("half", queues=2)

    def stopped(*a: object, **kw: object) -> None:
        raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(admin_topics, "_delete_queue_keys", stopped)
    assert cli("topic", "delete", "half").exit_code != 0
    assert not list(r.scan_iter(match="mqorder:{half:*:gone"))
    assert producer.send_orderly("half", b"still here", sharding_key="k").queue_offset == 0


def test_the_scripts_find_a_queues_gone_mark_beside_its_counter_and_its_transaction_index() -> None:
    """``refuse_if_gone`` (``_append.lua``) and ``txn_prepare.lua`` spell the mark's name from these."""
    tag = MessageQueue("t", "broker-a", 3).tag
    assert keys.queue_next(tag)[:-len("next")] + "gone" == keys.queue_gone(tag)
    assert keys.txn_index(tag)[:-len("txn")] + "gone" == keys.queue_gone(tag)
    assert keys.delay_schedule(tag)[:-len("delay")] + "gone" == keys.queue_gone(tag)


def test_a_producer_holding_a_deleted_topics_route_is_refused_and_a_new_topic_starts_empty(
    redis_url: str, r: redis.Redis, producer: Producer
) -> None:
    """Found by a producer's walk-through: for the 30 s of its route cache a producer went on
    acknowledging sends (sync, async, batch) into a deleted topic, and `topic create` of the name
    then showed them as the new topic's messages."""
    from mqorder.client.transaction import LocalTransactionState, TransactionProducer
    from mqorder.errors import TopicNotFoundError

    producer.create_topic("gone", queues=2)
    producer.send_orderly("gone", b"before", sharding_key="k")
    batching = Producer(redis_url, linger_ms=1)
    batching.send_orderly_async("gone", b"before", sharding_key="k").result(10)  # all hold the route now
    txn = TransactionProducer(redis_url)

    def commit(msg: object, arg: object) -> LocalTransactionState:
        return LocalTransactionState.COMMIT

    txn.send_in_transaction("gone", b"before", executor=commit, sharding_key="k")
    assert cli("topic", "delete", "gone").exit_code == 0
    with pytest.raises(TopicNotFoundError, match=r"the topic was deleted .* nothing was stored"):
        producer.send_orderly("gone", b"after", sharding_key="k")
    with pytest.raises(TopicNotFoundError, match="the topic was deleted"):
        producer.send_orderly_batch("gone", [("k", b"after"), ("j", b"after")])
    with pytest.raises(TopicNotFoundError, match="the topic was deleted"):
        batching.send_orderly_async("gone", b"after", sharding_key="k").result(10)
    with pytest.raises(TopicNotFoundError, match="the topic was deleted"):
        txn.send_in_transaction("gone", b"after", executor=commit, sharding_key="k")
    with pytest.raises(TopicNotFoundError, match="the topic was deleted"):  # a review: held, then moved
        producer.send("gone", b"after", delay_time_level=1)
    assert all(k.endswith(b":gone") for k in r.scan_iter(match="mqorder:{gone:*"))  # nothing stored
    # Created again: its queues take messages, the old route's holders' included, and it starts empty.
    assert cli("topic", "create", "gone", "--queues", "2").exit_code == 0
    assert not list(r.scan_iter(match="mqorder:{gone:*:gone"))
    res = producer.send_orderly("gone", b"new", sharding_key="k")
    assert res.queue_offset == 0
    assert batching.send_orderly_async("gone", b"new", sharding_key="k").result(10).queue_offset == 1
    batching.close()
    txn.close()


# -- status --------------------------------------------------------------------------------------------


def test_status_shows_owner_epoch_lag_head_retries_and_flags_the_queue_whose_head_keeps_suspending(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=2)
    TopicManager(engine.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    k0, k1 = key_for(0, 2), key_for(1, 2)
    for i in range(3):
        producer.send_orderly("t", f"{i}".encode(), sharding_key=k0)
        producer.send_orderly("t", f"{i}".encode(), sharding_key=k1)
    q0, q1 = producer.describe_topic("t").message_queues
    assert assign(engine, "g", [q0, q1]) == {q0: "DISPATCH", q1: "DISPATCH"}
    assert consume(engine, "g", q0, ok, "tok-0").consumed == 3
    out = consume(engine, "g", q1, suspend, "tok-1")  # the head of q1 fails: suspended, retried later
    assert out.verb.value == "REQUEUE"
    time.sleep(0.6)

    st = cli_json("status", "g", "--stuck-after", "0.4")
    rows = {q["queue_id"]: q for q in st["queues"]}
    assert (rows[0]["max_offset"], rows[0]["committed"], rows[0]["lag"]) == (3, 3, 0)
    assert (rows[1]["max_offset"], rows[1]["committed"], rows[1]["lag"]) == (3, 0, 3)
    for q in rows.values():
        held = int(engine.brokers.default.client.hget(keys.sub_state(MessageQueue("t", "broker-a", q["queue_id"]).tag, "g"), "epoch"))
        assert q["owner"] == "c1" and q["epoch"] == held and 50_000 < q["lease_left_ms"] <= 60_000
    assert rows[0]["commit_ms"] and rows[0]["last_commit_age_ms"] >= 500 and not rows[0]["stuck"]
    assert rows[1]["commit_ms"] is None and rows[1]["head_reconsume"] == 1 and rows[1]["pending"]
    assert rows[1]["stuck"] and rows[1]["waiting_ms"] >= 500 and st["stuck"] == 1

    assert cli("status", "g", "--stuck-after", "0.4", "--check").exit_code == 1
    healthy = cli("status", "g", "t", "--stuck-after", "60", "--check")
    assert healthy.exit_code == 0 and "0 stuck" in healthy.stdout
    human = cli("status", "g", "--stuck-after", "0.4")
    assert human.exit_code == 0 and "STUCK: t:broker-a:1" in human.stdout


def test_commit_records_when_the_offset_last_moved_and_only_then(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=1)
    mq = MessageQueue("t", "broker-a", 0)
    producer.send_orderly("t", b"0", sharding_key="k")
    assign(engine, "g", [mq])
    consume(engine, "g", mq, ok, "tok-0")
    moved = int(r.hget(keys.sub_state(mq.tag, "g"), "commit_ms"))
    now = r.time()
    assert abs(now[0] * 1000 + now[1] // 1000 - moved) < 5000
    producer.send_orderly("t", b"1", sharding_key="k")
    time.sleep(0.05)
    # Nobody listens for wake-ups here, so the send left the queue unclaimed: the sweep's job.
    assert RebalanceLockManager(engine.brokers).sweep("g", [(mq, "tok-x")], "c1") == [Redispatch(mq, "c1", "tok-x")]
    consume(engine, "g", mq, suspend, "tok-x")  # commits the retry count, not a new offset
    assert int(r.hget(keys.sub_state(mq.tag, "g"), "commit_ms")) == moved
    assert r.hget(keys.sub_retries(mq.tag, "g"), "1") == b"1"


def test_status_of_one_topic_all_topics_and_errors(redis_url: str, producer: Producer, engine: ConsumerEngine) -> None:
    producer.create_topic("a", queues=1)
    producer.create_topic("b", queues=2)
    tm = TopicManager(engine.brokers)
    tm.subscribe("g", "a", MessageModel.CLUSTERING)
    tm.subscribe("g", "b", MessageModel.CLUSTERING)
    tm.subscribe("g", "later", MessageModel.CLUSTERING)  # subscribed before it exists
    everything = cli_json("status", "g")
    assert sorted((q["topic"], q["queue_id"]) for q in everything["queues"]) == [("a", 0), ("b", 0), ("b", 1)]
    assert everything["missing_topics"] == ["later"]
    assert [q["topic"] for q in cli_json("status", "g", "b")["queues"]] == ["b", "b"]
    unknown_group = cli("status", "nope")
    assert unknown_group.exit_code == 2 and "consumer group 'nope' does not exist" in unknown_group.stderr
    other_topic = cli("status", "g", "zzz")
    assert other_topic.exit_code == 2 and "topic 'zzz' does not exist" in other_topic.stderr
    producer.create_topic("c", queues=1)
    not_subscribed = cli("status", "g", "c")
    assert not_subscribed.exit_code == 2 and "does not subscribe to topic 'c'" in not_subscribed.stderr


# -- consumers ---------------------------------------------------------------------------------------


def test_consumers_lists_live_and_lapsed_clients_with_pool_heartbeat_and_assigned_queues(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=4)
    tm = TopicManager(engine.brokers)
    tm.subscribe("g", "t", MessageModel.CLUSTERING)
    sub = [Subscription("g", "t", MessageModel.CLUSTERING)]
    ClientRegistry(engine.brokers.meta, 3000).register("w1@h", sub, ClientDetails("prefork", 4))
    ClientRegistry(engine.brokers.meta, 200).register("w2@h", sub, ClientDetails("threads", 8))
    mqs = producer.describe_topic("t").message_queues
    locks = RebalanceLockManager(engine.brokers)
    locks.assign("g", [(mq, "w1@h" if mq.queue_id < 3 else "w2@h", "x") for mq in mqs])
    time.sleep(0.4)  # w2's heartbeat (200 ms) lapses
    gc = cli_json("consumers", "g")
    by_id = {c["client_id"]: c for c in gc["consumers"]}
    w1, w2 = by_id["w1@h"], by_id["w2@h"]
    assert gc["live"] == 1 and w1["live"] and not w2["live"]
    assert (w1["pool"], w1["concurrency"], w2["pool"], w2["concurrency"]) == ("prefork", 4, "threads", 8)
    assert 300 <= w1["heartbeat_age_ms"] < 3000 and w2["deadline_left_ms"] < 0
    assert w1["assigned"] == ["t:broker-a:0", "t:broker-a:1", "t:broker-a:2"] and w2["assigned"] == ["t:broker-a:3"]
    assert w1["locks_held"] == 3 and w1["topics"] == ["t"]
    human = cli("consumers", "g")
    assert "prefork x4" in human.stdout and "t:broker-a:0,1,2" in human.stdout and "lapsed" in human.stdout
    assert cli("consumers", "nope").exit_code == 2


# -- dlq -------------------------------------------------------------------------------------------------


def dead_letter_three(producer: Producer, engine: ConsumerEngine) -> tuple[list[MessageQueue], dict[str, list[str]]]:
    """Messages of keys on two queues, dead-lettered by the real engine (max_reconsume_times=0)."""
    producer.create_topic("t", queues=2)
    TopicManager(engine.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    k0, k1 = key_for(0, 2), key_for(1, 2)
    sent = {k0: [], k1: []}
    for i in range(3):
        for k in (k0, k1):
            producer.send_orderly("t", f"{k}-{i}".encode(), sharding_key=k, keys=[k], properties={"n": str(i)})
            sent[k].append(f"{k}-{i}")
    mqs = producer.describe_topic("t").message_queues
    assign(engine, "g", mqs)
    spec_dead = ListenerSpec(suspend, "t", "g", max_reconsume_times=0)
    for mq in mqs:
        out = ConsumeRequest(engine, spec_dead, "g", mq, f"tok-{mq.queue_id}").run()
        while out.needs_dispatch:
            out = ConsumeRequest(engine, spec_dead, "g", mq, out.token).run()
    return mqs, sent


def test_dlq_list_and_show_tell_where_each_dead_letter_came_from_and_why(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    mqs, sent = dead_letter_three(producer, engine)
    page = cli_json("dlq", "list", "g")
    assert page["total"] == 6 and page["topic"] == "%DLQ%g"
    origins = [(m["origin_queue_id"], m["origin_offset"]) for m in page["messages"]]
    assert sorted(origins) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all("max reconsume times 0" in m["reason"] and m["properties"].keys() == {"n"} for m in page["messages"])
    one = cli_json("dlq", "show", "g", "--offset", "0")
    assert one["body"] in sent[key_for(0, 2)] + sent[key_for(1, 2)] and one["client"] == "c1"
    assert cli_json("dlq", "list", "g", "--from", "4", "--limit", "5")["messages"][0]["dlq_offset"] == 4
    human = cli("dlq", "show", "g", "--offset", "0")
    assert "max reconsume times 0" in human.stdout and "origin" in human.stdout
    missing = cli("dlq", "show", "g", "--offset", "99")
    assert missing.exit_code == 2 and "holds offsets [0, 6)" in missing.stderr
    assert cli("dlq", "list", "nope").exit_code == 2
    past = cli("dlq", "list", "g", "--from", "99")  # it printed the header and nothing else
    assert past.exit_code == 0 and "none listed from the offset asked; list from 0 to 5" in past.stdout
    gone = cli("status", "nope")
    assert gone.exit_code == 2 and "or a PullConsumer of it has subscribed" in gone.stderr


def test_dlq_replay_puts_dead_letters_back_in_original_order_once_even_when_run_twice(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    mqs, sent = dead_letter_three(producer, engine)
    log = MessageLog(engine.brokers)
    assert [log.max_offset(mq) for mq in mqs] == [3, 3]
    dry = cli_json("dlq", "replay", "g", "--dry-run")
    assert dry["dry_run"] and dry["by_queue"] == {"t:broker-a:0": 3, "t:broker-a:1": 3}
    assert [log.max_offset(mq) for mq in mqs] == [3, 3]

    first = cli_json("dlq", "replay", "g")
    assert (first["read"], first["stored"], first["duplicates"]) == (6, 6, 0)
    for mq, key in zip(mqs, (key_for(0, 2), key_for(1, 2)), strict=True):
        replayed = log.read(mq, 3, 10)
        assert [m.body.decode() for m in replayed] == sent[key]  # original order, original queue
        assert all(m.keys == [key] and m.properties["n"] == str(i) for i, m in enumerate(replayed))
        assert all(m.properties["DLQ_REPLAYED_FROM"].startswith("%DLQ%g@") for m in replayed)
        assert not any(p.startswith(("ORIGIN_", "DLQ_REASON")) for m in replayed for p in m.properties)
    again = cli("dlq", "replay", "g")
    assert again.exit_code == 0 and "replayed 0 of 6" in again.stdout and "6 were already replayed" in again.stdout
    assert [log.max_offset(mq) for mq in mqs] == [6, 6]

    producer.create_topic("elsewhere", queues=1)
    moved = cli_json("dlq", "replay", "g", "--topic", "elsewhere", "--from", "2", "--to", "3")
    assert (moved["stored"], moved["by_queue"]) == (2, {"elsewhere:broker-a:0": 2})
    assert cli("dlq", "replay", "g", "--topic", "nowhere").exit_code == 2
    assert [log.max_offset(mq) for mq in mqs] == [6, 6]


def test_dlq_replay_sends_a_message_dead_lettered_by_several_clients_back_once(
    redis_url: str, settings: Settings, producer: Producer, engine: ConsumerEngine
) -> None:
    """Each client of a broadcasting group dead-letters the same message itself: a replay appended
    every copy, so with 2 clients each got it twice, and every other group too (a broadcast
    walk-through). One copy per original (origin queue, offset, msg id) is replayed now."""
    producer.create_topic("tb", queues=1)
    TopicManager(engine.brokers).subscribe("gb", "tb", MessageModel.BROADCASTING)
    producer.send_orderly("tb", b"poison", sharding_key="k")
    producer.send_orderly("tb", b"other", sharding_key="k")
    mq = producer.describe_topic("tb").message_queues[0]
    poison, other = MessageLog(engine.brokers).read(mq, 0, 2)
    second = ConsumerEngine(settings, "c2")
    try:
        for epoch, eng in enumerate((engine, second), 1):  # the two clients' lanes, each its own epoch
            eng.dlq.send("gb", poison, "max reconsume times 16 reached", epoch, mq)
        engine.dlq.send("gb", other, "max reconsume times 16 reached", 1, mq)
        dry = cli_json("dlq", "replay", "gb", "--dry-run")
        assert (dry["read"], dry["same_origin"], dry["by_queue"]) == (3, 1, {"tb:broker-a:0": 2})
        done = cli_json("dlq", "replay", "gb")
        assert (done["read"], done["stored"], done["same_origin"]) == (3, 2, 1)
        assert [m.body for m in MessageLog(engine.brokers).read(mq, 2, 10)] == [b"poison", b"other"]
        human = cli("dlq", "replay", "gb", "--dry-run")
        assert "1 more dead letter(s) of a message already in the range" in human.stdout
    finally:
        second.brokers.close()


def test_dlq_replay_refuses_to_give_other_groups_of_the_topic_a_second_copy_unless_told(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    """A replayed copy is delivered to every group of its topic: another group that handled the
    message long ago got it again, after the messages that followed it (found by an operator
    walk-through: `dlq replay billing` gave order-lifecycle 2 duplicates)."""
    mqs, _ = dead_letter_three(producer, engine)
    TopicManager(engine.brokers).subscribe("audit", "t", MessageModel.CLUSTERING)
    TopicManager(engine.brokers).subscribe("fanout", "t", MessageModel.BROADCASTING)
    log = MessageLog(engine.brokers)
    res = cli("dlq", "replay", "g")
    assert res.exit_code == 2 and "(t: audit, fanout)" in res.stderr and "--all-groups" in res.stderr
    assert "nothing was replayed" in res.stderr and [log.max_offset(mq) for mq in mqs] == [3, 3]
    dry = cli("dlq", "replay", "g", "--dry-run")
    assert dry.exit_code == 0 and "would also reach the other group(s) of t: audit, fanout" in dry.stdout
    assert cli_json("dlq", "replay", "g", "--dry-run")["other_groups"] == {"t": ["audit", "fanout"]}
    producer.create_topic("only-g", queues=1)
    TopicManager(engine.brokers).subscribe("g", "only-g", MessageModel.CLUSTERING)
    assert cli_json("dlq", "replay", "g", "--topic", "only-g")["stored"] == 6  # nobody else consumes it
    done = cli_json("dlq", "replay", "g", "--all-groups")
    assert (done["stored"], done["other_groups"]) == (6, {"t": ["audit", "fanout"]})
    assert [log.max_offset(mq) for mq in mqs] == [6, 6]
    bad = cli("dlq", "replay", "g", "--from", "5", "--to", "1")
    assert bad.exit_code == 2 and "--from 5 is after --to 1" in bad.stderr


def test_dlq_replay_refuses_everything_when_an_origin_topic_is_gone(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    mqs, _ = dead_letter_three(producer, engine)
    assert cli("topic", "delete", "t", "--force").exit_code == 0
    res = cli("dlq", "replay", "g")
    assert res.exit_code == 2 and "topic 't' does not exist" in res.stderr and "nothing was replayed" in res.stderr
    assert not any(MessageLog(engine.brokers).max_offset(mq) for mq in mqs)


# -- offsets reset ----------------------------------------------------------------------------------


def test_target_parses_every_form_and_refuses_garbage() -> None:
    assert Target.parse("earliest") == Target("earliest") and Target.parse("LATEST") == Target("latest")
    assert Target.parse("1500") == Target("offset", 1500)
    assert Target.parse("@1738324800000") == Target("time", 1738324800000)
    assert Target.parse("2025-01-31T12:00:00Z") == Target("time", 1738324800000)
    assert Target.parse("2025-01-31T13:00:00+01:00") == Target("time", 1738324800000)
    res = cli("offsets", "reset", "g", "t", "--to", "yesterday")
    assert res.exit_code == 2 and "is not earliest, latest, an offset" in res.stderr


def test_offsets_reset_by_earliest_latest_offset_and_time(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=1)
    TopicManager(engine.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    mq = MessageQueue("t", "broker-a", 0)
    stamps = []
    for i in range(10):
        stamps.append(producer.send_orderly("t", str(i).encode(), sharding_key="k").store_timestamp)
        time.sleep(0.003)
    assign(engine, "g", [mq])
    consume(engine, "g", mq, ok, "tok-0")
    state = keys.sub_state(mq.tag, "g")

    def offset() -> int:
        return int(r.hget(state, "offset"))

    assert offset() == 10
    at = stamps[6]
    first_at = min(i for i, s in enumerate(stamps) if s >= at)
    for to, want in (("earliest", 0), ("latest", 10), ("4", 4), ("99", 10), (f"@{at}", first_at),
                     (f"@{stamps[-1] + 10_000}", 10), ("@0", 0)):
        rep = cli_json("offsets", "reset", "g", "t", "--to", to)
        assert rep["queues"][0]["new_offset"] == want == offset(), to
    plan = cli_json("offsets", "reset", "g", "t", "--to", "latest", "--dry-run")
    assert plan["dry_run"] and plan["queues"][0]["new_offset"] == 10 and offset() == 0
    human = cli("offsets", "reset", "g", "t", "--to", "@0", "--dry-run")  # was "to time -"
    assert "plan: reset g on t to time @0 (epoch ms 0)" in human.stdout


def test_offsets_reset_is_refused_under_live_consumers_and_forced_fences_the_running_owner(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=1)
    TopicManager(engine.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    ClientRegistry(engine.brokers.meta, 60_000).register("c1", [Subscription("g", "t", MessageModel.CLUSTERING)])
    mq = MessageQueue("t", "broker-a", 0)
    for i in range(6):
        producer.send_orderly("t", str(i).encode(), sharding_key="k")
    assign(engine, "g", [mq])
    state, retries = keys.sub_state(mq.tag, "g"), keys.sub_retries(mq.tag, "g")
    granted = int(r.hget(state, "epoch"))
    seen: list[int] = []
    reset_reply: dict[str, Any] = {}

    def listener(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
        """Consumes 0..3, and during offset 3 an operator resets the group to offset 1."""
        seen.append(msgs[0].queue_offset)
        if msgs[0].queue_offset == 3:
            refused = cli("offsets", "reset", "g", "t", "--to", "1")
            assert refused.exit_code == 1 and "consumer(s) of group 'g' are live (c1)" in refused.stderr
            assert int(r.hget(state, "offset") or 0) == 0  # nothing changed
            reset_reply.update(cli_json("offsets", "reset", "g", "t", "--to", "1", "--force"))
            assert not ctx.still_owner()
        return S.SUCCESS

    r.hset(retries, "0", 5)  # a stale reconsume count: the reset clears it
    topology = int(r.get(keys.topology_version()) or 0)
    out = consume(engine, "g", mq, listener, "tok-0")
    # The stale run still hands what it had pulled (4, 5) to its listener until it next checks its
    # lock, as a paused holder does after a takeover; its commit of offset 6 is then refused.
    assert out.verb.value == "FENCED" and seen == [0, 1, 2, 3, 4, 5]
    assert int(r.hget(state, "offset")) == 1
    row = reset_reply["queues"][0]
    assert (row["old_offset"], row["new_offset"], row["owner"]) == (0, 1, "c1") and row["epoch"] > granted
    st = {k.decode(): v.decode() for k, v in r.hgetall(state).items()}
    assert st["offset"] == "1" and st["owner"] == "" and st["pending"] == "" and st["epoch"] == str(row["epoch"])
    assert not r.exists(retries) and int(r.get(keys.topology_version())) == topology + 1
    # The stale run's commit of offset 4 was refused: a new owner resumes from 1, under a newer epoch.
    assert assign(engine, "g", [mq]) == {mq: "DISPATCH"}
    resumed: list[tuple[int, int]] = []
    out = consume(engine, "g", mq, lambda m, c: resumed.append((m[0].queue_offset, c.epoch)) or S.SUCCESS, "tok-0")
    (epoch,) = {e for _, e in resumed}
    assert [o for o, _ in resumed] == [1, 2, 3, 4, 5] and epoch > row["epoch"] and int(r.hget(state, "offset")) == 6


# -- messages ------------------------------------------------------------------------------------------


def test_message_show_by_offset_and_by_msg_id_with_each_groups_progress(
    redis_url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=2)
    TopicManager(engine.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    k1 = key_for(1, 2)
    sent = [producer.send_orderly("t", f'{{"n": {i}}}'.encode(), sharding_key=k1, keys=k1, tags="T") for i in range(3)]
    mq = sent[0].message_queue
    assign(engine, "g", [mq])
    calls = iter([S.SUCCESS, S.SUSPEND_CURRENT_QUEUE_A_MOMENT])
    consume(engine, "g", mq, lambda m, c: next(calls), "tok-1")
    shown = cli_json("message", "show", "t", "--queue", "1", "--offset", "1")
    assert (shown["msg_id"], shown["body"], shown["keys"], shown["tags"]) == (sent[1].msg_id, '{"n": 1}', [k1], "T")
    assert shown["groups"] == [{"group": "g", "committed": 1, "state": "retrying", "reconsume_times": 1}]
    assert cli_json("message", "show", "t", "--queue", "1", "--offset", "0")["groups"][0]["state"] == "consumed"
    found = cli("message", "show", "t", "--msg-id", sent[2].msg_id, "--json")
    assert found.exit_code == 0 and "may take a while" in found.stderr
    assert [(m["queue_id"], m["offset"]) for m in json.loads(found.stdout)] == [(1, 2)]
    assert json.loads(found.stdout)[0]["groups"][0]["state"] == "waiting"
    human = cli("message", "show", "t", "--queue", "1", "--offset", "2")
    assert sent[2].msg_id in human.stdout and '{"n": 2}' in human.stdout
    for args, why in (
        (("--queue", "1", "--offset", "7"), "holds offsets [0, 3)"),
        (("--queue", "5", "--offset", "0"), "has no queue 5"),
        (("--msg-id", "nope"), "no message with id 'nope'"),
        (("--queue", "1"), "give either --queue Q --offset O, or --msg-id ID"),
        (("--queue", "1", "--offset", "0", "--msg-id", "x"), "give either"),
    ):
        res = cli("message", "show", "t", *args)
        assert res.exit_code == 2 and why in res.stderr, (args, res.stderr)


# -- produce ---------------------------------------------------------------------------------------------


def test_produce_sends_json_lines_keyed_by_a_field_in_order(redis_url: str, producer: Producer) -> None:
    producer.create_topic("t", queues=4)
    lines = [json.dumps({"order": {"id": i % 3}, "seq": i}) for i in range(30)]
    res = cli("produce", "t", "--key-field", "order.id", "--chunk", "7", "--json", input="\n".join(lines) + "\n\n")
    assert res.exit_code == 0, res.stderr
    report = json.loads(res.stdout)
    assert (report["sent"], report["chunks"], report["bad"]) == (30, 5, [])
    log = MessageLog(producer.brokers)
    got: dict[str, list[int]] = {}
    for mq in producer.describe_topic("t").message_queues:
        for m in log.read(mq, 0, 100):
            body = json.loads(m.body)
            assert m.keys == [str(body["order"]["id"])] and mq.queue_id == queue_index(body["order"]["id"], 4)
            got.setdefault(m.keys[0], []).append(body["seq"])
    assert got == {str(k): list(range(k, 30, 3)) for k in range(3)}
    assert sum(report["by_queue"].values()) == 30


def test_produce_stops_at_a_chunk_with_a_bad_line_and_sends_nothing_of_it(redis_url: str, producer: Producer) -> None:
    producer.create_topic("t", queues=2)
    good = [json.dumps({"k": f"u{i}", "i": i}) for i in range(10)]
    lines = good[:5] + ['{"k": "u5", "i": 5', json.dumps({"i": 6}), json.dumps({"k": True})] + good[5:]
    res = cli("produce", "t", "--key-field", "k", "--chunk", "4", input="\n".join(lines))
    assert res.exit_code == 2
    assert "line 6:" in res.stdout and "not JSON" in res.stdout and "line 7:" in res.stdout
    assert "no field 'k'" in res.stdout and "stopped: the chunk of lines 5-8 was refused" in res.stdout
    log = MessageLog(producer.brokers)
    stored = sorted(json.loads(m.body)["i"] for mq in producer.describe_topic("t").message_queues
                    for m in log.read(mq, 0, 100))
    assert stored == [0, 1, 2, 3]  # the first chunk; nothing of lines 5-8, nothing after

    skipped = cli("produce", "t", "--key-field", "k", "--chunk", "4", "--skip-bad", "--json", input="\n".join(lines))
    rep = json.loads(skipped.stdout)
    assert skipped.exit_code == 2 and rep["sent"] == 10 and [b["line"] for b in rep["bad"]] == [6, 7, 8]
    assert "must be a non-empty string or an integer" in rep["bad"][2]["error"]


def test_produce_reads_a_file_and_refuses_an_unknown_topic_before_reading(
    redis_url: str, producer: Producer, tmp_path: Any
) -> None:
    producer.create_topic("t", queues=1)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps({"k": i}) + "\n" for i in range(50)))
    assert cli_json("produce", "t", "--key-field", "k", "--file", str(path))["sent"] == 50
    res = cli("produce", "nope", "--key-field", "k", input="{}")
    assert res.exit_code == 2 and "topic 'nope' does not exist" in res.stderr


def test_produce_stopped_by_a_broker_resumes_from_the_line_it_names_without_storing_twice() -> None:
    """A run a failover stopped said "lines 42401-42600 may be stored in part" with no way to send
    again safely (an operator walk-through): a resend stored up to a chunk twice, skipping lost it.
    Now it names --from-line, and with --dedup-field the lines already stored are not stored again."""
    from mqorder.admin.produce import ProduceInterrupted, produce
    from mqorder.settings import load_settings
    from mqorder.testing.embedded import RedisServer

    lines = [json.dumps({"k": f"u{i % 3}", "id": f"evt-{i}", "i": i}).encode() for i in range(1, 21)]
    with RedisServer(appendonly=True, appendfsync="always") as srv:  # what was stored survives the kill
        p = Producer(settings=load_settings(redis_url=srv.url, send_msg_timeout_ms=500))
        p.create_topic("t", queues=2)
        log = MessageLog(p.brokers)

        def stored() -> list[int]:
            return sorted(json.loads(m.body)["i"] for mq in p.describe_topic("t").message_queues
                          for m in log.read(mq, 0, 100))

        def kill_after_two_chunks(n: int, _bytes: int) -> None:
            if n == 8:
                srv.kill()

        with pytest.raises(ProduceInterrupted) as stop:
            produce(p, "t", lines, "k", chunk_size=4, dedup_field="id", progress=kill_after_two_chunks)
        assert "lines 9-12 may be stored in part" in str(stop.value)
        assert "send again with --from-line 9: with --dedup-field id" in str(stop.value)
        srv.restart()
        # As if the interrupted chunk had reached Redis: one of its lines is stored.
        p.send_orderly_batch("t", [("u0", lines[8])], dedup_keys=["evt-9"])
        report = produce(p, "t", lines, "k", chunk_size=4, dedup_field="id", from_line=9)
        assert (report.lines, report.sent) == (20, 12)
        assert stored() == list(range(1, 21))  # every line once: line 9 not stored twice
        p.close()


def test_produce_from_line_and_dedup_field_through_the_cli(redis_url: str, producer: Producer) -> None:
    producer.create_topic("t", queues=2)
    lines = "\n".join(json.dumps({"k": "a", "id": i}) for i in range(10))
    first = json.loads(cli("produce", "t", "--key-field", "k", "--dedup-field", "id", "--from-line", "4", "--json",
                           input=lines).stdout)
    assert (first["lines"], first["sent"]) == (10, 7)
    again = json.loads(cli("produce", "t", "--key-field", "k", "--dedup-field", "id", "--json", input=lines).stdout)
    assert again["sent"] == 10  # acknowledged, but the 7 already stored were not stored again
    log = MessageLog(producer.brokers)
    bodies = [json.loads(m.body)["id"] for mq in producer.describe_topic("t").message_queues
              for m in log.read(mq, 0, 100)]
    assert sorted(bodies) == list(range(10))
    res = cli("produce", "t", "--key-field", "k", "--dedup-field", "nope", input=lines)
    assert res.exit_code == 2 and "no field 'nope'" in res.stdout
    # An id send_orderly_batch would refuse is a bad line (its number given; --skip-bad leaves it
    # out), not a refusal of its whole chunk under --skip-bad (a review finding).
    bad_ids = "\n".join(json.dumps({"k": "b", "id": "x" * 300 if i == 2 else f"b{i}"}) for i in range(5))
    out = json.loads(cli("produce", "t", "--key-field", "k", "--dedup-field", "id", "--skip-bad", "--json",
                         input=bad_ids).stdout)
    assert (out["sent"], [b["line"] for b in out["bad"]], out["refused_lines"]) == (4, [3], None)
    assert "field 'id'" in out["bad"][0]["error"] and "dedup_key" in out["bad"][0]["error"]


# -- errors ------------------------------------------------------------------------------------------------


def test_an_unreachable_redis_is_a_clear_error_with_exit_code_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from mqorder.settings import get_settings

    monkeypatch.setenv("MQORDER_REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    get_settings.cache_clear()
    try:
        for args in (("topic", "list"), ("status", "g"), ("consumers", "g"), ("dlq", "list", "g"),
                     ("offsets", "reset", "g", "t", "--to", "earliest"), ("message", "show", "t", "--msg-id", "x")):
            res = cli(*args)
            assert res.exit_code == 2, args
            assert "cannot reach Redis broker 'broker-a'" in res.stderr and "secret" not in res.stderr
    finally:
        get_settings.cache_clear()


def test_bad_arguments_exit_2(redis_url: str) -> None:
    assert cli("status").exit_code == 2  # typer: missing argument
    assert cli("topic", "create", "bad name!").exit_code == 2
    assert cli("topic", "create", "t", "--queues", "0").exit_code == 2
    assert cli("dlq", "list", "g", "--limit", "-1").exit_code == 2


def test_admin_functions_need_no_terminal(redis_url: str, producer: Producer) -> None:
    producer.create_topic("t", queues=1)
    from mqorder.admin import topics

    with Admin.open() as admin:
        assert topics.describe(admin, "t").queues[0].max_offset == 0


def test_bad_times_and_bounds_are_refused_before_anything_is_written(settings: Settings, producer: Producer) -> None:
    """A nanosecond stamp given as @ms once applied the reset (offsets moved, epoch bumped, lock
    released) and then failed drawing its time: exit 1, which says nothing changed. Year 0 and an
    infinite --stuck-after were tracebacks (found by a review)."""
    producer.create_topic("orders", queues=4)
    TopicManager(producer.brokers).subscribe("g", "orders", MessageModel.CLUSTERING)
    for i in range(3):
        producer.send_orderly("orders", b"x%d" % i, sharding_key="k")
    mq = producer.describe_topic("orders").message_queues[queue_index("k", 4)]
    before = MessageLog(producer.brokers).consume_offset("g", mq)
    r = cli("offsets", "reset", "g", "orders", "--to", "@1738324800000000000")
    assert r.exit_code == 2 and "outside 1970..9999: milliseconds are expected" in r.output
    assert MessageLog(producer.brokers).consume_offset("g", mq) == before
    r = cli("offsets", "reset", "g", "orders", "--to", "0001-01-01T00:00:00", "--dry-run")
    assert r.exit_code == 2 and "is not earliest, latest" in r.output
    r = cli("status", "g", "--stuck-after", "inf", "--check")
    assert r.exit_code == 2 and "--stuck-after" in r.output


def test_message_data_with_brackets_is_shown_not_taken_for_markup(settings: Settings, producer: Producer) -> None:
    """rich read '[/api/orders]' in a property, or in a bad line quoted by produce's report, as a
    closing tag: MarkupError, exit 1, and produce's report of what it sent was lost (found by a
    review)."""
    producer.create_topic("br", queues=1)
    producer.send_orderly("br", b"x", sharding_key="k", properties={"path": "[/api/orders]"})
    r = cli("message", "show", "br", "--queue", "0", "--offset", "0")
    assert r.exit_code == 0 and "[/api/orders]" in r.output
    data = '{"k": "a"}\n{"k": "b", "path": "[/api/orders]"\n{"k": "c"}\n'
    r = cli("produce", "br", "--key-field", "k", "--skip-bad", input=data)
    assert r.exit_code == 2 and "[/api/orders]" in r.output and "sent 2 messages" in r.output


def test_offsets_and_limits_past_any_stream_id_name_the_option(settings: Settings, producer: Producer) -> None:
    """Once they reached Redis and came back as "Invalid stream ID" without saying which option
    (found by a review)."""
    producer.create_topic("big", queues=1)
    for args, option in ((("dlq", "list", "g", "--limit", "99999999999999999999"), "--limit"),
                         (("dlq", "list", "g", "--from", "99999999999999999999"), "--from"),
                         (("dlq", "show", "g", "--offset", "99999999999999999999"), "--offset"),
                         (("message", "show", "big", "--queue", "0", "--offset", "99999999999999999999"), "--offset")):
        r = cli(*args)
        assert r.exit_code == 2 and option in r.output and "Invalid stream ID" not in r.output, (args, r.output)


def test_enum_options_take_any_case_as_the_data_source_and_publish_do() -> None:
    """`--on-null SKIP` was refused while option('onNull', 'SKIP') and publish(on_null='SKIP')
    took it (a data engineer's walk-through)."""
    import typer

    from mqorder.cli.common import enum_parser
    from mqorder.cli.pipeline import OnNull

    parse = enum_parser(OnNull, "--on-null")
    assert parse("SKIP") is OnNull.SKIP and parse("skip") is OnNull.SKIP and parse("Fail") is OnNull.FAIL
    with pytest.raises(typer.BadParameter, match="--on-null must be one of fail, skip, got 'drop'"):
        parse("drop")


def test_consumers_and_doctor_show_which_mqorder_each_client_runs(
    redis_url: str, settings: Settings, producer: Producer
) -> None:
    """A rolling upgrade (an upgrade walk-through): neither `consumers` nor `doctor` could tell a
    cluster ran two versions. Each client registers its version and scripts' digest now; one
    registered by an older mqorder has none."""
    from mqorder.rebalance.membership import client_version

    producer.create_topic("tv", queues=2)
    TopicManager(producer.brokers).subscribe("gv", "tv", MessageModel.CLUSTERING)
    reg = ClientRegistry(producer.brokers.meta, settings.heartbeat_timeout_ms)
    for cid in ("new@h", "old@h"):
        reg.register(cid, [Subscription("gv", "tv", MessageModel.CLUSTERING)], ClientDetails(pool="prefork"))
    producer.brokers.meta.hdel(keys.client_info("old@h"), "version")  # as an older mqorder registers
    got = {c["client_id"]: c["version"] for c in cli_json("consumers", "gv")["consumers"]}
    assert got == {"new@h": client_version(), "old@h": ""}
    human = cli("consumers", "gv")
    assert "mixed versions among the live consumers" in human.stdout
    found = {f["check"]: f for f in cli_json("doctor", "--app", "")["findings"]}
    assert found["versions"]["verdict"] == "WARN" and "old@h" in found["versions"]["detail"]
    producer.brokers.meta.hset(keys.client_info("old@h"), "version", client_version())  # upgraded
    found = {f["check"]: f for f in cli_json("doctor", "--app", "")["findings"]}
    assert found["versions"]["verdict"] == "OK"


def test_group_list_shows_every_group_and_check_fails_on_a_stuck_one(
    redis_url: str, settings: Settings, producer: Producer, r: redis.Redis
) -> None:
    """An operator of 60 groups ran `status` 60 times to learn whether anything was stuck, and no
    command listed the groups (a walk-through). `group list` shows them all in one call."""
    assert "no consumer group yet" in cli("group", "list").stdout
    producer.create_topic("ta", queues=2)
    producer.create_topic("tb", queues=1)
    topics = TopicManager(producer.brokers)
    topics.subscribe("ga", "ta", MessageModel.CLUSTERING)
    topics.subscribe("gb", "tb", MessageModel.CLUSTERING)
    topics.subscribe("gb", "ta", MessageModel.CLUSTERING)
    ClientRegistry(producer.brokers.meta, settings.heartbeat_timeout_ms).register(
        "w@h", [Subscription("ga", "ta", MessageModel.CLUSTERING)], ClientDetails(pool="prefork"))
    producer.send_orderly("tb", b"x", sharding_key="k")
    got = {g["group"]: g for g in cli_json("group", "list")["groups"]}
    assert set(got) == {"ga", "gb"}
    assert (got["ga"]["topics"], got["ga"]["live_consumers"], got["ga"]["lanes"], got["ga"]["lag"]) == (["ta"], 1, 2, 0)
    assert (got["gb"]["topics"], got["gb"]["live_consumers"], got["gb"]["lanes"], got["gb"]["lag"]) == (
        ["ta", "tb"], 0, 3, 1)
    assert cli("group", "list", "--check").exit_code == 0  # gb's message waits, but not for a minute
    time.sleep(0.05)
    stuck = cli("group", "list", "--check", "--stuck-after", "0.01")
    assert stuck.exit_code == 1 and "STUCK: gb" in stuck.stdout

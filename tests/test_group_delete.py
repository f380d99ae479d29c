"""``mqorder group delete`` (RocketMQ's deleteSubGroup) on a real redis-server: a retired group no
longer holds back retention nor shows in ``topic list`` / ``status``, a live one is refused, and
real Celery workers of other groups keep consuming. Also the worker's log for a ConsumeRequest of
a removed listener, and ``offsets reset`` starting a new group at the end of a topic."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from typer.testing import CliRunner, Result

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.cli import app
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.rebalance.membership import ClientRegistry, Subscription
from mqorder.retention.trimmer import RetentionTrimmer
from mqorder.settings import Settings, load_settings
from mqorder.store.topics import TopicManager
from tests.support import Cluster, body, ledger, wait_for

S = ConsumeOrderlyStatus


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


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


def groups_of(listed: list[dict[str, Any]], topic: str) -> list[str]:
    """The groups ``topic list --json`` shows for ``topic``."""
    return next(t["groups"] for t in listed if t["topic"] == topic)


def consume_all(engine: ConsumerEngine, group: str, mqs: list[MessageQueue]) -> list[int]:
    """One real ConsumeRequest run of ``group`` on each of ``mqs`` (assigned to c1 first)."""
    seen: list[int] = []
    RebalanceLockManager(engine.brokers).assign(group, [(mq, "c1", f"tok-{mq.queue_id}") for mq in mqs])
    for mq in mqs:
        spec = ListenerSpec(lambda m, c: seen.extend(x.queue_offset for x in m) or S.SUCCESS, mq.topic, group)
        ConsumeRequest(engine, spec, group, mq, f"tok-{mq.queue_id}").run()
    return seen


def test_deleting_a_retired_group_frees_retention_status_list_and_topic_delete(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine, settings: Settings
) -> None:
    producer.create_topic("orders", queues=2, retention_policy="consumed", retention_ms=3_600_000,
                          retention_min_ms=0)
    topics = TopicManager(engine.brokers)
    for g in ("live", "retired"):
        topics.subscribe(g, "orders", MessageModel.CLUSTERING)
    topics.ensure_retry_topic("retired")
    topics.subscribe("retired", keys.retry_topic("retired"), MessageModel.CLUSTERING)
    mqs = producer.describe_topic("orders").message_queues
    for i in range(6):
        producer.send_orderly("orders", b"x", sharding_key=str(i))
    consume_all(engine, "retired", mqs)  # retired consumed 6, then its listener was removed
    for i in range(4):
        producer.send_orderly("orders", b"y", sharding_key=str(i))
    consume_all(engine, "live", mqs)  # live consumed all 10
    r.xadd(keys.ledger("retired"), {"o": "1"})
    ClientRegistry(engine.brokers.meta, 60_000).register("c9", [Subscription("live", "orders", MessageModel.CLUSTERING)])
    assert cli_json("status", "retired", "orders")["lag"] == 4
    holders = RetentionTrimmer(engine.brokers, settings).run().holders["orders"]
    assert holders == ["live", "retired"]  # "held back by live, retired"
    assert groups_of(cli_json("topic", "list"), "orders") == ["live", "retired"]
    state = [keys.sub_state(mq.tag, "retired") for mq in mqs]
    assert all(r.exists(k) for k in state)
    topology = int(r.get(keys.topology_version()) or 0)

    refused = cli("group", "delete", "live")
    assert refused.exit_code == 1
    assert "group 'live' has live consumer(s) subscribed to orders: c9" in refused.stderr and "--force" in refused.stderr
    assert r.hexists(keys.groups(), "live")

    dry = cli_json("group", "delete", "retired", "--dry-run")
    assert dry["dry_run"] and dry["whole_group"] and dry["keys_by_kind"]["state"] == 2 and dry["ledger_keys"] == 1
    assert [t["topic"] for t in dry["deleted_topics"]] == [keys.retry_topic("retired")]
    assert dry["dlq_kept"] == keys.dlq_topic("retired")
    assert all(r.exists(k) for k in state) and r.hexists(keys.groups(), "retired")

    human = cli("group", "delete", "retired")
    assert human.exit_code == 0, human.stderr
    assert "deleted group retired on %RETRY%retired, orders" in human.stdout
    assert "kept %DLQ%retired (0 dead letters)" in human.stdout
    assert not r.hexists(keys.groups(), "retired") and not any(r.exists(k) for k in state)
    assert not r.sismember(keys.topic_subs("orders"), "retired") and not r.hexists(keys.retention_seen(), "retired")
    assert not r.exists(keys.assignment("retired")) and not r.exists(keys.stats("retired"))
    assert not r.exists(keys.ledger("retired"))
    assert not r.exists(keys.topic_route(keys.retry_topic("retired")))
    assert r.exists(keys.topic_route(keys.dlq_topic("retired")))  # kept: no --with-dlq
    assert int(r.get(keys.topology_version())) > topology  # workers rebalance at once

    assert RetentionTrimmer(engine.brokers, settings).run().holders["orders"] == ["live"]
    assert groups_of(cli_json("topic", "list"), "orders") == ["live"]
    gone = cli("status", "retired")
    assert gone.exit_code == 2 and "consumer group 'retired' does not exist" in gone.stderr
    assert cli_json("status", "live")["lag"] == 0  # the other group untouched
    assert all(r.exists(keys.sub_state(mq.tag, "live")) for mq in mqs)
    refused = cli("topic", "delete", "orders")
    assert refused.exit_code == 1 and "subscribed by group(s) live;" in refused.stderr

    assert cli("group", "delete", "retired").exit_code == 2  # gone: an unknown group now


def test_deleting_one_topic_of_a_group_keeps_the_rest_and_with_dlq_needs_the_whole_group(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    for t in ("a", "b"):
        producer.create_topic(t, queues=1)
        producer.send_orderly(t, b"x", sharding_key="k")
        TopicManager(engine.brokers).subscribe("g", t, MessageModel.CLUSTERING)
        consume_all(engine, "g", producer.describe_topic(t).message_queues)
    qa, qb = (MessageQueue(t, "broker-a", 0) for t in ("a", "b"))
    r.hset(keys.assignment("g"), mapping={qa.key: "c9", qb.key: "c9"})  # the rebalance's hints
    r.hset(keys.stats("g"), mapping={f"{qa.key}#consumed": 1, f"{qb.key}#consumed": 1})
    # A live consumer of g on b only: deleting g's subscription to a is not refused.
    ClientRegistry(engine.brokers.meta, 60_000).register("c9", [Subscription("g", "b", MessageModel.CLUSTERING)])

    bad = cli("group", "delete", "g", "--topic", "a", "--with-dlq")
    assert bad.exit_code == 2 and "it also subscribes to b" in bad.stderr
    nope = cli("group", "delete", "g", "--topic", "zzz")
    assert nope.exit_code == 2 and "topic 'zzz' does not exist" in nope.stderr

    done = cli_json("group", "delete", "g", "--topic", "a")
    assert done["topics"] == {"a": "CLUSTERING"} and not done["whole_group"] and done["keys_by_kind"]["state"] == 1
    assert json.loads(r.hget(keys.groups(), "g")) == {"b": "CLUSTERING"}
    assert not r.exists(keys.sub_state(qa.tag, "g")) and r.exists(keys.sub_state(qb.tag, "g"))
    assert done["assignment_fields"] == 1 and done["stats_fields"] >= 1
    assert [f.decode() for f in r.hkeys(keys.assignment("g"))] == [qb.key]
    stats = [f.decode() for f in r.hkeys(keys.stats("g"))]
    assert f"{qb.key}#consumed" in stats and not any(f.startswith("a:") for f in stats)
    assert r.exists(keys.topic_route(keys.dlq_topic("g")))

    refused = cli("group", "delete", "g")
    assert refused.exit_code == 1 and "c9" in refused.stderr
    forced = cli_json("group", "delete", "g", "--force", "--with-dlq")
    assert forced["live_consumers"] == ["c9"] and [t["topic"] for t in forced["deleted_topics"]] == ["%DLQ%g"]
    assert not r.hexists(keys.groups(), "g") and not r.exists(keys.topic_route(keys.dlq_topic("g")))
    assert not r.exists(keys.sub_state(qb.tag, "g"))


def test_offsets_reset_starts_a_group_with_no_consumer_yet_at_the_end(
    redis_url: str, r: redis.Redis, producer: Producer, engine: ConsumerEngine
) -> None:
    """RocketMQ's CONSUME_FROM_LAST_OFFSET: ``offsets reset NEW orders --to latest`` before the
    new group's first consumer; it was refused (exit 2, unknown group)."""
    producer.create_topic("orders", queues=2)
    for i in range(5):
        producer.send_orderly("orders", b"old", sharding_key=str(i))
    mqs = producer.describe_topic("orders").message_queues

    plan = cli_json("offsets", "reset", "fresh", "orders", "--to", "latest", "--dry-run")
    assert plan["subscribed"] and sum(q["new_offset"] for q in plan["queues"]) == 5
    assert not r.hexists(keys.groups(), "fresh")  # a dry run records nothing

    human = cli("offsets", "reset", "fresh", "orders", "--to", "latest")
    assert human.exit_code == 0, human.stderr
    assert "recorded its subscription (clustering)" in human.stdout
    assert json.loads(r.hget(keys.groups(), "fresh")) == {"orders": "CLUSTERING"}
    sent = producer.send_orderly("orders", b"new", sharding_key="0")
    assert consume_all(engine, "fresh", mqs) == [sent.queue_offset] and sent.queue_offset > 0  # only the new one
    bad = cli("offsets", "reset", "bad name", "orders", "--to", "latest")
    assert bad.exit_code == 2 and not r.hexists(keys.groups(), "bad name")


@pytest.mark.e2e
def test_a_retired_group_is_deleted_under_running_workers_of_other_groups(cluster: Cluster, r: redis.Redis) -> None:
    """A real worker (tests.listeners: g-order on t-order) keeps consuming while a retired group
    of the same topic is deleted; a stale ConsumeRequest of the retired group is dropped with a
    WARNING (it was an ERROR telling to import a module), and the live group is refused."""
    from celery import Celery

    from mqorder.celery.dispatch import dispatch
    from mqorder.celery.setup import install

    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    TopicManager(p.brokers).subscribe("g-retired", "t-order", MessageModel.CLUSTERING)
    w = cluster.start_worker("w1", concurrency=2)
    p.send_orderly_batch("t-order", [(f"k{i % 4}", body(f"k{i % 4}", i // 4 + 1)) for i in range(40)])
    wait_for(lambda: len([e for e in ledger(r, "g-order") if e["ok"]]) >= 40, timeout=60, what="40 handled")
    assert cli_json("status", "g-retired")["lag"] == 40

    refused = cli("group", "delete", "g-order")
    assert refused.exit_code == 1 and w.hostname in refused.stderr
    done = cli_json("group", "delete", "g-retired")
    assert done["whole_group"] and done["live_consumers"] == []
    assert groups_of(cli_json("topic", "list"), "t-order") == ["g-order"]

    app = install(Celery("t-stale", set_as_current=False))
    try:
        dispatch(app, "g-retired", MessageQueue("t-order", "broker-a", 0).key, "tok-stale", w.hostname)
    finally:
        app.close()
    p.send_orderly_batch("t-order", [(f"k{i % 4}", body(f"k{i % 4}", i // 4 + 11)) for i in range(40)])
    wait_for(lambda: len([e for e in ledger(r, "g-order") if e["ok"]]) >= 80, timeout=60, what="80 handled")
    entries = [e for e in ledger(r, "g-order") if e["ok"]]
    for k in range(4):
        seqs = [e["seq"] for e in entries if e["key"] == f"k{k}"]
        assert seqs == sorted(seqs) and len(set(seqs)) == 20
    logged = wait_for(lambda: "stale ConsumeRequest for group 'g-retired'" in (cluster.tmp / "w1.log").read_text()
                      and (cluster.tmp / "w1.log").read_text(), timeout=30, what="the stale request logged")
    line = next(x for x in logged.splitlines() if "stale ConsumeRequest" in x)
    assert "WARNING" in line and "mqorder group delete g-retired" in line
    assert "has no listener for group 'g-retired'" not in logged  # the old ERROR
    p.close()


def test_a_request_without_a_listener_is_stale_unless_this_node_is_registered_for_it(
    redis_url: str, engine: ConsumerEngine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WARNING for a removed listener; ERROR when the registry says this node name consumes the
    group on the topic while this process has no listener (two apps under one node name)."""
    from mqorder.celery import tasks

    monkeypatch.setattr(tasks, "_service", None)
    # This test's store, not that of whichever Celery app an earlier test of this process left
    # current (settings_of() reads the current app's): it failed when run after such a test.
    monkeypatch.setattr(tasks, "settings_of", lambda app=None: load_settings(redis_url=redis_url))
    ClientRegistry(engine.brokers.meta, 60_000).register("w2", [Subscription("g", "t", MessageModel.CLUSTERING)])
    with caplog.at_level(logging.WARNING, logger="mqorder.celery.tasks"):
        assert tasks._no_listener("w1", "g", "t") == {"verb": "STALE_REQUEST"}
        assert tasks._no_listener("w2", "g", "t") == {"verb": "NO_LISTENER"}
    stale, wrong = caplog.records
    assert stale.levelname == "WARNING" and "the group's live consumers of the topic (w2)" in stale.getMessage()
    assert wrong.levelname == "ERROR" and "node w2 is registered as consuming it" in wrong.getMessage()
    assert "same Celery node name" in wrong.getMessage()
    monkeypatch.setattr(tasks, "_service", None)

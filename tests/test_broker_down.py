"""One broker of several down: the lock manager and the rebalance still do the healthy brokers'
part. Each multi-broker step once raised at the first failing broker, after the scripts of the
brokers before it had run: their replies were thrown away (a sweep armed a pending token nobody
sent, a rebalance moved a queue and dispatched nothing, lock_all renewed nothing after a down
broker that sorted first). Found by a review; real redis-server, a dead port for the other broker."""

from __future__ import annotations

import logging

import pytest
import redis

from mqorder import keys
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager, Redispatch
from mqorder.store.brokers import BrokerRegistry

DEAD = "redis://127.0.0.1:1/0"  # nothing listens there


@pytest.fixture
def two(redis_url: str):
    b = BrokerRegistry(redis_url, {"broker-b": DEAD, "broker-0": DEAD})  # broker-0 sorts first
    yield b
    b.close()


A0, B0, Z0 = MessageQueue("t", "broker-a", 0), MessageQueue("t", "broker-b", 0), MessageQueue("t", "broker-0", 0)


def test_a_sweep_returns_the_healthy_brokers_redispatch(two: BrokerRegistry, caplog) -> None:
    locks = RebalanceLockManager(two)
    assert locks.assign("g", [(A0, "c1", "x")]) == {A0: "MOVED"}
    two.get("broker-a").client.set(keys.queue_next(A0.tag), 5)  # a backlog and no request
    with caplog.at_level(logging.WARNING):
        got = locks.sweep("g", [(Z0, "tok-z"), (A0, "tok-a"), (B0, "tok-b")], "c1")
    assert got == [Redispatch(A0, "c1", "tok-a")]
    assert "sweep: broker 'broker-0' failed" in caplog.text and "broker 'broker-b' failed" in caplog.text


def test_a_rebalance_step_applies_the_healthy_broker(two: BrokerRegistry) -> None:
    locks = RebalanceLockManager(two)
    two.get("broker-a").client.set(keys.queue_next(A0.tag), 5)
    got = locks.assign("g", [(A0, "c2", "tok-a"), (B0, "c2", "tok-b")], dead_clients=["c1"])
    assert got == {A0: "DISPATCH"}  # broker-b's queue: no outcome, the next rebalance applies it


def test_lock_renewal_renews_the_healthy_broker_after_a_down_one(two: BrokerRegistry) -> None:
    locks = RebalanceLockManager(two, lock_max_live_time_ms=60_000)
    epoch = locks.try_lock_batch("g", [A0], "c1")[A0]
    c = two.get("broker-a").client
    c.hset(keys.sub_state(A0.tag, "g"), "lease", 1)  # about to lapse... by a lot
    assert locks.try_lock_lanes([("g", sorted([A0, Z0]))], "c1") == [{A0: int(c.hget(keys.sub_state(A0.tag, "g"), "epoch"))}]
    assert int(c.hget(keys.sub_state(A0.tag, "g"), "lease")) > 1
    assert locks.try_lock_batch("g", [Z0, A0], "c1") == {A0: int(c.hget(keys.sub_state(A0.tag, "g"), "epoch"))}
    assert int(c.hget(keys.sub_state(A0.tag, "g"), "epoch")) >= epoch
    assert locks.unlock_batch("g", [Z0, A0], "c1") == {A0}


def test_every_broker_down_still_raises(redis_url: str) -> None:
    dead = BrokerRegistry(DEAD)
    try:
        with pytest.raises(redis.ConnectionError):
            RebalanceLockManager(dead).sweep("g", [(A0, "tok")], "c1")
    finally:
        dead.close()


def test_a_rebalance_with_one_broker_down_dispatches_and_hints_the_healthy_queues(two: BrokerRegistry, settings) -> None:
    from mqorder.rebalance.membership import ClientRegistry, Subscription
    from mqorder.rebalance.service import RebalanceService

    svc = RebalanceService(two, settings)
    svc.topics.create_topic("t", 1, brokers=["broker-a", "broker-b"])  # routes live on the default broker
    svc.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    ClientRegistry(two.meta, settings.heartbeat_timeout_ms).register("c2", [Subscription("g", "t", MessageModel.CLUSTERING)])
    # c1 held A0 (a backlog on the healthy broker) and died: its heartbeat lapsed.
    svc.locks.assign("g", [(A0, "c1", "x")])
    two.meta.hset(keys.assignment("g"), A0.key, "c1")
    two.meta.zadd(keys.clients(), {"c1": 1})
    two.meta.set(keys.queue_next(A0.tag), 3)
    report = svc.rebalance()
    assert [(d.mq, d.client) for d in report.dispatches] == [(A0, "c2")]
    assert A0 in svc.assigned_queues("g", "c2")  # the hint names the live client
    assert svc.lock_all("c2", ["g"]) == 1  # which renews A0 (broker-b's queue fails, logged)


def test_a_rebalance_goes_on_past_a_lane_whose_every_broker_is_down(two: BrokerRegistry, settings, caplog) -> None:
    """A topic that lives only on the down broker made ``assign`` raise for its lane, and the
    rebalance stopped there: the lanes after it (healthy brokers' topics) were never assigned and
    no hint was written, for as long as the outage lasted."""
    from mqorder.rebalance.membership import ClientRegistry, Subscription
    from mqorder.rebalance.service import RebalanceService

    svc = RebalanceService(two, settings)
    svc.topics.create_topic("a-dead", 1, brokers=["broker-0"])  # sorts before "t"
    svc.topics.create_topic("t", 2)
    subs = [Subscription("g", t, MessageModel.CLUSTERING) for t in ("a-dead", "t")]
    for t in ("a-dead", "t"):
        svc.topics.subscribe("g", t, MessageModel.CLUSTERING)
    ClientRegistry(two.meta, settings.heartbeat_timeout_ms).register("c1", subs)
    with caplog.at_level(logging.WARNING):
        report = svc.rebalance()
    assert [mq for mq in svc.assigned_queues("g", "c1") if mq.topic == "t"] == [A0, MessageQueue("t", "broker-a", 1)]
    assert report.assigned == 3  # the down lane's queue too: its decision stands, applied next time
    assert "rebalance: lane 'g/a-dead' failed" in caplog.text


def test_beat_lock_all_renews_the_clients_after_one_whose_every_broker_is_down(two: BrokerRegistry, settings) -> None:
    from mqorder.rebalance.membership import ClientRegistry, Subscription
    from mqorder.rebalance.service import RebalanceService

    svc = RebalanceService(two, settings)
    reg = ClientRegistry(two.meta, settings.heartbeat_timeout_ms)
    reg.register("c1", [Subscription("g1", "t", MessageModel.CLUSTERING)])  # registered first: renewed first
    reg.register("c2", [Subscription("g2", "t", MessageModel.CLUSTERING)])
    two.meta.hset(keys.assignment("g1"), Z0.key, "c1")  # c1 holds only a queue of the down broker
    two.meta.hset(keys.assignment("g2"), A0.key, "c2")
    assert svc.lock_all_clients() == 1
    assert two.meta.hget(keys.sub_state(A0.tag, "g2"), "owner") == b"c2"
    two.meta.delete(keys.assignment("g2"))
    two.meta.hset(keys.assignment("g2"), Z0.key, "c2")
    with pytest.raises(redis.ConnectionError):  # nobody renewed anything: the error, as one broker sees it
        svc.lock_all_clients()

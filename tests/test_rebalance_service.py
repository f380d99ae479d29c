"""RebalanceService: its mutex (redis-py's ``Lock``) and its sweep, against a real redis-server."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance import service as service_mod
from mqorder.rebalance.service import RebalanceReport, RebalanceService
from mqorder.store.brokers import BrokerRegistry

MQ = MessageQueue("t", "broker-a", 0)


@pytest.fixture
def brokers(redis_url: str) -> Iterator[BrokerRegistry]:
    b = BrokerRegistry(redis_url)
    yield b
    b.close()


class SlowRebalance(RebalanceService):
    """A rebalance that outlives its mutex, which another rebalance then takes."""

    def _rebalance(self) -> RebalanceReport:
        time.sleep(0.3)
        assert self.brokers.meta.set(keys.rebalance_mutex(), "next-rebalance", nx=True, px=30_000)
        return super()._rebalance()


def test_rebalance_takes_and_releases_the_mutex(brokers: BrokerRegistry, settings, r: redis.Redis) -> None:
    report = RebalanceService(brokers, settings).rebalance()
    assert report.dispatches == [] and report.took_ms > 0
    assert r.get(keys.rebalance_mutex()) is None
    assert r.get(keys.rebalance_last()) is not None


def test_rebalance_skips_with_an_empty_report_while_another_holds_the_mutex(
    brokers: BrokerRegistry, settings, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    r.set(keys.rebalance_mutex(), "other", px=30_000)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=service_mod.__name__):
        report = RebalanceService(brokers, settings).rebalance(wait_s=0.2)
    assert 0.1 < time.monotonic() - t0 < 2
    assert report == RebalanceReport([], [], skipped=True)  # the caller knows to try again
    assert "rebalance skipped" in caplog.text
    assert r.get(keys.rebalance_mutex()) == b"other"  # the holder's mutex is untouched
    assert r.get(keys.rebalance_last()) is None


def test_rebalance_that_outlived_its_mutex_still_returns_and_spares_the_next_holder(
    brokers: BrokerRegistry, settings, r: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    svc = SlowRebalance(brokers, settings)
    svc.mutex_timeout_s = 0.2
    with caplog.at_level(logging.WARNING, logger=service_mod.__name__):
        report = svc.rebalance()
    assert report.dispatches == [] and report.took_ms > 0  # the work done is reported, no LockError
    assert "mutex lapsed" in caplog.text
    assert r.get(keys.rebalance_mutex()) == b"next-rebalance"  # not deleted by the late release
    assert r.get(keys.rebalance_last()) is not None


class MutexWatchingRebalance(RebalanceService):
    """Reads the mutex's remaining life while it holds it."""

    pttl_ms = -1

    def _rebalance(self) -> RebalanceReport:
        self.pttl_ms = int(self.brokers.meta.pttl(keys.rebalance_mutex()))
        return super()._rebalance()


@pytest.mark.parametrize("heartbeat_timeout_ms", [3000, 1500])
def test_a_rebalance_mutex_lapses_with_its_holders_heartbeat(brokers: BrokerRegistry, redis_url: str,
                                                             heartbeat_timeout_ms: int) -> None:
    """A worker killed mid-rebalance must not hold failover back past the time its death is seen:
    the mutex's lease is the holder's liveness lease (``heartbeat_timeout_ms``), not a longer constant."""
    from mqorder.settings import load_settings

    s = load_settings(redis_url=redis_url, heartbeat_timeout_ms=heartbeat_timeout_ms, heartbeat_interval_ms=500)
    svc = MutexWatchingRebalance(brokers, s)
    svc.rebalance()
    assert 0 < svc.pttl_ms <= heartbeat_timeout_ms
    assert svc.pttl_ms > heartbeat_timeout_ms - 1000  # taken with that lease just now


def test_service_sweep_dispatches_an_assigned_backlog_through_the_lock_manager(
    brokers: BrokerRegistry, settings, r: redis.Redis
) -> None:
    svc = RebalanceService(brokers, settings)
    svc.locks.try_lock_batch("g", [MQ], "c1")
    r.hset(keys.assignment("g"), MQ.key, "c1")
    r.set(keys.queue_next(MQ.tag), 2)
    (d,) = svc.sweep(["g"], "c1")
    assert (d.sub, d.mq, d.client) == ("g", MQ, "c1")
    assert r.hget(keys.sub_state(MQ.tag, "g"), "pending") == d.token.encode()
    assert svc.sweep(["g"]) == []  # its request is pending now


def test_a_group_on_two_topics_keeps_the_assignment_of_both(brokers: BrokerRegistry, settings) -> None:
    from mqorder.model import MessageModel
    from mqorder.rebalance.membership import Subscription
    from mqorder.store.topics import TopicManager

    tm = TopicManager(brokers)
    tm.create_topic("ta", 2)
    tm.create_topic("tb", 3)
    svc = RebalanceService(brokers, settings)
    svc.registry.register("c1", [Subscription("g", "ta", MessageModel.CLUSTERING),
                                 Subscription("g", "tb", MessageModel.CLUSTERING)])
    svc.rebalance()
    # lock_all, the sweep and a clean leave all read this: it must name the queues of both topics.
    assert {mq.topic for mq in svc.assigned_queues("g", "c1")} == {"ta", "tb"}
    assert len(svc.assigned_queues("g", "c1")) == 5
    assert svc.lock_all("c1", ["g"]) == 5


def test_the_assignment_parsed_once_per_change_still_follows_every_change(
    brokers: BrokerRegistry, settings, r: redis.Redis
) -> None:
    """The service keeps the parsed assignment while the hash is unchanged (issue 27's idle cost),
    and a queue assigned, moved or removed since is seen at the next read, whoever wrote it."""
    svc = RebalanceService(brokers, settings)
    other = MessageQueue("t", "broker-a", 1)
    r.hset(keys.assignment("g"), MQ.key, "c1")
    assert svc.assigned_queues("g", "c1") == [MQ]
    first = svc.assigned_queues("g", "c1")
    first.append(other)  # a caller's list is its own: the kept copy does not change
    assert svc.assigned_queues("g", "c1") == [MQ]
    r.hset(keys.assignment("g"), other.key, "c1")
    assert svc.assigned_queues("g", "c1") == [MQ, other]
    r.hset(keys.assignment("g"), MQ.key, "c2")
    assert svc.assigned_queues("g", "c1") == [other]
    assert svc.assigned_queues("g") == [MQ, other]
    r.delete(keys.assignment("g"))
    assert svc.assigned_queues("g", "c1") == []


def test_topics_described_and_their_subscriptions_read_in_one_go_match_one_by_one(brokers: BrokerRegistry) -> None:
    """The trimmer's batched reads (issue 27): the same routes and subscriptions as one topic at a
    time, and a topic that does not exist left out rather than raised."""
    from mqorder.model import MessageModel
    from mqorder.store.topics import TopicManager

    tm = TopicManager(brokers)
    tm.create_topic("ta", 2)
    tm.create_topic("tb", 3)
    tm.subscribe("g", "ta", MessageModel.CLUSTERING)
    tm.subscribe("h", "ta", MessageModel.CLUSTERING)
    routes = tm.describe_topics(["ta", "gone", "tb"])
    assert list(routes) == ["ta", "tb"]
    assert routes["ta"] == tm.describe_topic("ta") and routes["tb"] == tm.describe_topic("tb")
    assert tm.subs_of_topics(["ta", "tb"]) == {"ta": ["g", "h"], "tb": []}
    assert tm.describe_topics([]) == {} and tm.subs_of_topics([]) == {}


class WritesStopAfterRebalance(RebalanceService):
    """Redis stops taking writes once the assignment is applied (CLIENT PAUSE WRITE): recording
    the rebalance's time and releasing its mutex then time out."""

    def _rebalance(self) -> RebalanceReport:
        report = super()._rebalance()
        self.brokers.meta.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        return report


def test_a_rebalance_applied_keeps_its_report_when_its_bookkeeping_fails(
    redis_url: str, settings, r: redis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """Once the applied rebalance's report (its dispatches) was lost when recording its time or
    releasing the mutex raised: the dispatched queues waited pending_ttl_ms and a sweep."""
    b = BrokerRegistry(redis_url, socket_timeout=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger=service_mod.__name__):
            report = WritesStopAfterRebalance(b, settings).rebalance()
        assert report.took_ms > 0 and not report.skipped
        assert "recording its time failed" in caplog.text and "mutex not released" in caplog.text
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        b.close()

"""A worker joining its group (``ClientInstance._register``) while a topic is created: the topic's
queues are taken at the next heartbeat, not after the 40 s stale fallback. Found as a flake of
``test_e2e``'s "topic created while workers run" on a loaded machine: the join read the topology
version after its rebalance, so a topic created during the rebalance was in the fingerprint but in
no assignment, and no later heartbeat saw a change."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import tests.listeners  # noqa: F401 -- registers g-late on t-late (the topic created mid-join)
from mqorder import Producer
from mqorder.consumer.client_instance import ClientInstance
from mqorder.settings import load_settings


def test_a_topic_created_during_the_join_s_rebalance_is_taken_at_the_next_heartbeat(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(redis_url=redis_url)
    client = ClientInstance("w1@join", s, dispatch=lambda *a: True)
    p = Producer(settings=s)
    rebalance = client._rebalance_now

    def rebalance_then_a_topic_appears(wait_s: float = 1.0) -> bool:
        done = rebalance(wait_s)
        p.create_topic("t-late", queues=4)  # by another process, right after this rebalance read
        return done

    monkeypatch.setattr(client, "_rebalance_now", rebalance_then_a_topic_appears)
    try:
        client._register()
        assert client.service.assigned_queues("g-late", client.client_id) == []  # not in that rebalance
        monkeypatch.setattr(client, "_rebalance_now", rebalance)
        client._watch_membership()  # the next heartbeat's check
        assert len(client.service.assigned_queues("g-late", client.client_id)) == 4
    finally:
        client.service.registry.unregister(client.client_id)
        p.close()
        client.brokers.close()


def test_a_rebalance_that_raised_is_tried_again_at_the_next_heartbeat(redis_url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker that set the change's marker had its rebalance fail (the broker went away for a
    moment): the other workers had skipped on the marker, and its own next heartbeat found the
    marker held and took the change as seen. Nobody rebalanced until the 40 s stale fallback."""
    import redis

    s = load_settings(redis_url=redis_url)
    client = ClientInstance("w1@retry", s, dispatch=lambda *a: True)
    p = Producer(settings=s)
    rebalance = client.service.rebalance
    try:
        client._register()
        p.create_topic("t-late", queues=4)

        def lost(*a: object, **k: object) -> object:
            raise redis.ConnectionError("the broker went away for a moment")

        monkeypatch.setattr(client.service, "rebalance", lost)
        with pytest.raises(redis.ConnectionError):
            client._watch_membership()  # the duty loop logs it and backs off
        monkeypatch.setattr(client.service, "rebalance", rebalance)
        client._watch_membership()
        assert len(client.service.assigned_queues("g-late", client.client_id)) == 4
    finally:
        client.service.registry.unregister(client.client_id)
        p.close()
        client.brokers.close()


def test_a_topic_deleted_and_created_again_while_the_worker_runs_is_subscribed_again(redis_url: str) -> None:
    """`topic delete --force` removes the topic's subscriptions; the topic created again was
    consumed by the running worker while `status` and `consumers` said the group did not exist (an
    operator walk-through). The worker's next heartbeat after the topology change records it again."""
    from typer.testing import CliRunner

    from mqorder.cli import app

    def cli(*args: str):
        return CliRunner().invoke(app, ["--redis-url", redis_url, *args], catch_exceptions=False)

    s = load_settings(redis_url=redis_url)
    p = Producer(settings=s)
    p.create_topic("t-late", queues=4)
    client = ClientInstance("w1@again", s, dispatch=lambda *a: True)
    try:
        client._register()
        assert cli("status", "g-late", "t-late").exit_code == 0
        assert cli("topic", "delete", "t-late", "--force").exit_code == 0
        client._watch_membership()  # the delete changed the topology: nothing to restore yet
        assert "t-late" not in client.service.topics.groups().get("g-late", {})
        p.create_topic("t-late", queues=4)
        client._watch_membership()
        assert "t-late" in client.service.topics.groups()["g-late"]
        assert "g-late" in client.service.topics.subs_of_topic("t-late")
        res = cli("status", "g-late", "t-late")
        assert res.exit_code == 0, res.stderr
        assert len(client.service.assigned_queues("g-late", client.client_id)) == 4
    finally:
        client.service.registry.unregister(client.client_id)
        p.close()
        client.brokers.close()


def test_restoring_subscriptions_neither_fights_another_model_nor_gives_up_after_an_error(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review findings on the restore above: two workers with different models for one group and
    topic (a rolling deploy) rewrote each other's record at every heartbeat, each write a topology
    change (the version kept climbing); and a restore that raised was never tried again."""
    import redis

    from mqorder import keys
    from mqorder.model import MessageModel
    from mqorder.rebalance.membership import Subscription

    s = load_settings(redis_url=redis_url)
    p = Producer(settings=s)
    p.create_topic("t-flip", queues=2)
    meta = redis.Redis.from_url(redis_url)

    def worker(cid: str, model: MessageModel) -> ClientInstance:
        c = ClientInstance(cid, s, dispatch=lambda *a: True)
        c.subscriptions = [Subscription("g-flip", "t-flip", model)]
        c.lanes = [keys.broadcast_sub("g-flip", cid) if model is MessageModel.BROADCASTING else "g-flip"]
        return c

    a, b = worker("old@flip", MessageModel.CLUSTERING), worker("new@flip", MessageModel.BROADCASTING)
    try:
        a._register()
        b._register()
        p.create_topic("t-other", queues=1)  # any topology change
        for _ in range(2):
            a._watch_membership()
            b._watch_membership()
        settled = meta.get(keys.topology_version())
        for _ in range(3):
            a._watch_membership()
            b._watch_membership()
        assert meta.get(keys.topology_version()) == settled

        # A restore that raised (Redis away for a moment) runs again at the next heartbeat.
        b.service.topics.subscribe("g-flip", "t-flip", MessageModel.BROADCASTING)
        meta.hdel(keys.groups(), "g-flip")
        p.create_topic("t-other2", queues=1)
        groups = a.service.topics.groups

        def away() -> object:
            raise redis.ConnectionError("Redis away for a moment")

        monkeypatch.setattr(a.service.topics, "groups", away)
        with pytest.raises(redis.ConnectionError):
            a._watch_membership()  # the duty loop logs it and backs off
        monkeypatch.setattr(a.service.topics, "groups", groups)
        a._watch_membership()
        assert "t-flip" in a.service.topics.groups()["g-flip"]
    finally:
        for c in (a, b):
            c.service.registry.unregister(c.client_id)
            c.brokers.close()
        p.close()


def test_a_client_whose_namesake_unregistered_registers_again_and_takes_its_queues_back(redis_url: str) -> None:
    """Found by a Celery operator's walk-through: a second worker started under the same node name
    (a deploy that starts the new process before the old one's warm shutdown ended) unregistered
    the name when it stopped. The survivor heartbeated on without a registration: every rebalance
    gave the group's queues to nobody, and nothing was consumed until it restarted."""
    s = load_settings(redis_url=redis_url)
    p = Producer(settings=s)
    p.create_topic("t-late", queues=4)
    survivor = ClientInstance("w1@same", s, dispatch=lambda *a: True)
    namesake = ClientInstance("w1@same", s, dispatch=lambda *a: True)
    try:
        survivor._register()
        namesake._register()
        assert len(survivor.service.assigned_queues("g-late", "w1@same")) == 4
        namesake.stop()  # its warm shutdown: unregister, rebalance away
        assert survivor.service.assigned_queues("g-late", "w1@same") == []
        survivor._watch_membership()  # the survivor's next heartbeat
        assert len(survivor.service.assigned_queues("g-late", "w1@same")) == 4
        live, _, _ = survivor.service.registry.clients()
        assert [(c.client_id, [x.group for x in c.subscriptions if x.group == "g-late"]) for c in live] == [
            ("w1@same", ["g-late"])]
    finally:
        survivor.service.registry.unregister("w1@same")
        p.close()
        survivor.brokers.close()
        namesake.brokers.close()


def test_a_client_whose_id_another_process_registered_says_so(redis_url: str, caplog) -> None:
    """Two applications' workers named alike (``w1@host``) on one Redis: the second's registration
    replaced the first's subscriptions, and the first consumed nothing more with no word of why (a
    configuration walk-through: 250 of 500 messages, and a log blaming a missing listener module).
    Its heartbeat now sees another process's registration under its id and says so."""
    s = load_settings(redis_url=redis_url)
    first = ClientInstance("w1@shared", s, dispatch=lambda *a: True)
    try:
        first._register()
        with caplog.at_level(logging.WARNING, logger="mqorder"):
            first._watch_membership()
            assert "registered by another process" not in caplog.text  # its own registration
            other = ("from mqorder.rebalance.membership import ClientRegistry; import redis; "
                     f"ClientRegistry(redis.Redis.from_url({redis_url!r}), 3000).register('w1@shared', [])")
            subprocess.run([sys.executable, "-c", other], check=True, timeout=60)
            first._watch_membership()
        assert "client id w1@shared is registered by another process" in caplog.text
        assert "celery worker -n NAME@%h" in caplog.text
    finally:
        first.service.registry.unregister("w1@shared")
        first.brokers.close()

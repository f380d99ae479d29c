"""Capacity guards against real redis-servers: an evicting Redis is refused, a full one refuses
sends clearly while consumers keep draining it, and ``mqorder doctor`` on a good and a bad Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis
from typer.testing import CliRunner, Result

from mqorder import BrokerFullError, ConsumeOrderlyStatus, EvictionPolicyError, Producer, keys
from mqorder.cli import app
from mqorder.consumer.client_instance import ClientInstance
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import get_settings, load_settings
from mqorder.store.log import MessageLog
from mqorder.testing.embedded import RedisServer

MQ = MessageQueue("t", "broker-a", 0)


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def lru_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as srv:
        monkeypatch.setenv("MQORDER_REDIS_URL", srv.url)
        get_settings.cache_clear()
        yield srv
    get_settings.cache_clear()


def test_an_evicting_redis_is_refused_by_producers_and_workers(lru_redis) -> None:
    s = load_settings(redis_url=lru_redis.url)
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    with pytest.raises(EvictionPolicyError, match=r"maxmemory-policy allkeys-lru.*noeviction.*MQORDER_ALLOW_EVICTION"):
        p.send_orderly("t", b"x", sharding_key="k")
    assert MessageLog(p.brokers).max_offset(MQ) == 0  # nothing stored
    p.close()
    client = ClientInstance("w1@test", s, dispatch=lambda *a: True)
    with pytest.raises(EvictionPolicyError, match="silent data loss"):
        client.start()
    assert client.brokers.meta.zscore(keys.clients(), "w1@test") is None  # never joined


def test_an_eviction_policy_set_after_the_start_is_refused_and_reported(redis_url, monkeypatch, caplog) -> None:
    """The policy was checked once per process: `CONFIG SET maxmemory-policy allkeys-lru` on a
    running Redis (a managed Redis's parameter change) let sends go on into an evicting Redis,
    and running workers never said a word (a durability walk-through)."""
    from mqorder.consumer import client_instance

    with RedisServer() as srv:
        s = load_settings(redis_url=srv.url)
        p = Producer(settings=s)
        p.create_topic("t", queues=1)
        assert p.send_orderly("t", b"x", sharding_key="k").queue_offset == 0
        monkeypatch.setattr(client_instance, "POLICY_CHECK_S", 0.2)
        client = ClientInstance("w1@test", s, dispatch=lambda *a: True)
        client.start()
        try:
            redis.Redis.from_url(srv.url).config_set("maxmemory-policy", "allkeys-lru")
            time.sleep(1.2)  # the producer's memory reading is at most 1 s old
            with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
                p.send_orderly("t", b"y", sharding_key="k")
            assert MessageLog(p.brokers).max_offset(MQ) == 1  # nothing more stored
            assert "maxmemory-policy allkeys-lru" in caplog.text and "w1@test" in caplog.text
        finally:
            client.stop()
            p.close()


def test_allow_eviction_lets_a_throwaway_setup_run(lru_redis, caplog) -> None:
    s = load_settings(redis_url=lru_redis.url, allow_eviction=True)
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    assert p.send_orderly("t", b"x", sharding_key="k").queue_offset == 0
    assert "may be evicted" in caplog.text
    p.close()


def test_policy_is_read_from_info_where_config_is_disabled(monkeypatch) -> None:
    with RedisServer(extra_args=["--maxmemory-policy", "volatile-lru", "--rename-command", "CONFIG", ""]) as srv:
        s = load_settings(redis_url=srv.url)
        p = Producer(settings=s)
        p.create_topic("t", queues=1)
        with pytest.raises(EvictionPolicyError, match=r"volatile-lru \(read with INFO\)"):
            p.send_orderly("t", b"x", sharding_key="k")
        p.close()


def test_a_full_redis_refuses_sends_clearly_while_consumers_keep_draining_it() -> None:
    with RedisServer() as srv:
        s = load_settings(redis_url=srv.url)
        p = Producer(settings=s)
        p.create_topic("t", queues=1)
        p.send_orderly_batch("t", [("k", b"x" * 1024) for _ in range(200)])
        r = redis.Redis.from_url(srv.url)
        used = int(r.info("memory")["used_memory"])
        # ~82 %: past the 75 % ratio, under Redis's own limit, with room for used memory to move a
        # little before the guard reads it (a client buffer freed, a connection kept)
        r.config_set("maxmemory", int(used / 0.82))
        time.sleep(1.1)  # the guard's cached reading (about a second) expires
        with pytest.raises(BrokerFullError, match=r"uses 8\d% of its maxmemory.*nothing was stored"):
            p.send_orderly("t", b"y", sharding_key="k")
        with pytest.raises(BrokerFullError):
            p.send_orderly_batch("t", [("k", b"z"), ("j", b"w")])
        assert MessageLog(p.brokers).max_offset(MQ) == 200
        # Consumption goes on: the fenced commits and reads are not guarded.
        eng = ConsumerEngine(s, "c1")
        RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
        seen: list[int] = []

        def listener(msgs, ctx):
            seen.extend(m.queue_offset for m in msgs)
            return ConsumeOrderlyStatus.SUCCESS

        out = ConsumeRequest(eng, ListenerSpec(listener, "t", "g"), "g", MQ, "tok0").run()
        assert out.verb == "IDLE" and seen == list(range(200))
        assert MessageLog(eng.brokers).consume_offset("g", MQ) == 200
        eng.brokers.close()
        r.config_set("maxmemory", 0)
        time.sleep(1.1)
        assert p.send_orderly("t", b"y", sharding_key="k").queue_offset == 200
        p.close()
        r.close()


def test_doctor_finds_a_project_app_as_celery_does(redis_url, tmp_path, monkeypatch) -> None:
    """`--app proj` of Celery's usual layout (a Django project's too: the app in proj/celery.py,
    re-exported as `celery_app`) failed with "module 'proj' has no attribute 'app'", where
    `celery -A proj` works: the doctor now looks the app up as Celery does."""
    pkg = tmp_path / "walkproj"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .celery import app as celery_app\n")
    (pkg / "celery.py").write_text("from celery import Celery\n\napp = Celery('walkproj')\n"
                                   "app.conf.accept_content = ['json', 'pickle']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = cli("doctor", "--app", "walkproj", "--json")
    found = {(f["check"], f["verdict"]) for f in json.loads(res.stdout)["findings"]}
    assert ("celery serializers", "FAIL") in found, res.stdout  # its configuration was read


def test_doctor_passes_a_good_redis_and_explains_a_bad_one(redis_url, monkeypatch) -> None:
    res = cli("doctor", "--app", "workers.app:app", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    found = {(f["check"], f["verdict"]) for f in json.loads(res.stdout)["findings"]}
    assert ("eviction", "OK") in found and ("celery serializers", "OK") in found
    assert ("version", "OK") in found
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru", "--maxmemory", "2mb"]) as bad:
        monkeypatch.setenv("MQORDER_REDIS_URL", bad.url)
        get_settings.cache_clear()
        res = cli("doctor", "--app", "")
        assert res.exit_code == 1
        assert "FAIL eviction" in res.stdout and "noeviction" in res.stdout
        assert "maxmemory-policy allkeys-lru" in res.stdout
    get_settings.cache_clear()


def test_doctor_checks_the_installed_stock_app_by_default(redis_url) -> None:
    """``--app`` defaults to ``mqorder.app:app``, which an installed package has (``workers.app``
    exists only in a checkout)."""
    res = cli("doctor", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    found = {(f["check"], f["verdict"]) for f in json.loads(res.stdout)["findings"]}
    assert ("celery serializers", "OK") in found


def test_doctor_flags_a_celery_app_that_accepts_pickle(redis_url) -> None:
    from mqorder.admin.doctor import celery_findings

    s = load_settings(redis_url=redis_url)
    bad = celery_findings(s, {"task_serializer": "pickle", "accept_content": ["json", "pickle"],
                              "broker_url": redis_url, "broker_transport_options": {"visibility_timeout": 30}})
    verdicts = {f.check: f.verdict.value for f in bad}
    assert verdicts == {"celery serializers": "FAIL", "celery visibility timeout": "FAIL"}


def test_doctor_on_an_unreachable_redis_fails_and_says_so(monkeypatch) -> None:
    from mqorder.testing.embedded import free_port

    monkeypatch.setenv("MQORDER_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    get_settings.cache_clear()
    res = cli("doctor", "--app", "")
    get_settings.cache_clear()
    assert res.exit_code == 1
    assert "FAIL reachable" in res.stdout and "start that redis-server" in res.stdout


def test_retention_cli_sets_shows_and_runs(redis_url, r) -> None:
    res = cli("topic", "create", "t", "--queues", "1", "--retention-max-messages", "5", "--json")
    assert res.exit_code == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["retention"]["retention_max_messages"] == 5
    p = Producer(settings=load_settings(redis_url=redis_url))
    p.send_orderly_batch("t", [("k", b"%d" % i) for i in range(12)])
    res = cli("retention", "run", "--json")
    assert json.loads(res.stdout)["by_topic"] == {"t": 7}
    res = cli("topic", "retention", "t", "--policy", "consumed", "--min-ms", "0", "--json")
    info = json.loads(res.stdout)
    assert info["retention"]["policy"] == "consumed"
    assert info["retention_own"] == ["retention_max_messages", "retention_min_ms", "retention_policy"]
    res = cli("topic", "retention", "t", "--policy", "forever")
    assert res.exit_code == 2 and "retention policy must be" in res.stderr
    res = cli("retention", "run", "--topic", "nope")
    assert res.exit_code == 2 and "does not exist" in res.stderr
    p.close()

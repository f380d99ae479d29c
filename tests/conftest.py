"""Fixtures: one real ``redis-server`` per test session on a free loopback port, flushed before
every test, and real ``celery worker`` subprocesses (prefork) started per test. With RabbitMQ as
Celery's broker (``broker_cluster``), each test gets a RabbitMQ vhost of its own."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mqorder.errors import BrokerUnavailableError
from mqorder.settings import get_settings, load_settings
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import BeatProcess, WorkerProcess, project_env
from mqorder.testing.rabbit_vhost import RabbitVhost

ROOT = Path(__file__).resolve().parent.parent

#: Faster membership and sweeps than production so tests do not wait on 20 s timers.
FAST = {
    "MQORDER_LISTENERS": "tests.listeners",
    "MQORDER_HEARTBEAT_INTERVAL": "0.5",
    "MQORDER_HEARTBEAT_TIMEOUT": "3",
    "MQORDER_SWEEP_INTERVAL": "1",
    "MQORDER_PENDING_TTL": "10",
}


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_url(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> str:
    redis_server.flushall()  # checks first that the server on the port is ours (not a port thief's)
    monkeypatch.setenv("MQORDER_REDIS_URL", redis_server.url)
    get_settings.cache_clear()
    yield redis_server.url
    get_settings.cache_clear()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def settings(redis_url: str):
    return load_settings(redis_url=redis_url)


@pytest.fixture
def env(settings):
    """A producer with a one-queue topic ``t`` and a Celery-free consumer engine for client ``c1``."""
    from mqorder import Producer
    from mqorder.consumer.consume_request import ConsumerEngine

    p = Producer(settings=settings)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(settings, "c1")
    yield p, eng
    p.close()
    eng.brokers.close()


class Cluster:
    """Worker subprocesses (and optionally beat) of one test, all stopped at teardown."""

    def __init__(self, url: str, tmp: Path, client: redis.Redis) -> None:
        self.url = url
        self.tmp = tmp
        self.client = client
        self.workers: dict[str, WorkerProcess] = {}
        self.beat: BeatProcess | None = None
        #: Celery's broker when it is not the store's Redis (``broker_cluster``: a RabbitMQ vhost).
        self.celery_broker_url: str | None = None
        self.rabbit: RabbitVhost | None = None

    def env(self, **extra: str) -> dict[str, str]:
        broker = {"MQORDER_CELERY_BROKER_URL": self.celery_broker_url} if self.celery_broker_url else {}
        return project_env(self.url, **{**FAST, **broker, **extra})

    def start_worker(self, name: str, *, concurrency: int = 2, pool: str = "prefork", wait: bool = True,
                     **extra: str) -> WorkerProcess:
        w = WorkerProcess(name, env=self.env(**extra), concurrency=concurrency, pool=pool,
                          logfile=self.tmp / f"{name}.log", cwd=ROOT, loglevel="INFO")
        w.start()
        self.workers[name] = w
        if wait:
            w.wait_registered(self.client, timeout=60)
        return w

    def start_beat(self, **extra: str) -> BeatProcess:
        self.beat = BeatProcess(env=self.env(**extra), workdir=self.tmp / "beat", logfile=self.tmp / "beat.log", cwd=ROOT)
        return self.beat.start()

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop(timeout=30)
        if self.beat:
            self.beat.stop()


@pytest.fixture
def cluster(redis_url: str, r: redis.Redis, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(redis_url, tmp_path, r)
    yield c
    c.stop()


@pytest.fixture
def rabbitmq() -> Iterator[RabbitVhost]:
    """A RabbitMQ vhost of this test's own (created, then deleted with all its queues), on the
    RabbitMQ service at 127.0.0.1:5672. Without one the test fails saying how to get it: CI runs
    RabbitMQ, and a skip would hide that half of the suite never ran."""
    vhost = RabbitVhost("mqorder-test")
    try:
        vhost.start()
    except BrokerUnavailableError as exc:
        vhost.stop()
        pytest.fail(str(exc), pytrace=False)
    yield vhost
    vhost.stop()


#: Celery's brokers every ``broker_cluster`` test runs on.
CELERY_BROKERS = ["redis", "rabbitmq"]


@pytest.fixture(params=CELERY_BROKERS)
def broker_cluster(request: pytest.FixtureRequest) -> Cluster:
    """``cluster``, once with Celery's broker on the store's Redis and once on RabbitMQ.

    The vhost is set up before the cluster, so it is deleted only after every worker stopped.
    """
    vhost: RabbitVhost | None = request.getfixturevalue("rabbitmq") if request.param == "rabbitmq" else None
    c: Cluster = request.getfixturevalue("cluster")
    if vhost is not None:
        c.celery_broker_url, c.rabbit = vhost.url, vhost
    return c


@pytest.fixture
def appender(redis_url: str) -> Iterator[QueueAppender]:
    """The one append path (``QueueAppender``) over topic ``t`` with 2 queues."""
    brokers = BrokerRegistry(redis_url)
    TopicManager(brokers).create_topic("t", 2)
    yield QueueAppender(brokers, pending_ttl_ms=10_000, timeout=3.0)
    brokers.close()


# -- ledger helpers ---------------------------------------------------------------------------------


def body(key: str, seq: int) -> bytes:
    return json.dumps({"k": key, "s": seq}).encode()


def ledger(client: redis.Redis, group: str) -> list[dict]:
    out = []
    for raw in client.lrange(f"ledger:{group}", 0, -1):
        f = raw.decode().split("|")
        out.append({
            "key": f[0], "seq": int(f[1]), "queue": int(f[2]), "offset": int(f[3]), "epoch": int(f[4]),
            "client": f[5], "pid": int(f[6]), "start": int(f[7]), "end": int(f[8]), "reconsume": int(f[9]),
            "ok": f[10] == "S", "topic": f[11] if len(f) > 11 else "",
        })
    return out


def wait_for(pred, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def check_order(entries: list[dict]) -> tuple[list[str], int, int]:
    """Per key, successful handling must go seq 1, 2, 3... with redeliveries only repeating a
    prefix. Returns (violations, distinct handled, duplicates)."""
    last: dict[str, int] = {}
    violations, dups, handled = [], 0, 0
    for e in entries:
        if not e["ok"]:
            continue
        prev = last.get(e["key"], 0)
        if e["seq"] == prev + 1:
            last[e["key"]] = e["seq"]
            handled += 1
        elif e["seq"] <= prev:
            dups += 1
        else:
            violations.append(f"key {e['key']}: seq {e['seq']} after {prev}")
    return violations, handled, dups


os.environ.setdefault("MQORDER_LISTENERS", "")


# The Spark session of the run (tests/spark_support.py): session-scoped, started on first use.
from tests.spark_support import spark  # noqa: E402,F401

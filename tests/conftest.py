"""Fixtures: one real ``redis-server`` per test session on a free loopback port, flushed before
every test, and real ``celery worker`` subprocesses (prefork) started per test. With RabbitMQ as
Celery's broker (``broker_cluster``), each test gets a RabbitMQ vhost of its own."""

from __future__ import annotations

import os
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
from mqorder.testing.rabbit_vhost import RabbitVhost
from tests.support import Cluster, xdist_worker
from tests.xdist_schedule import GroupedLoadScheduling


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
def settings(redis_url: str, request: pytest.FixtureRequest):
    """The suite's settings; a test changes some with
    ``@pytest.mark.parametrize("settings", [{"name": value}], indirect=True)`` (``env`` too)."""
    return load_settings(redis_url=redis_url, **getattr(request, "param", {}))


@pytest.fixture
def env(settings):
    """A producer with a one-queue topic ``t`` and a Celery-free consumer engine for client ``c1``."""
    from mqorder import Producer
    from mqorder.consumer.engine import ConsumerEngine

    p = Producer(settings=settings)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(settings, "c1")
    yield p, eng
    p.close()
    eng.brokers.close()


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
    vhost = RabbitVhost(f"mqorder-test-{xdist_worker()}")
    try:
        vhost.start()
    except BrokerUnavailableError as exc:
        vhost.stop()
        pytest.fail(str(exc), pytrace=False)
    yield vhost
    vhost.stop()


#: Celery's brokers every ``broker_cluster`` test runs on (the RabbitMQ one marked ``rabbitmq``).
CELERY_BROKERS = ["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)]


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
def chaos_ledger(redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.Redis]:
    """The chaos listener writing its records to the test's Redis (a fresh client in this process).
    ``chaos.listeners`` is imported here, not at the top: importing it registers its listeners."""
    from chaos import listeners

    monkeypatch.setenv("CHAOS_LEDGER_URL", redis_url)
    monkeypatch.setattr(listeners, "_r", None)
    yield r
    if listeners._r is not None:
        listeners._r.close()


@pytest.fixture
def appender(redis_url: str) -> Iterator[QueueAppender]:
    """The one append path (``QueueAppender``) over topic ``t`` with 2 queues."""
    brokers = BrokerRegistry(redis_url)
    TopicManager(brokers).create_topic("t", 2)
    yield QueueAppender(brokers, pending_ttl_ms=10_000, timeout=3.0)
    brokers.close()


os.environ.setdefault("MQORDER_LISTENERS", "")
# The CLI draws piped tables PIPE_WIDTH wide unless COLUMNS says otherwise, and the CLI tests read
# whole rows: a COLUMNS=80 from the shell (pytest-xdist's workers have one) would cut them short.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# Every JVM the suite starts (Spark drivers, a standalone cluster's master, workers and executors,
# the Spark Connect server) lives seconds to a minute: HotSpot's C2 compiler, which pays off only
# in long runs, took a large share of their CPU on 2 cores (a driver-kill test: 47.7 -> 40.0 s
# wall, paired runs). C1 alone and the serial collector; a user's JVMs keep their defaults.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


# The Spark session of the run (tests/spark_support.py), and Spark beyond local[N]
# (tests/spark_cluster.py): a standalone cluster, a Spark Connect server and driver processes on
# them. All session-scoped, started on first use.
from tests.spark_cluster import cluster_driver, connect_driver, connect_server, standalone_cluster  # noqa: E402,F401
from tests.spark_support import spark  # noqa: E402,F401


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> GroupedLoadScheduling | None:
    """``--dist loadgroup`` (``make test``): tests/xdist_schedule.py's grouping and order."""
    return GroupedLoadScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None

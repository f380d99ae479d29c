"""Store URLs through Redis Sentinel (``redis+sentinel://``): the parser and its refusals (no
Redis), then real deployments (a primary, two replicas and three Sentinels on loopback,
``mqorder.testing.sentinel``): the store's clients, the CLI, kombu's transport for Celery's broker,
passwords, and a kill -9 of the primary under a sending and consuming client whose objects must
carry on through the failover by themselves."""

from __future__ import annotations

import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kombu
import pytest
import redis
from redis.sentinel import SentinelConnectionPool
from typer.testing import CliRunner

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.celery.broker import celery_broker, transport_options
from mqorder.cli import app as cli_app
from mqorder.consumer.client_instance import ClientInstance
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec, get_listener, orderly_listener, unregister_listener
from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import get_settings, load_settings
from mqorder.store.brokers import MAX_CONNECTIONS, Broker, check_celery_broker_url, check_redis_url, redact_url
from mqorder.store.connect import SentinelAuthError, connect, sentinel_client
from mqorder.store.connect import close as close_client
from mqorder.store.log import MessageLog
from mqorder.store.scripts import Scripts
from mqorder.store.urls import (
    DEFAULT_SENTINEL_PORT,
    SENTINEL_PASSWORD_ENV,
    URL_FORM,
    SentinelURL,
    is_sentinel_url,
    parse_sentinel_url,
)
from mqorder.testing.sentinel import SentinelDeployment
from tests.sentinel_support import (
    SwitchWatch,
    eventually,
    longest_pause,
    order_violations,
    sentinel_events,
    settle_on_the_primary_that_stays,
    stamped_body,
)
from tests.support import ROOT, body, ping_refused

S = ConsumeOrderlyStatus


@pytest.fixture(autouse=True)
def _no_ambient_sentinel_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser falls back to MQORDER_SENTINEL_PASSWORD: a value from the shell must not leak in."""
    monkeypatch.delenv(SENTINEL_PASSWORD_ENV, raising=False)


# -- the URL form (no Redis) ----------------------------------------------------------------------


def test_a_full_url_parses_into_every_field() -> None:
    u = parse_sentinel_url(
        "redis+sentinel://app:d%40ta@s1.example:26380,s2.example,[::1]:26381/orders/3"
        "?sentinel_password=s3cret&sentinel_username=watch&socket_timeout=0.5&socket_connect_timeout=2"
    )
    assert u == SentinelURL(
        sentinels=(("s1.example", 26380), ("s2.example", DEFAULT_SENTINEL_PORT), ("::1", 26381)),
        master_name="orders", db=3, username="app", password="d@ta", sentinel_username="watch",
        sentinel_password="s3cret", ssl=False, socket_timeout=0.5, socket_connect_timeout=2.0,
    )


def test_defaults_port_26379_db_0_no_credentials() -> None:
    u = parse_sentinel_url("redis+sentinel://h/mymaster")
    assert (u.sentinels, u.master_name, u.db, u.username, u.password, u.sentinel_password, u.ssl) == (
        (("h", 26379),), "mymaster", 0, None, None, None, False)
    assert parse_sentinel_url("redis+sentinel://h/mymaster/").db == 0
    assert parse_sentinel_url("redis+sentinel://:pw@h/m").password == "pw"


def test_rediss_sentinel_and_ssl_query_mean_tls_to_the_data_nodes() -> None:
    assert parse_sentinel_url("rediss+sentinel://h/m").ssl
    assert parse_sentinel_url("redis+sentinel://h/m?ssl=true").ssl
    assert not parse_sentinel_url("redis+sentinel://h/m?ssl=false").ssl


def test_the_sentinel_password_comes_from_the_query_then_the_keyword_then_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SENTINEL_PASSWORD_ENV, "from-env")
    assert parse_sentinel_url("redis+sentinel://h/m").sentinel_password == "from-env"
    assert parse_sentinel_url("redis+sentinel://h/m", sentinel_password="kw").sentinel_password == "kw"
    assert parse_sentinel_url("redis+sentinel://h/m?sentinel_password=q", sentinel_password="kw").sentinel_password == "q"


def test_to_url_round_trips_and_a_repr_shows_no_password() -> None:
    u = parse_sentinel_url("rediss+sentinel://u:p%2Fw@h1:1,[::1]:2/m.x-1/4?sentinel_password=a%26b&socket_timeout=1.5")
    assert parse_sentinel_url(u.to_url()) == u
    assert "p/w" not in repr(u) and "a&b" not in repr(u)


def test_is_sentinel_url_goes_by_the_scheme() -> None:
    assert is_sentinel_url("redis+sentinel://h/m") and is_sentinel_url("REDISS+SENTINEL://h/m")
    assert not is_sentinel_url("redis://h:6379/0") and not is_sentinel_url("sentinel://h:26379")
    assert not is_sentinel_url(None)


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://h1:26379", "no master name"),
    ("redis+sentinel://h1:26379/", "no master name"),
    ("redis+sentinel:///mymaster", "no Sentinel host"),
    ("redis+sentinel://h1:0/m", "bad port '0'"),
    ("redis+sentinel://h1:65536/m", "bad port '65536'"),
    ("redis+sentinel://h1:x/m", "bad port 'x'"),
    ("redis+sentinel://h1,h2:/m", "bad port ''"),
    ("redis+sentinel://h1,,h2/m", "empty host"),
    ("redis+sentinel://:26379/m", "no host name"),
    ("redis+sentinel://::1:26379/m", "IPv6 address in brackets"),
    ("redis+sentinel://h/m/zero", "db 'zero' is not a non-negative integer"),
    ("redis+sentinel://h/m/-1", "db '-1' is not a non-negative integer"),
    ("redis+sentinel://h/m/0/extra", "extra segments"),
    ("redis+sentinel://h/m?master=x", "unknown query parameter 'master'"),
    ("redis+sentinel://h/m?sentinel_pasword=x", "unknown query parameter 'sentinel_pasword'"),
    ("redis+sentinel://h/m?ssl=1&ssl=0", "given twice"),
    ("redis+sentinel://h/m?ssl=maybe", "not true or false"),
    ("rediss+sentinel://h/m?ssl=false", "means TLS"),
    ("redis+sentinel://h/m?socket_timeout=-1", "not a positive number of seconds"),
    ("redis+sentinel://secret@h/m", "ambiguous"),
    ("redis://h:6379/0", "is not a Sentinel URL"),
])
def test_a_malformed_url_is_refused_saying_what_and_showing_the_form(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=r"\. The form is ") as exc:
        parse_sentinel_url(url)
    assert why in str(exc.value)
    assert URL_FORM in str(exc.value)


def test_a_refusal_never_shows_either_password() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_sentinel_url("redis+sentinel://:datapw@h/m/x?sentinel_password=sentpw")
    assert "datapw" not in str(exc.value) and "sentpw" not in str(exc.value)
    assert ":***@h" in str(exc.value) and "sentinel_password=***" in str(exc.value)


def test_redact_url_hides_both_passwords() -> None:
    shown = redact_url("redis+sentinel://u:d%2Fp@h1:1,h2:2/m/0?sentinel_password=sp&ssl=true")
    assert shown == "redis+sentinel://u:***@h1:1,h2:2/m/0?sentinel_password=***&ssl=true"
    assert redact_url("redis+sentinel://:pa/ss@h/m") == "redis+sentinel://:***@h/m"
    kombu_form = redact_url("sentinel://:pw@h1:26379/0;sentinel://:pw@h2:26380/0")
    assert kombu_form == "sentinel://:***@h1:26379/0;sentinel://:***@h2:26380/0"


def test_store_url_checks_accept_the_sentinel_form_and_name_the_setting_when_it_is_bad() -> None:
    assert check_redis_url("redis+sentinel://h1,h2/m/1") == "redis+sentinel://h1,h2/m/1"
    with pytest.raises(ConfigError, match=r"^MQORDER_BROKERS\['b'\]: bad Sentinel URL .*no master name"):
        check_redis_url("redis+sentinel://h1", "MQORDER_BROKERS['b']")
    with pytest.raises(ConfigError, match="redis\\+sentinel://"):
        check_redis_url("http://h/m")  # the refusal of an unknown scheme shows the Sentinel form too


def test_settings_carry_the_sentinel_password_in_the_url_and_describe_hides_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SENTINEL_PASSWORD_ENV, "SENT-pw-1")
    s = load_settings(redis_url="redis+sentinel://:DATA-pw-2@h1,h2/m",
                      brokers={"b": "redis+sentinel://h3/n?sentinel_password=OWN-pw-3"})
    assert s.sentinel_password == "SENT-pw-1"
    assert parse_sentinel_url(s.redis_url, sentinel_password="other").sentinel_password == "SENT-pw-1"  # in the URL now
    assert parse_sentinel_url(s.brokers["b"]).sentinel_password == "OWN-pw-3"  # the URL's query wins
    text = json.dumps(s.describe())
    assert not any(pw in text for pw in ("SENT-pw-1", "DATA-pw-2", "OWN-pw-3")), text
    assert s.describe()["sentinel_password"] == "***"
    with pytest.raises(ConfigError, match=r"MQORDER_REDIS_URL.*db 'x'"):
        load_settings(redis_url="redis+sentinel://h/m/x")


def test_celery_broker_urls_in_both_sentinel_forms_are_checked() -> None:
    assert check_celery_broker_url("sentinel://:p@h1:26379;sentinel://:p@h2:26380")
    assert check_celery_broker_url("redis+sentinel://h1,h2/m")
    with pytest.raises(ConfigError, match="mixes Redis Sentinel and RabbitMQ"):
        check_celery_broker_url("sentinel://h1:26379;amqp://h2//")
    with pytest.raises(ConfigError, match="MQORDER_CELERY_SENTINEL_MASTER"):
        load_settings(celery_broker_url="sentinel://h1:26379;sentinel://h2:26380")
    assert load_settings(celery_broker_url="sentinel://h1:26379", celery_sentinel_master="m").celery_transport == "redis"


def test_celery_gets_kombus_sentinel_transport_derived_from_the_store_url() -> None:
    b = celery_broker("redis+sentinel://:d%40p@h1:26379,h2:26380/orders/2?sentinel_password=sp")
    assert b.url == "sentinel://:d%40p@h1:26379/2;sentinel://:d%40p@h2:26380/2"
    assert b.transport_options["master_name"] == "orders"
    assert b.transport_options["sentinel_kwargs"]["password"] == "sp"
    assert b.use_ssl is None
    assert celery_broker("rediss+sentinel://h/m").use_ssl is not None
    explicit = celery_broker("sentinel://h1:26379;sentinel://h2:26380", sentinel_master="m", sentinel_password="x")
    assert explicit.transport_options["master_name"] == "m"
    assert explicit.transport_options["sentinel_kwargs"]["password"] == "x"
    opts = transport_options(b.url, b.transport_options)
    assert opts["visibility_timeout"] == 3600 and opts["master_name"] == "orders"
    with pytest.raises(ConfigError, match="no master name is set"):
        transport_options("sentinel://h1:26379", {})


def test_the_stock_celery_app_takes_the_sentinel_store_url() -> None:
    env = {**os.environ, "MQORDER_REDIS_URL": "redis+sentinel://:dp@h1:26379,h2:26380/orders/1",
           "MQORDER_SENTINEL_PASSWORD": "sp", "MQORDER_LISTENERS": ""}
    env.pop("MQORDER_CELERY_BROKER_URL", None)
    code = ("import json; from mqorder.app import app; "
            "print(json.dumps([app.conf.broker_url, app.conf.broker_transport_options]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    url, options = json.loads(out.stdout.strip().splitlines()[-1])
    assert url == "sentinel://:dp@h1:26379/1;sentinel://:dp@h2:26380/1"
    assert options["master_name"] == "orders" and options["sentinel_kwargs"]["password"] == "sp"
    assert options["visibility_timeout"] == 3600 and options["ack_emulation"] is False


# -- a real deployment ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dep() -> Iterator[SentinelDeployment]:
    with SentinelDeployment() as d:
        yield d


@pytest.fixture
def url(dep: SentinelDeployment, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The deployment's URL as MQORDER_REDIS_URL, on an emptied primary."""
    c = dep.direct_client(dep.primary())
    c.flushall()
    c.close()
    monkeypatch.setenv("MQORDER_REDIS_URL", dep.url())
    get_settings.cache_clear()
    yield dep.url()
    get_settings.cache_clear()


def test_connect_reaches_the_current_primary_through_the_sentinels(dep: SentinelDeployment, url: str) -> None:
    c = connect(url)
    try:
        c.set("k", "v")
        assert c.execute_command("ROLE")[0] == b"master"
        pool = c.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.get_master_address() == ("127.0.0.1", dep.primary_port())
        for replica in dep.replicas():  # written on the primary, replicated to the others
            direct = dep.direct_client(replica)

            def replicated(d: redis.Redis = direct) -> bool:
                return bool(d.get("k") == b"v")
            assert eventually(replicated)
    finally:
        close_client(c)
    s = sentinel_client(url)
    assert s is not None and s.discover_master(dep.master_name) == ("127.0.0.1", dep.primary_port())
    assert sentinel_client("redis://127.0.0.1:6379/0") is None


def test_a_broker_keeps_its_pool_limits_timeouts_and_raw_stream_replies(url: str) -> None:
    b = Broker("broker-a", url, socket_timeout=2.5)
    try:
        b.ping()
        pool = b.client.connection_pool
        assert pool.max_connections == MAX_CONNECTIONS
        kw = pool.connection_kwargs
        assert (kw["socket_timeout"], kw["socket_connect_timeout"], kw["health_check_interval"]) == (2.5, 2.5, 30)
        b.client.xadd("s", {"f": "v"})
        raw = b.client.xrange("s")
        assert isinstance(raw, list) and isinstance(raw[0], list | tuple)  # not redis-py's per-entry dicts
        assert isinstance(b.scripts, Scripts)
    finally:
        b.close()


def test_named_brokers_in_mqorder_brokers_may_be_sentinel_urls(dep: SentinelDeployment, url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MQORDER_BROKERS", json.dumps({"broker-b": dep.url(db=1)}))
    settings = load_settings()
    p = Producer(settings=settings)
    try:
        p.create_topic("t", queues=2, brokers=["broker-b"])
        r = p.send_orderly("t", b"x", sharding_key="k")
        assert r.message_queue.broker_name == "broker-b"
        assert p.brokers.get("broker-b").client.connection_pool.connection_kwargs["db"] == 1
        db1 = connect(dep.url(db=1))
        assert db1.dbsize() > 0  # the queue's log is in db 1 of the same deployment
        close_client(db1)
    finally:
        p.close()


def test_producer_and_engine_send_and_consume_in_order_through_sentinel(url: str) -> None:
    settings = load_settings(redis_url=url)
    p = Producer(settings=settings)
    p.create_topic("t", queues=2)
    sent = [(f"k{i % 5}", i) for i in range(200)]
    for k, i in sent:
        p.send_orderly("t", body(k, i), sharding_key=k)
    eng = ConsumerEngine(settings, "c1")
    seen: dict[str, list[int]] = {}

    def listener(msgs: list[Any], ctx: Any) -> S:
        for m in msgs:
            d = json.loads(m.body)
            seen.setdefault(d["k"], []).append(d["s"])
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g")
    try:
        for qid in (0, 1):
            _drain(eng, spec, MessageQueue("t", "broker-a", qid))
        assert seen == {k: [i for kk, i in sent if kk == k] for k in {k for k, _ in sent}}
        log = MessageLog(eng.brokers)
        assert sum(log.consume_offset("g", MessageQueue("t", "broker-a", q)) for q in (0, 1)) == 200
    finally:
        p.close()
        eng.brokers.close()


def test_status_and_exporter_through_the_cli_with_a_sentinel_redis_url(url: str, monkeypatch) -> None:
    monkeypatch.delenv("MQORDER_REDIS_URL")
    get_settings.cache_clear()
    p = Producer(redis_url=url)
    p.create_topic("t", queues=2)
    p.send_orderly("t", b"x", sharding_key="k")
    p.topics.subscribe("g", "t", MessageModel.CLUSTERING)  # what a worker with a listener of g does
    p.close()
    runner = CliRunner()
    res = runner.invoke(cli_app, ["--redis-url", url, "status", "g", "t"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "broker-a" in res.output
    res = runner.invoke(cli_app, ["--redis-url", url, "exporter", "--once"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "mqorder_up 1.0" in res.output


def test_doctor_with_a_sentinel_redis_url_exits_0_and_checks_celerys_sentinel_broker(url: str) -> None:
    env = {**os.environ, "MQORDER_LISTENERS": ""}
    env.pop("MQORDER_REDIS_URL", None)
    env.pop("MQORDER_CELERY_BROKER_URL", None)
    out = subprocess.run([sys.executable, "-m", "mqorder.cli", "--redis-url", url, "doctor", "--json"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kombu_reaches_the_deployment_with_the_derived_transport(url: str) -> None:
    b = celery_broker(url)
    with kombu.Connection(b.url, transport_options=transport_options(b.url, b.transport_options)) as conn:
        q = conn.SimpleQueue("mqorder-sentinel-check")
        q.put({"hello": "sentinel"})
        assert q.get(timeout=5).payload == {"hello": "sentinel"}
        q.close()


def test_a_spark_connection_carries_the_sentinel_url_as_a_plain_string(url: str, monkeypatch) -> None:
    from mqorder.spark.options import connection  # here: importing mqorder.spark imports pyspark

    monkeypatch.setenv(SENTINEL_PASSWORD_ENV, "unused-by-this-deployment")
    conn = pickle.loads(pickle.dumps(connection({"redisurl": url})))  # what an executor receives
    assert is_sentinel_url(conn.redis_url)
    assert parse_sentinel_url(conn.redis_url, sentinel_password=None).sentinel_password == "unused-by-this-deployment"
    monkeypatch.delenv(SENTINEL_PASSWORD_ENV)
    reg = conn.registry()
    try:
        reg.default.ping()
    finally:
        reg.close()


# -- passwords ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured() -> Iterator[SentinelDeployment]:
    with SentinelDeployment(replicas=1, password="data-pw", sentinel_password="sentinel-pw") as d:
        yield d


def test_a_password_protected_deployment_connects_with_both_passwords(
        secured: SentinelDeployment, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ":data-pw@" in secured.url() and "sentinel_password=sentinel-pw" in secured.url()
    b = Broker("broker-a", secured.url())
    try:
        b.ping()
        b.client.set("x", "1")
    finally:
        b.close()
    # The Sentinels' password from the environment (MQORDER_SENTINEL_PASSWORD) when the URL has none.
    bare = secured.url().split("?")[0]
    monkeypatch.setenv(SENTINEL_PASSWORD_ENV, "sentinel-pw")
    b = Broker("broker-a", load_settings(redis_url=bare).redis_url)
    try:
        b.ping()
    finally:
        b.close()


@pytest.mark.parametrize("query", ["?sentinel_password=wrong", ""])
def test_a_wrong_or_missing_sentinel_password_is_a_clear_error(secured: SentinelDeployment, query: str) -> None:
    bad = secured.url().split("?")[0] + query
    err = ping_refused(bad)
    msg = str(err)
    assert isinstance(err.__cause__, SentinelAuthError)
    assert "refused mqorder's login" in msg and "sentinel_password" in msg and "MQORDER_SENTINEL_PASSWORD" in msg
    assert "sentinel-pw" not in msg and "data-pw" not in msg
    res = CliRunner().invoke(cli_app, ["--redis-url", bad, "status", "g"], catch_exceptions=False)
    assert res.exit_code == 2
    assert "refused mqorder's login" in res.output


def test_a_wrong_data_password_is_redis_own_authentication_error(secured: SentinelDeployment) -> None:
    assert "invalid username-password pair" in str(ping_refused(secured.url().replace(":data-pw@", ":nope@")))


# -- kill -9 of the primary under a live client ---------------------------------------------------


@dataclass
class Handled:
    key: str
    seq: int
    queue: int
    offset: int
    sent: float  # when the send attempt of this copy began
    at: float


@dataclass
class LocalWorker:
    """What a Celery worker does for one client, in threads: the ``ClientInstance`` (heartbeats,
    wake-up subscription, sweeps, rebalances) dispatches ConsumeRequests to ``runners`` threads
    that run them on one ``ConsumerEngine`` and dispatch what each outcome asks for, as the
    ``consume_request`` task does. No Celery: this file is about the Redis side."""

    client_id: str
    settings: Any
    runners: int = 2
    engine: ConsumerEngine = field(init=False)
    client: ClientInstance = field(init=False)
    _todo: queue.Queue[tuple[str, str, str] | None] = field(default_factory=queue.Queue)
    _threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = ConsumerEngine(self.settings, self.client_id)
        self.engine.may_linger = lambda: True  # drained runs linger in a blocking XREAD
        self.client = ClientInstance(self.client_id, self.settings, self.dispatch)

    def dispatch(self, sub: str, mq_key: str, token: str, client_id: str, countdown: float = 0.0) -> bool:
        if client_id != self.client_id:
            return True
        if countdown > 0:
            threading.Timer(countdown, self._todo.put, ((sub, mq_key, token),)).start()
        else:
            self._todo.put((sub, mq_key, token))
        return True

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            sub, mq_key, token = item
            mq = MessageQueue.from_key(mq_key)
            spec = get_listener(keys.group_of_sub(sub), mq.topic)
            assert spec is not None
            try:
                out = self.engine.run(spec, sub, mq, token)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                continue
            if out is None:
                continue
            if out.needs_dispatch:
                self.dispatch(out.sub or sub, out.queue.key if out.queue is not None else mq_key, out.token,
                              out.target, out.countdown)
            for f in out.follow_ups:
                self.dispatch(f.sub or sub, f.mq.key, f.token, f.target, f.countdown)

    def start(self) -> LocalWorker:
        for i in range(self.runners):
            t = threading.Thread(target=self._run, name=f"runner-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        self.client.start()
        return self

    def stop(self) -> None:
        self.client.stop()
        for _ in self._threads:
            self._todo.put(None)
        for t in self._threads:
            t.join(timeout=15)
        self.engine.brokers.close()
        self.client.brokers.close()


@pytest.mark.timeout(420)  # up to 3 promotions, each phase bounded (see below)
def test_after_a_kill_9_of_the_primary_the_same_client_objects_carry_on(dep: SentinelDeployment, url: str) -> None:
    """Send and consume through a failover with the same Producer, engine and ClientInstance.

    Consumption resumes on the promoted replica by itself: connections are re-made where the
    Sentinels point, the scripts are loaded again there (NOSCRIPT), the wake-up subscription is
    made again there, and a ConsumeRequest caught by the kill retries within its Redis budget.
    Sends acknowledged without a replica wait may be lost in the replication window, so the
    test counts what was handled and checks its order: per queue no offset is skipped (a rewind
    is a redelivery), per key the sequence only moves forward between rewinds.
    """
    settings = load_settings(redis_url=url, heartbeat_interval_ms=500, heartbeat_timeout_ms=3000,
                             sweep_interval_ms=1000, consume_linger_ms=500)
    topic, group, n_keys = "orders", "g-failover", 8
    handled: list[Handled] = []
    lock = threading.Lock()

    def listener(msgs: list[Any], ctx: Any) -> S:
        now = time.monotonic()
        with lock:
            for m in msgs:
                d = json.loads(m.body)
                handled.append(Handled(d["k"], d["s"], m.queue_id, m.queue_offset, d["t"], now))
        return S.SUCCESS

    listener.__qualname__ = "failover_listener"
    orderly_listener(topic=topic, group=group)(listener)
    producer = Producer(settings=settings)
    producer.create_topic(topic, queues=4)
    worker = LocalWorker("w1@sentinel-test", settings).start()
    acked: list[tuple[str, int, float]] = []
    send_errors: list[tuple[float, str]] = []
    stop = threading.Event()

    seq = {f"k{i}": 0 for i in range(n_keys)}  # outside the loop: a restarted sender goes on

    def send_loop() -> None:
        i = 0
        while not stop.is_set():
            k = f"k{i % n_keys}"
            s = seq[k] + 1
            try:
                producer.send_orderly(topic, stamped_body(k, s, time.monotonic()), sharding_key=k)
            except (redis.RedisError, BrokerUnavailableError) as exc:
                send_errors.append((time.monotonic(), type(exc).__name__))
                time.sleep(0.05)
                continue  # the same (key, seq) again: per key the acknowledged sends stay in order
            seq[k] = s
            acked.append((k, s, time.monotonic()))
            i += 1
            time.sleep(0.004)

    sender = threading.Thread(target=send_loop, daemon=True)
    old_port = dep.primary_port()
    switches: SwitchWatch | None = None
    killed = None
    promotions = 0
    try:
        switches = SwitchWatch(s.client() for s in dep.sentinels)
        sender.start()
        assert eventually(lambda: len(handled) >= 300, timeout=30), f"only {len(handled)} handled before the kill"
        old_client = worker.client
        t_kill = time.monotonic()
        killed = dep.kill_primary()
        new_port = dep.wait_failover(old_port, timeout=30)
        t_failover = time.monotonic()

        def failed_over_again() -> bool:
            """On a loaded machine the promoted primary can miss its Sentinels' PINGs and be failed
            over in turn, losing writes it acknowledged (as in test_sentinel_e2e's kill test)."""
            assert switches is not None
            return bool(switches.switches) and switches.switches[-1][1] != new_port

        def settled() -> bool:
            """The phase after a promotion: consumption resumes, 200 more messages, then every key's
            last acknowledged send is handled. False if Sentinel failed over again meanwhile."""
            # Resumed: a message sent after the promotion is handled (send, wake-up or sweep, and
            # consumption all on the new primary; not a batch that was in memory at the kill).
            assert eventually(lambda: _first_new(handled, t_failover) is not None or failed_over_again(),
                              timeout=20), "consumption did not resume"
            if failed_over_again():
                return False
            handled_after = len([h for h in handled if h.at > t_failover])
            assert eventually(lambda: failed_over_again()
                              or len([h for h in handled if h.at > t_failover]) >= handled_after + 200, timeout=20)
            stop.set()
            sender.join(timeout=10)
            # A sender still in a send would go on beside the next phase's, sharing its sequences.
            assert not sender.is_alive(), "the sender did not stop within 10 s"
            # Everything acknowledged after the failover gets handled (the tail drains).
            last_acked = {k: s for k, s, _ in acked}
            assert eventually(lambda: failed_over_again() or _highest(handled) == last_acked, timeout=30), (
                _tail_report(dep, new_port, topic, group, handled, last_acked, worker) + "\n"
                + sentinel_events(dep))
            return not failed_over_again()

        def restarted(port: int) -> None:
            """Failed over again: the phase starts over from the primary that is now the only one."""
            nonlocal new_port, t_failover, sender
            new_port, t_failover = port, time.monotonic()
            if stop.is_set():
                stop.clear()
                sender = threading.Thread(target=send_loop, daemon=True)
                sender.start()

        assert switches is not None
        promotions = settle_on_the_primary_that_stays(dep, switches, settled, restarted)
        # The same ClientInstance subscribed to its wake-up channel again, on the promoted replica.
        new = dep.direct_client(dep.node(new_port))
        assert new.pubsub_numsub(keys.wake_channel(worker.client_id))[0][1] == 1
    finally:
        stop.set()
        sender.join(timeout=10)
        if switches is not None:
            switches.close()
        worker.stop()
        producer.close()
        unregister_listener(group, topic)
        if killed is not None:
            dep.restart_as_replica(killed)
            dep.wait_replicas_online(2)

    assert worker.client is old_client and not worker.errors, worker.errors
    # The same client objects loaded the scripts again on the promoted replica (it had none: Redis
    # does not replicate its script cache), on NOSCRIPT.
    stats = new.info("commandstats")
    assert stats.get("cmdstat_script|load", {}).get("calls", 0) >= 1, sorted(stats)
    assert order_violations([vars(h) for h in handled]) == []
    sent_well_before = {(k, s) for k, s, at in acked if at < t_kill - 1.0}
    seen = {(h.key, h.seq) for h in handled}
    assert sent_well_before <= seen, f"{len(sent_well_before - seen)} sends acknowledged 1 s before the kill were lost"
    lost = {(k, s) for k, s, _ in acked} - seen
    resumed = _first_new(handled, t_failover)
    assert resumed is not None
    pause = longest_pause((h.at for h in handled), since=t_kill - 0.5)
    print(f"\nfailover: (last) promotion {t_failover - t_kill:.2f} s after the kill; longest pause in consumption "
          f"{pause:.2f} s; first message sent after the promotion handled {resumed - t_failover:.2f} s after it; "
          f"{len(acked)} acked sends, {len(lost)} lost in the replication window, {len(handled)} handled "
          f"(redeliveries included), {len(send_errors)} failed send attempts (retried); {promotions} promotion(s)")
    assert resumed - t_failover <= 10.0


# -- helpers --------------------------------------------------------------------------------------


def _drain(eng: ConsumerEngine, spec: ListenerSpec, mq: MessageQueue) -> None:
    """Assign ``mq`` to c1 and follow the outcomes as the Celery task would."""
    token = "tok0"
    RebalanceLockManager(eng.brokers).assign("g", [(mq, "c1", token)])
    for _ in range(200):
        out = eng.run(spec, "g", mq, token)
        assert out is not None
        if not out.needs_dispatch or out.target != "c1":
            return
        time.sleep(out.countdown)
        token = out.token


def _first_new(handled: list[Handled], since: float) -> float | None:
    """When the first message whose send began after ``since`` was handled (None: not yet)."""
    times = [h.at for h in list(handled) if h.sent >= since]
    return min(times) if times else None


def _tail_report(dep: SentinelDeployment, new_port: int, topic: str, group: str, handled: list[Handled],
                 last_acked: dict[str, int], worker: LocalWorker) -> str:
    """What a failed tail drain looked like: the keys behind, their queues' state on the primary the
    Sentinels name now (and whether it is still the one promoted at the kill), the worker's errors.
    A rare CI failure gave only two truncated dicts; this says which queue stalled and why."""
    highest = _highest(handled)
    behind = {k: (highest.get(k, 0), s) for k, s in last_acked.items() if highest.get(k, 0) != s}
    queues = {h.key: h.queue for h in handled}
    lines = [f"keys behind (handled, acked): {behind}", f"key -> queue: {queues}"]
    try:
        now_port = dep.primary_port()
        lines.append(f"primary this phase began on: {new_port}; named now: {now_port}")
        r = dep.direct_client(dep.node(now_port))
        lines.append(f"redis TIME: {r.time()}")
        for qid in sorted(set(queues.values())):
            tag = keys.queue_tag(topic, "broker-a", qid)
            state = {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(tag, group)).items()}
            lines.append(f"queue {qid}: next {r.get(keys.queue_next(tag))}, state {state}")
    except Exception as exc:  # noqa: BLE001 - a report, not the test
        lines.append(f"(could not read the primary: {exc!r})")
    lines.append(f"worker errors: {worker.errors!r}; requests waiting for a runner: {worker._todo.qsize()}")
    return "\n".join(lines)


def _highest(handled: list[Handled]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in handled:
        out[h.key] = max(out.get(h.key, 0), h.seq)
    return out

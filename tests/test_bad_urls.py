"""Store URLs that cannot work get a clear error naming what is wrong and what to do, never a raw
redis-py exception or a traceback: an unreachable Redis Cluster, a port out of range, a Sentinel
deployment that names no primary. Each against real processes (a dead port, a redis-server, a
Sentinel), in the library and through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner, Result

from mqorder.cli import EXIT_BAD, app
from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.settings import load_settings
from mqorder.store.brokers import Broker, check_celery_broker_url, check_redis_url, redact_url
from mqorder.store.connect import close as close_client
from mqorder.store.connect import connect
from mqorder.testing.embedded import RedisServer, free_port
from mqorder.testing.sentinel import SentinelProcess
from tests.sentinel_support import eventually
from tests.support import ping_refused

#: Nothing listens on port 1: a connection there is refused at once.
DEAD = "127.0.0.1:1"


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def one_line_error(res: Result) -> str:
    """The CLI's error: exit 2, nothing on stdout, one ``error:`` line on stderr (no traceback)."""
    assert res.exit_code == EXIT_BAD, (res.exit_code, res.output)
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


# -- an unreachable Redis Cluster ----------------------------------------------------------------


def test_an_unreachable_or_non_cluster_redis_cluster_url_is_a_clear_error(redis_url: str,
                                                                           redis_server: RedisServer) -> None:
    url = f"redis+cluster://:secret@{DEAD},127.0.0.1:2/"
    with pytest.raises(BrokerUnavailableError) as exc:
        connect(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    msg = str(exc.value)
    assert "cannot reach the Redis Cluster at redis+cluster://:***@127.0.0.1:1,127.0.0.1:2/" in msg
    assert "127.0.0.1:1, 127.0.0.1:2" in msg and "Connection refused" in msg
    assert "Start the cluster's nodes" in msg and "secret" not in msg

    with pytest.raises(BrokerUnavailableError, match="^broker 'broker-b': cannot reach the Redis Cluster"):
        Broker("broker-b", url, socket_timeout=1.0)

    # A plain Redis named by a cluster URL: a wrong URL, not an outage.
    plain = f"redis+cluster://127.0.0.1:{redis_server.port}/"
    with pytest.raises(ConfigError, match="names no Redis Cluster: .* cluster mode off .* use redis://host:port/db"):
        Broker("broker-a", plain, socket_timeout=1.0)

    line = one_line_error(cli("--redis-url", url, "topic", "list"))
    assert "broker 'broker-a': cannot reach the Redis Cluster at redis+cluster://:***@" in line
    assert "secret" not in line
    assert "names no Redis Cluster" in one_line_error(cli("--redis-url", plain, "topic", "list"))


def test_doctor_reports_an_unreachable_redis_cluster_as_a_fail_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """As for a plain Redis that does not answer: one FAIL (exit 1), Celery still checked; not a
    bare error (exit 2) with nothing checked, which it was while the cluster client, which reads
    the slot map when made, failed before the first check."""
    monkeypatch.setenv("MQORDER_CELERY_BROKER_URL", "redis://127.0.0.1:6379/9")
    res = cli("--redis-url", f"redis+cluster://:secret@{DEAD}/", "doctor", "--json")
    assert res.exit_code == 1, (res.exit_code, res.output)
    report = json.loads(res.stdout)
    (fail,) = [f for f in report["findings"] if f["verdict"] == "FAIL"]
    assert fail["check"] == "reachable" and "cannot reach the Redis Cluster" in fail["detail"]
    assert "secret" not in res.stdout
    assert any(f["check"].startswith("celery") and f["verdict"] == "OK" for f in report["findings"])


# -- a port out of range ---------------------------------------------------------------------------


@pytest.mark.parametrize("url, port", [
    ("redis://127.0.0.1:99999/0", "99999"),
    ("redis://:secret@127.0.0.1:65536/0", "65536"),
    ("redis://user:secret@127.0.0.1:0/0", "0"),  # redis-py would quietly use 6379
    ("rediss://127.0.0.1:-1/0", "-1"),
    ("redis://127.0.0.1:63 79/0", "63 79"),
    ("redis://[::1]:70000/0", "70000"),
])
def test_a_port_out_of_range_is_a_config_error_naming_the_url_and_the_range(url: str, port: str) -> None:
    with pytest.raises(ConfigError) as exc:
        check_redis_url(url)
    msg = str(exc.value)
    assert f"MQORDER_REDIS_URL={redact_url(url)!r} has port {port!r}" in msg
    assert "a port is a number from 1 to 65535" in msg and "secret" not in msg
    with pytest.raises(ConfigError, match="MQORDER_REDIS_URL"):
        load_settings(redis_url=url)
    with pytest.raises(ConfigError, match=f"broker 'broker-b' URL=.* has port '{port}'"):
        Broker("broker-b", url)
    with pytest.raises(ConfigError, match="MQORDER_CELERY_BROKER_URL=.* has port"):
        check_celery_broker_url(f"redis://127.0.0.1:6379/0;{url}")

    line = one_line_error(cli("--redis-url", url, "topic", "list"))
    assert f"--redis-url={redact_url(url)!r} has port {port!r}" in line


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://127.0.0.1/0", "redis://:pw@localhost:65535/3",
    "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none", "redis://[::1]:6379/0", "unix:///tmp/redis.sock?db=2",
    "unix://:pw@/tmp/redis.sock", "redis+sentinel://127.0.0.1:26379/mymaster", "redis+cluster://127.0.0.1:7000/",
])
def test_good_urls_of_every_kind_still_pass(url: str) -> None:
    assert check_redis_url(url) == url


@pytest.mark.parametrize("url", ["redis+sentinel://127.0.0.1:99999/m", "redis+cluster://127.0.0.1:99999/",
                                 "amqp://guest:pw@127.0.0.1:99999//", "sentinel://127.0.0.1:99999"])
def test_other_url_kinds_refuse_a_port_out_of_range_too(url: str) -> None:
    check = check_celery_broker_url if url.startswith(("amqp", "sentinel:")) else check_redis_url
    with pytest.raises(ConfigError, match="99999"):
        check(url)


@pytest.mark.parametrize("url", ["redis://:se#cret@127.0.0.1:6379/0", "redis://:se?cret@127.0.0.1:6379/0",
                                 "redis://:se/cret@127.0.0.1:6379/0"])
def test_a_password_that_cuts_the_host_short_is_not_shown_as_a_bad_port(url: str) -> None:
    with pytest.raises(ConfigError) as exc:
        check_redis_url(url)
    msg = str(exc.value)
    assert "percent-encode" in msg and "redis://***@127.0.0.1:6379/0" in msg
    assert "cret" not in msg and "has port" not in msg


def test_a_bad_redis_url_query_value_is_a_config_error_not_a_bare_value_error() -> None:
    with pytest.raises(ConfigError, match="is not a valid Redis URL: Invalid value for 'socket_timeout'"):
        check_redis_url("redis://127.0.0.1:6379/0?socket_timeout=soon")


# -- a Sentinel deployment that names no primary ----------------------------------------------------


def test_sentinels_that_name_no_primary_say_which_service_and_sentinels_and_what_to_check(tmp_path: Path) -> None:
    sentinel = SentinelProcess(tmp_path)
    # It monitors "mqorder" on a port where no primary runs, so it soon sees that primary down.
    sentinel.start("mqorder", free_port(), quorum=1, down_after_ms=100, failover_timeout_ms=1000, auth_pass=None)
    try:
        probe = sentinel.client()
        assert eventually(lambda: _answers(probe))
        # A master name the Sentinels do not monitor, and a Sentinel that is not running.
        url = f"redis+sentinel://127.0.0.1:{sentinel.port},{DEAD}/orders"
        err = ping_refused(url)
        msg = str(err)
        assert "<redis.client" not in msg and "ConnectionPool" not in msg
        assert "no Sentinel named a primary for service 'orders'" in msg
        assert f"127.0.0.1:{sentinel.port} (does not monitor 'orders'; it monitors 'mqorder')" in msg
        assert "127.0.0.1:1 (no answer: Error 111 connecting to 127.0.0.1:1. Connection refused)" in msg
        assert "fix their host:port in the URL" in msg and "check the master name" in msg
        assert isinstance(err.__cause__, redis.ConnectionError)  # retry loops see what they saw before

        # The name it monitors, once it sees that primary down.
        assert eventually(lambda: "s_down" in str(probe.sentinel_master("mqorder").get("flags")))
        watched = connect(f"redis+sentinel://127.0.0.1:{sentinel.port}/mqorder", socket_timeout=1.0)
        try:
            with pytest.raises(redis.ConnectionError) as down:
                watched.ping()
        finally:
            close_client(watched)
        assert f"127.0.0.1:{sentinel.port} (sees the primary 127.0.0.1:" in str(down.value)
        assert "Start the primary, or let the Sentinels promote a replica" in str(down.value)

        line = one_line_error(cli("--redis-url", url, "topic", "list"))
        assert "cannot reach Redis broker 'broker-a'" in line and "does not monitor 'orders'" in line
        assert "<redis.client" not in line
        probe.close()
    finally:
        sentinel.stop()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize(("url", "db"), [
    ("redis://127.0.0.1:6379/orders", "orders"), ("redis://127.0.0.1:6379/-1", "-1"),
    ("rediss://127.0.0.1:6380/0/1", "0/1"), ("unix:///tmp/redis.sock?db=two", "two"),
    ("redis://:secret@127.0.0.1:6379/1?db=x", "x"),
])
def test_a_database_that_is_not_a_number_is_a_config_error(url: str, db: str) -> None:
    """redis-py reads ``/orders`` as no database at all: db 0, quietly (another application's
    keys, maybe); ``?db=two`` as a bare ValueError; ``/-1`` fails only at the first SELECT."""
    with pytest.raises(ConfigError) as exc:
        check_redis_url(url)
    msg = str(exc.value)
    assert f"names database {db!r}: a Redis database is a number" in msg and "secret" not in msg
    line = one_line_error(cli("--redis-url", url, "topic", "list"))
    assert f"names database {db!r}" in line


# -- a URL that reaches the wrong thing: password, database number, Sentinel vs server ---------------


def test_a_url_that_reaches_the_wrong_thing_says_what_to_change_not_start_redis(tmp_path: Path) -> None:
    """Each of these read "did not answer within 3.0s" / "start redis-server" / a raw ResponseError
    while the server was running (a new user's and an operator's walk-throughs): the message now
    names what to fix in the URL, in the library and through the CLI and doctor."""
    from mqorder import Producer
    from mqorder.errors import BrokerRefusedError

    srv = RedisServer(password="right", extra_args=["--databases", "2"]).start()
    sentinel = SentinelProcess(tmp_path)
    sentinel.start("mqorder", srv.port, quorum=1, down_after_ms=5000, failover_timeout_ms=10000,
                   auth_pass="right")
    try:
        wrong = f"redis://:wrong@127.0.0.1:{srv.port}/0"
        with pytest.raises(BrokerRefusedError, match=r"refused this client's credentials: fix the password"):
            Producer(settings=load_settings(redis_url=wrong, send_msg_timeout_ms=500)).send_orderly(
                "t", b"x", sharding_key="k")
        assert "fix the password" in one_line_error(cli("--redis-url", wrong, "topic", "list"))

        no_db = f"redis://:right@127.0.0.1:{srv.port}/5"
        with pytest.raises(ConfigError, match=r"has no database with the URL's number"):
            Producer(settings=load_settings(redis_url=no_db)).create_topic("t", queues=1)
        line = one_line_error(cli("--redis-url", no_db, "topic", "list"))
        assert "no database with the URL's number" in line and "Start redis-server" not in line
        assert line.count("no database with the URL's number") == 1, line  # said once
        doctor = json.loads(cli("--redis-url", no_db, "doctor", "--json").stdout)
        (reach,) = [f for f in doctor["findings"] if f["check"] == "reachable"]
        assert reach["verdict"] == "FAIL" and "no database with the URL's number" in reach["fix"]

        as_server = f"redis://127.0.0.1:{sentinel.port}/0"  # a Sentinel's port in a server's URL
        assert "it may be a Redis Sentinel" in one_line_error(cli("--redis-url", as_server, "topic", "list"))
        with RedisServer() as plain:  # a server's port given as a Sentinel's
            as_sentinel = f"redis+sentinel://127.0.0.1:{plain.port}/mqorder"
            line = one_line_error(cli("--redis-url", as_sentinel, "topic", "list"))
            assert "is a Redis server, not a Sentinel" in line and "Start redis-server" not in line

        # Sentinels that answer but know no primary of that name: fix the name, not "start them".
        named = f"redis+sentinel://:right@127.0.0.1:{sentinel.port}/wrongname/0"
        res = cli("--redis-url", named, "doctor", "--json")
        (summary,) = [f for f in json.loads(res.stdout)["findings"] if f["check"] == "sentinels"]
        assert summary["verdict"] == "FAIL" and "none knows a primary named 'wrongname'" in summary["detail"]
        assert "fix the master name in the URL" in summary["fix"] and "start the Sentinels" not in summary["fix"]
    finally:
        sentinel.stop()
        srv.stop()


def test_a_refused_connection_is_not_said_to_have_timed_out() -> None:
    from mqorder import Producer

    p = Producer(settings=load_settings(redis_url=f"redis://{DEAD}/0", send_msg_timeout_ms=3000))
    with pytest.raises(BrokerUnavailableError) as exc:
        p.create_topic("t", queues=1)
    assert "could not be reached" in str(exc.value) and "within 3.0s" not in str(exc.value)


def test_a_port_that_is_not_redis_and_tls_to_a_plain_server_say_so(redis_url: str) -> None:
    """A producer's walk-through: an HTTP server's port raised redis-py's bare InvalidResponse
    ("Protocol error, got '<'") from every call, and a rediss:// URL to a plain Redis timed out as
    if Redis were down, with no word of TLS."""
    import http.server
    import socketserver
    import threading

    from mqorder import Producer
    from mqorder.errors import BrokerRefusedError

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # not on the CLI's stderr
            pass

    port = free_port()
    http_srv = socketserver.TCPServer(("127.0.0.1", port), Quiet)
    threading.Thread(target=http_srv.serve_forever, daemon=True).start()
    try:
        p = Producer(settings=load_settings(redis_url=f"redis://127.0.0.1:{port}/0", send_msg_timeout_ms=2000))
        for call in (lambda: p.create_topic("t", queues=1), lambda: p.send_orderly("t", b"x", sharding_key="k"),
                     lambda: p.send_orderly_async("t", b"x", sharding_key="k").result(10)):
            with pytest.raises(BrokerRefusedError, match=r"answered, but not in Redis's protocol"):
                call()
        line = one_line_error(cli("--redis-url", f"redis://127.0.0.1:{port}/0", "topic", "list"))
        assert "not in Redis's protocol" in line and "Start redis-server" not in line
    finally:
        http_srv.shutdown()
        http_srv.server_close()
    plain = redis_url.replace("redis://", "rediss://", 1)
    p = Producer(settings=load_settings(redis_url=plain, send_msg_timeout_ms=500))
    with pytest.raises(BrokerUnavailableError, match=r"with rediss:// \(TLS\), a server without TLS never completes"):
        p.create_topic("t", queues=1)

"""Redis Cluster store URLs (``redis+cluster://``): what is parsed, what is refused and why, and
that no password is ever shown. Plain unit tests: parsing connects to nothing."""

from __future__ import annotations

import json

import pytest

from mqorder.errors import ConfigError
from mqorder.settings import load_settings
from mqorder.store.brokers import check_redis_url, redact_url
from mqorder.store.cluster_urls import (
    CLUSTER_URL_FORM,
    ClusterURL,
    is_cluster_url,
    parse_cluster_url,
    redact_cluster_url,
)
from mqorder.store.urls import parse_sentinel_url


def test_a_node_list_is_parsed_with_credentials_tls_and_timeouts() -> None:
    u = parse_cluster_url("rediss+cluster://app:s%40cret@h1:7000,[::1]:7001,h3/0?socket_timeout=1.5"
                          "&socket_connect_timeout=0.5")
    assert u == ClusterURL(startup_nodes=(("h1", 7000), ("::1", 7001), ("h3", 6379)), username="app",
                           password="s@cret", ssl=True, socket_timeout=1.5, socket_connect_timeout=0.5)


@pytest.mark.parametrize("url", ["redis+cluster://h:7000", "redis+cluster://h:7000/", "redis+cluster://h:7000/0",
                                 "REDIS+CLUSTER://h:7000/0/", "redis+cluster://h:7000?ssl=false"])
def test_db_0_or_none_and_the_defaults(url: str) -> None:
    u = parse_cluster_url(url)
    assert u == ClusterURL(startup_nodes=(("h", 7000),))
    assert (u.username, u.password, u.ssl, u.socket_timeout, u.socket_connect_timeout) == (None, None, False, None, None)


def test_password_only_and_ssl_in_the_query() -> None:
    u = parse_cluster_url("redis+cluster://:pw@h1:7000,h2:7001?ssl=true")
    assert (u.username, u.password, u.ssl) == (None, "pw", True)


def test_to_url_round_trips_and_a_repr_shows_no_password() -> None:
    u = parse_cluster_url("rediss+cluster://u:p%2Fw%26x@h1:1,[::1]:2?socket_timeout=2")
    assert parse_cluster_url(u.to_url()) == u
    assert "p/w" not in repr(u) and "p%2F" not in repr(u)


def test_is_cluster_url_goes_by_the_scheme() -> None:
    assert is_cluster_url("redis+cluster://h:7000") and is_cluster_url("REDISS+CLUSTER://h")
    assert not is_cluster_url("redis://h:6379/0") and not is_cluster_url("redis+sentinel://h/m")
    assert not is_cluster_url("redis+cluster") and not is_cluster_url(None)


@pytest.mark.parametrize(("url", "why"), [
    ("redis+cluster://", "no cluster node"),
    ("redis+cluster:///0", "no cluster node"),
    ("redis+cluster://h1:7000/1", "db 1 is not possible: a Redis Cluster has only db 0"),
    ("redis+cluster://h1:7000/15", "db 15 is not possible"),
    ("redis+cluster://h1:7000/zero", "db 'zero' is not a number"),
    ("redis+cluster://h1:7000/0/extra", "extra segments"),
    ("redis+cluster://h1:0", "bad port '0'"),
    ("redis+cluster://h1:65536", "bad port '65536'"),
    ("redis+cluster://h1:x", "bad port 'x'"),
    ("redis+cluster://h1:7000,h2:", "bad port ''"),
    ("redis+cluster://h1:7000,,h2:7001", "empty host in the cluster node list"),
    ("redis+cluster://h1:7000,", "empty host"),
    ("redis+cluster://:7000", "no host name"),
    ("redis+cluster://::1:7000", "IPv6 address in brackets"),
    ("redis+cluster://[::1:7000", "Invalid IPv6 URL"),
    ("redis+cluster://[not-v6]:7000", "does not appear to be an IPv4 or IPv6 address"),
    ("redis+cluster://[::1]7000", "after the address"),
    ("redis+cluster://h1:7000,h1:7000", "listed twice"),
    ("redis+cluster://h1:7000?db=0", "unknown query parameter 'db'; allowed: ssl, socket_timeout"),
    ("redis+cluster://h1:7000?sentinel_password=x", "unknown query parameter 'sentinel_password'"),
    ("redis+cluster://h1:7000?ssl=1&ssl=0", "given twice"),
    ("redis+cluster://h1:7000?ssl=maybe", "not true or false"),
    ("rediss+cluster://h1:7000?ssl=false", "rediss+cluster:// means TLS"),
    ("redis+cluster://h1:7000?socket_timeout=-1", "not a positive number of seconds"),
    ("redis+cluster://h1:7000?socket_connect_timeout=nan", "not a positive number of seconds"),
    ("redis+cluster://h1:7000?ssl", "not key=value pairs"),
    ("redis+cluster://h1:7000#frag", "unexpected fragment"),
    ("redis+cluster://secret@h1:7000", "ambiguous"),
    ("redis://h1:7000/0", "is not a Redis Cluster URL"),
    ("redis+sentinel://h1:26379/m", "is not a Redis Cluster URL"),
])
def test_a_malformed_url_is_refused_saying_what_and_showing_the_form(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=r"\. The form is ") as exc:
        parse_cluster_url(url)
    assert why in str(exc.value)
    assert str(exc.value).endswith(CLUSTER_URL_FORM)


def test_a_refusal_never_shows_the_password() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_cluster_url("redis+cluster://app:hunter2@h1:7000/3")
    assert "hunter2" not in str(exc.value) and "app:***@h1:7000/3" in str(exc.value)


def test_redact_hides_the_password_even_in_a_malformed_url() -> None:
    assert redact_cluster_url("redis+cluster://u:p%2Fw@h1:1,h2:2/0?ssl=true") == "redis+cluster://u:***@h1:1,h2:2/0?ssl=true"
    assert redact_cluster_url("rediss+cluster://:pa/ss@h1,h2") == "rediss+cluster://:***@h1,h2"
    assert redact_cluster_url("redis+cluster://h1:7000") == "redis+cluster://h1:7000"
    # The brokers' redaction (logs, `mqorder config`) takes the cluster form too.
    assert redact_url("redis+cluster://:s3cret@h1:7000,h2:7001/") == "redis+cluster://:***@h1:7000,h2:7001/"


def test_the_store_url_check_takes_a_cluster_url_and_names_the_setting_when_it_is_bad() -> None:
    assert check_redis_url("redis+cluster://h1:7000,h2:7001/") == "redis+cluster://h1:7000,h2:7001/"
    with pytest.raises(ConfigError, match=r"^MQORDER_BROKERS\['b'\]: bad Redis Cluster URL .*only db 0"):
        check_redis_url("redis+cluster://h1:7000/2", "MQORDER_BROKERS['b']")
    with pytest.raises(ConfigError) as exc:
        check_redis_url("cluster://h1:7000")  # an unknown scheme: the refusal shows every accepted form
    assert "redis+cluster://" in str(exc.value) and "redis+sentinel://" in str(exc.value)
    with pytest.raises(ConfigError, match="redis\\+cluster://"):
        check_redis_url("")


def test_settings_take_a_cluster_store_url_and_describe_hides_its_password() -> None:
    s = load_settings(redis_url="redis+cluster://:CL-pw-1@h1:7000,h2:7001/",
                      brokers={"b": "rediss+cluster://u:CL-pw-2@h3:7000"}, celery_broker_url="redis://h4:6379/0")
    assert s.redis_url == "redis+cluster://:CL-pw-1@h1:7000,h2:7001/"
    shown = json.dumps(s.describe())
    assert "CL-pw-1" not in shown and "CL-pw-2" not in shown, shown
    assert s.describe()["redis_url"] == "redis+cluster://:***@h1:7000,h2:7001/"
    with pytest.raises(ConfigError, match=r"MQORDER_REDIS_URL: bad Redis Cluster URL .*only db 0"):
        load_settings(redis_url="redis+cluster://h1:7000/1")


def test_sentinel_urls_are_parsed_as_before() -> None:
    """The shared pieces (host list, credentials, query, TLS) moved under both parsers."""
    u = parse_sentinel_url("rediss+sentinel://u:p@h1,[::1]:2/m/3?sentinel_password=sp&socket_timeout=1")
    assert u.sentinels == (("h1", 26379), ("::1", 2)) and (u.username, u.password, u.db, u.ssl) == ("u", "p", 3, True)
    assert (u.sentinel_password, u.socket_timeout, u.socket_connect_timeout) == ("sp", 1.0, None)
    with pytest.raises(ConfigError, match="empty host in the Sentinel list.*The form is redis\\+sentinel://"):
        parse_sentinel_url("redis+sentinel://h1,,h2/m")

"""A configuration walk-through's findings, each held by a test: overrides that keep what the user
set, a topic on a broker this process does not know, broker names and databases checked at load,
a TLS certificate refusal told as one, misspelt variables named, and errors that name the value
as the user wrote it. Real redis-servers (one with TLS); the CLI through typer's runner or a
subprocess."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis
from typer.testing import CliRunner

from mqorder import Producer
from mqorder import settings as settings_module
from mqorder.cli import app
from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.retention.trimmer import RetentionTrimmer
from mqorder.settings import Settings, load_settings
from mqorder.store.brokers import Broker, BrokerRegistry
from mqorder.store.failures import setup_hint
from mqorder.testing.embedded import RedisServer
from tests.support import ROOT

# -- 1. keyword overrides keep which settings the user chose -----------------------------------------


def test_a_producer_override_does_not_turn_defaults_into_choices(monkeypatch: pytest.MonkeyPatch,
                                                                 redis_url: str) -> None:
    """MQORDER_RETENTION_MS=1800000 alone is valid (the default replay window is cut to it); a
    Producer's keyword override rebuilt the settings from every field, so the untouched default
    retention_min_ms (1 h) counted as chosen and the two were refused as at odds."""
    monkeypatch.setenv("MQORDER_RETENTION_MS", "1800000")
    s = load_settings()
    p = Producer(settings=s, max_message_size=1000)
    try:
        assert (p.settings.max_message_size, p.settings.retention_ms) == (1000, 1_800_000)
        assert p.settings.retention_defaults.retention_min_ms == 1_800_000
        assert "retention_min_ms" not in p.settings.model_fields_set
    finally:
        p.close()
    # Both chosen and at odds is still refused, by an override too.
    both = load_settings(retention_ms=1_800_000, retention_min_ms=600_000)
    with pytest.raises(ConfigError, match=r"retention_min_ms \(3600000 ms\) must not exceed retention_ms"):
        both.with_overrides(retention_min_ms=3_600_000)


# -- 2. retention with a topic on a broker this process does not know --------------------------------


@pytest.fixture
def far_topic(redis_server: RedisServer, redis_url: str, r: redis.Redis) -> Iterator[str]:
    """Topic ``far`` on ``broker-b`` (db 1 of the same server) and ``near`` on ``broker-a``, both
    with a 1 s retention and 5 messages each, all due for trimming; yields broker-b's URL."""
    url_b = redis_url.rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(url_b).flushdb()
    both = load_settings(redis_url=redis_url, brokers={"broker-b": url_b})
    p = Producer(settings=both)
    p.create_topic("far", queues=1, brokers=["broker-b"], retention_ms=1000)
    p.create_topic("near", queues=1, brokers=["broker-a"], retention_ms=1000)
    for topic in ("far", "near"):
        p.send_orderly_batch(topic, [("k", b"x")] * 5)
    p.close()
    time.sleep(1.1)
    yield url_b
    redis.Redis.from_url(url_b).flushdb()


def test_a_topic_on_an_unknown_broker_is_skipped_with_one_warning_and_the_rest_is_trimmed(
        far_topic: str, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The pass used to raise "unknown broker 'broker-b'" and trim nothing, every pass."""
    s = load_settings(redis_url=redis_url)  # no MQORDER_BROKERS: broker-b is not known here
    brokers = BrokerRegistry(s.redis_url, s.brokers)
    trimmer = RetentionTrimmer(brokers, s)
    try:
        with caplog.at_level(logging.WARNING, logger="mqorder.retention.trimmer"):
            first = trimmer.run()
            second = trimmer.run()
    finally:
        brokers.close()
    assert first.by_topic() == {"near": 5}
    assert first.unknown_brokers == second.unknown_brokers == {"far": ["broker-b"]}
    assert first.to_json()["unknown_brokers"] == {"far": ["broker-b"]}
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per topic, not every pass
    assert "topic far" in warnings[0] and "broker-b" in warnings[0] and "MQORDER_BROKERS" in warnings[0]
    # Once the process knows broker-b, the topic is trimmed as any other.
    s_b = load_settings(redis_url=redis_url, brokers={"broker-b": far_topic})
    both = BrokerRegistry(s_b.redis_url, s_b.brokers)
    try:
        assert RetentionTrimmer(both, s_b).run().by_topic() == {"far": 5, "near": 0}
    finally:
        both.close()


def test_retention_run_reports_a_topic_on_an_unknown_broker_and_trims_the_rest(
        far_topic: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("MQORDER_BROKERS", raising=False)
    with caplog.at_level(logging.WARNING, logger="mqorder.retention.trimmer"):
        res = CliRunner().invoke(app, ["retention", "run", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["by_topic"] == {"near": 5}
    assert out["unknown_brokers"] == {"far": ["broker-b"]}
    assert any("topic far" in rec.getMessage() and "broker-b" in rec.getMessage() for rec in caplog.records)


# -- 3. broker names checked at load -----------------------------------------------------------------


def test_the_default_brokers_own_name_in_mqorder_brokers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its URL was dropped without a word: the default broker (MQORDER_REDIS_URL) was used instead."""
    monkeypatch.setenv("MQORDER_BROKERS", '{"broker-a": "redis://other-host:6379/0"}')
    with pytest.raises(ConfigError, match=r"MQORDER_BROKERS: names 'broker-a', the default broker's own name"):
        load_settings(redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="the default broker's own name"):
        BrokerRegistry("redis://127.0.0.1:1/0", {"broker-a": "redis://other-host:6379/0"})


@pytest.mark.parametrize("name", ["b b:x", "", "a{b}"])
def test_invalid_broker_names_are_refused_at_load(name: str) -> None:
    """They passed load_settings (and `mqorder config`) and failed only at first use."""
    with pytest.raises(ConfigError, match=rf"MQORDER_BROKERS: invalid broker name {re.escape(repr(name))}: use only"):
        load_settings(redis_url="redis://127.0.0.1:1/0", brokers={name: "redis://127.0.0.1:2/0"})


def test_mqorder_config_refuses_an_invalid_broker_name() -> None:
    proc = _mqorder_config(MQORDER_BROKERS='{"b b:x": "redis://127.0.0.1:2/0"}')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "invalid broker name 'b b:x'" in proc.stderr


# -- 4. one database per URL ---------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "named"), [
    ("redis://h/3?db=2", "/3 and db=2"),
    ("rediss://h:6380/0?db=1", "/0 and db=1"),
    ("unix:///tmp/redis.sock?db=1&db=2", "db=1 and db=2"),
])
def test_a_url_naming_two_databases_is_refused(url: str, named: str) -> None:
    """redis-py quietly used the query's database."""
    with pytest.raises(ConfigError, match=rf"names more than one database \({re.escape(named)}\)"):
        load_settings(redis_url=url)
    with pytest.raises(ConfigError, match=r"MQORDER_BROKERS\['broker-b'\].*names more than one database"):
        load_settings(redis_url="redis://h/0", brokers={"broker-b": url})


@pytest.mark.parametrize("url", ["redis://h/2?db=2", "redis://h?db=2", "unix:///tmp/redis.sock?db=3"])
def test_one_database_said_once_or_twice_alike_is_accepted(url: str) -> None:
    assert load_settings(redis_url=url).redis_url == url


# -- 5. a TLS certificate refusal is told as one -------------------------------------------------------


def test_a_tls_certificate_refusal_gets_a_tls_hint_not_start_redis_server() -> None:
    with RedisServer(tls=True) as srv:
        url = f"rediss://127.0.0.1:{srv.port}/0"  # no ssl_ca_certs: the test CA is not trusted
        b = Broker("broker-a", url, socket_timeout=2)
        try:
            with pytest.raises(BrokerUnavailableError) as exc:
                b.ping()
            with pytest.raises(redis.ConnectionError) as raw:
                b.client.ping()
        finally:
            b.close()
    text = str(exc.value)
    assert "CERTIFICATE_VERIFY_FAILED" in text
    assert "Start redis-server" not in text
    assert "?ssl_ca_certs=/path/ca.pem" in text and "ssl_cert_reqs=none" in text
    assert setup_hint(raw.value) is not None and "does not trust the server's certificate" in setup_hint(raw.value)


# -- 6. misspelt variables are named -----------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each unknown variable is warned about once per process: forget those of earlier tests."""
    monkeypatch.setattr(settings_module, "_warned_variables", set())


def test_a_misspelt_variable_is_warned_about_once_with_the_closest_names(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh_warnings: None) -> None:
    monkeypatch.setenv("MQORDER_CONSUME_BATCH_SISE", "8")
    monkeypatch.setenv("MQORDER_DEMO_TOPIC", "orders")  # the demo's own variable, not a setting
    with caplog.at_level(logging.WARNING, logger="mqorder.settings"):
        load_settings(redis_url="redis://127.0.0.1:1/0")
        load_settings(redis_url="redis://127.0.0.1:1/0")
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "mqorder.settings"]
    assert len(warnings) == 1, warnings
    assert "MQORDER_CONSUME_BATCH_SISE (did you mean MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE" in warnings[0]
    assert "MQORDER_DEMO_TOPIC" not in warnings[0]


def test_mqorder_config_shows_a_misspelt_variable() -> None:
    proc = _mqorder_config(MQORDER_CONSUME_BATCH_SISE="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MQORDER_CONSUME_BATCH_SISE" in proc.stderr and "MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE" in proc.stderr
    json.loads(proc.stdout)  # stdout stays the settings' JSON


#: Where the project reads a variable of its own: ``os.environ[...]``, ``.get(...)``, ``getenv``,
#: and the ``MQORDER_X=`` / ``MQORDER_X:`` lines of the compose files, scripts and .env.example.
_READS = re.compile(r"""(?:environ(?:\.get\(|\.pop\(|\.setdefault\(|\[)|getenv\()\s*["'](MQORDER_[A-Z0-9_]+)["']""")
_ASSIGNS = re.compile(r"^\s*(?:export\s+|#\s+)?(MQORDER_[A-Z0-9_]+)\s*[:=]", re.M)


def test_every_mqorder_variable_the_project_reads_is_a_setting_or_allowlisted() -> None:
    """So the warning never names one of the project's own variables (the allowlist cannot drift)."""
    found: set[str] = set()
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if not path.is_file() or parts[0] in (".venv", ".git", "site", "node_modules") or "__pycache__" in parts:
            continue
        if path.suffix == ".py":
            found |= set(_READS.findall(path.read_text(errors="replace")))
        elif path.suffix in (".yml", ".yaml", ".sh") or path.name in (".env.example", "Makefile", "Dockerfile"):
            found |= set(_ASSIGNS.findall(path.read_text(errors="replace")))
    assert {"MQORDER_DEMO_TOPIC", "MQORDER_TEST_LEDGER_URL", "MQORDER_REDIS_URL"} <= found  # the scan sees them
    assert settings_module.unknown_variables(dict.fromkeys(found, "x")) == []
    assert settings_module.OTHER_VARIABLES.isdisjoint(f"MQORDER_{name.upper()}" for name in Settings.model_fields)


# -- 7. errors name the value as written -----------------------------------------------------------


def test_a_nested_error_names_the_key_as_written() -> None:
    """Client ``w1`` was shown as ``MQORDER_ALLOCATE_CONFIG.W1``."""
    with pytest.raises(ConfigError) as exc:
        load_settings(redis_url="redis://127.0.0.1:1/0", allocate_config={"w1@Host": ["t:broker-a:0", 1]})
    assert "MQORDER_ALLOCATE_CONFIG['w1@Host'][1]: Input should be a valid string (got 1)" in str(exc.value)


def test_a_bad_boolean_lists_the_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MQORDER_LEDGER", "maybe")
    with pytest.raises(ConfigError, match=r"MQORDER_LEDGER: must be true or false \(also 1/0, yes/no, on/off"):
        load_settings(redis_url="redis://127.0.0.1:1/0")


def _mqorder_config(**env: str) -> subprocess.CompletedProcess[str]:
    """``mqorder config`` in a clean environment plus ``env``."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
            "MQORDER_REDIS_URL": "redis://127.0.0.1:1/0"}
    return subprocess.run([sys.executable, "-m", "mqorder.cli", "config"], cwd=ROOT, capture_output=True, text=True,
                          env={**base, **env}, timeout=60)

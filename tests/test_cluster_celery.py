"""Celery's broker is never a Redis Cluster (kombu has no cluster transport), while the store may
be: the refusal comes when settings are read or the Celery app is configured, names the choices,
and shows no password. A cluster store with a plain Redis, Sentinel or RabbitMQ broker is fine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from celery import Celery

from mqorder.admin.doctor import celery_findings
from mqorder.admin.findings import Verdict
from mqorder.celery.broker import celery_broker
from mqorder.celery.setup import install
from mqorder.errors import ConfigError
from mqorder.settings import load_settings
from mqorder.store.brokers import check_celery_broker_url
from tests.support import ROOT

CLUSTER = "redis+cluster://:cl-secret@127.0.0.1:7000,127.0.0.1:7001/"
CHOICES = ("MQORDER_CELERY_BROKER_URL", "redis://", "redis+sentinel://", "amqp://")


def assert_names_the_choices(msg: str) -> None:
    assert "kombu has no Redis Cluster transport" in msg, msg
    assert all(c in msg for c in CHOICES), msg
    assert "MQORDER_REDIS_URL on the cluster" in msg, msg
    assert "cl-secret" not in msg and ":***@127.0.0.1:7000" in msg, msg


@pytest.mark.parametrize("url", [CLUSTER, "rediss+cluster://h:7000", "redis://h:6379/0;redis+cluster://h:7000"])
def test_a_cluster_celery_broker_url_is_refused_when_settings_are_read(url: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(redis_url="redis://127.0.0.1:1/0", celery_broker_url=url)
    msg = str(exc.value)
    assert msg.count("MQORDER_CELERY_BROKER_URL") >= 2 and "is a Redis Cluster" in msg
    assert all(c in msg for c in CHOICES)


def test_the_refusal_explains_why_and_hides_the_password() -> None:
    with pytest.raises(ConfigError) as exc:
        check_celery_broker_url(CLUSTER)
    assert_names_the_choices(str(exc.value))
    assert "CROSSSLOT" in str(exc.value)


def test_installing_celery_on_a_cluster_store_without_its_own_broker_is_refused_at_configuration() -> None:
    settings = load_settings(redis_url=CLUSTER)  # the store alone may be the cluster (producers, Spark)
    app = Celery("t-cluster", set_as_current=False)
    with pytest.raises(ConfigError) as exc:
        install(app, settings)
    msg = str(exc.value)
    assert msg.startswith("MQORDER_REDIS_URL (Celery's broker, since MQORDER_CELERY_BROKER_URL is unset)")
    assert_names_the_choices(msg)


def test_an_apps_own_cluster_broker_url_is_refused_naming_it() -> None:
    app = Celery("t-cluster", broker=CLUSTER, set_as_current=False)
    with pytest.raises(ConfigError, match=r"^the Celery app's broker_url .* is a Redis Cluster"):
        install(app, load_settings(redis_url="redis://127.0.0.1:1/0"))


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:6379/0", "redis+sentinel://h1:26379,h2:26380/orders",
                                    "amqp://guest:guest@127.0.0.1:5672//"])
def test_a_cluster_store_with_another_celery_broker_is_installed(broker: str) -> None:
    app = install(Celery("t-cluster", set_as_current=False), load_settings(redis_url=CLUSTER, celery_broker_url=broker))
    assert not str(app.conf.broker_url).startswith("redis+cluster")
    assert app.conf.broker_url == celery_broker(broker).url


def test_the_stock_workers_stop_at_once_on_a_cluster_store_without_a_celery_broker() -> None:
    """``celery -A mqorder.app worker``: one line and exit 2, not a worker that fails at its first fetch."""
    env = {**os.environ, "MQORDER_REDIS_URL": CLUSTER, "MQORDER_LISTENERS": ""}
    env.pop("MQORDER_CELERY_BROKER_URL", None)
    proc = subprocess.run([sys.executable, "-c", "import mqorder.app"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("mqorder.app: MQORDER_REDIS_URL (Celery's broker, since"), proc.stderr
    assert_names_the_choices(proc.stderr)


def test_the_stock_workers_take_a_cluster_store_with_a_plain_redis_celery_broker() -> None:
    env = {**os.environ, "MQORDER_REDIS_URL": CLUSTER, "MQORDER_CELERY_BROKER_URL": "redis://127.0.0.1:6390/3",
           "MQORDER_LISTENERS": ""}
    code = "import json; from mqorder.app import app; print(json.dumps(app.conf.broker_url))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == "redis://127.0.0.1:6390/3"


def test_doctor_fails_a_celery_configuration_whose_broker_is_the_cluster() -> None:
    settings = load_settings(redis_url=CLUSTER)
    found = {f.check: f for f in celery_findings(settings, {"broker_url": None, "accept_content": ["json"]})}
    assert found["celery broker"].verdict is Verdict.FAIL
    assert_names_the_choices(found["celery broker"].detail)
    ok = celery_findings(load_settings(redis_url=CLUSTER, celery_broker_url="redis://h:6379/0"), {})
    assert "celery broker" not in {f.check for f in ok}

"""Celery's own broker may be Redis or RabbitMQ: which URLs are taken, how their passwords are
hidden, and which Celery settings each broker gets (Redis transport options only on Redis)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from celery import Celery

from mqorder.celery.setup import install
from mqorder.errors import BrokerUnavailableError, ConfigError
from mqorder.settings import load_settings
from mqorder.store.brokers import check_celery_broker_url, redact_url
from mqorder.testing.embedded import free_port
from mqorder.testing.rabbit_vhost import RabbitVhost
from tests.support import ROOT, Cluster, wait_for

REDIS = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    "url",
    ["amqp://guest:guest@127.0.0.1:5672//", "amqps://u:p@rabbit.example:5671/prod", "pyamqp://127.0.0.1//",
     "amqp://", "amqp://u:p@h1//;amqp://u:p@h2//"],
)
def test_rabbitmq_urls_are_accepted_for_celerys_broker_and_the_store_stays_redis(url: str) -> None:
    s = load_settings(redis_url=REDIS, celery_broker_url=url)
    assert s.effective_celery_broker_url == url and s.celery_transport == "amqp"
    assert s.redis_url == REDIS


def test_redis_stays_the_default_celery_broker() -> None:
    s = load_settings(redis_url=REDIS)
    assert (s.effective_celery_broker_url, s.celery_transport) == (REDIS, "redis")
    assert load_settings(redis_url=REDIS, celery_broker_url="rediss://:pw@h:6380/1").celery_transport == "redis"


@pytest.mark.parametrize("url", ["sqs://key:hunter2@", "http://u:hunter2@h/", "kafka://h:9092"])
def test_other_celery_broker_schemes_are_refused_naming_both_choices(url: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(redis_url=REDIS, celery_broker_url=url)
    msg = str(exc.value)
    assert "MQORDER_CELERY_BROKER_URL" in msg and "redis://" in msg and "amqp://" in msg
    assert "hunter2" not in msg


def test_amqp_is_refused_for_the_store_itself() -> None:
    """Only Celery's broker may be RabbitMQ: messages, locks and offsets need Redis and its Lua."""
    with pytest.raises(ConfigError, match="MQORDER_REDIS_URL"):
        load_settings(redis_url="amqp://guest:guest@127.0.0.1:5672//")
    with pytest.raises(ConfigError, match="MQORDER_BROKERS"):
        load_settings(redis_url=REDIS, brokers={"b": "amqp://127.0.0.1//"})


def test_a_failover_list_must_not_mix_redis_and_rabbitmq() -> None:
    with pytest.raises(ConfigError, match="mixes Redis and RabbitMQ") as exc:
        check_celery_broker_url("amqp://u:s3cret@h1//;redis://:s3cret@h2:6379/0")
    assert "s3cret" not in str(exc.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("amqp://guest:guest@127.0.0.1:5672//", "amqp://guest:***@127.0.0.1:5672//"),
        ("amqps://svc:p%40ss@rabbit:5671/prod?heartbeat=30", "amqps://svc:***@rabbit:5671/prod?heartbeat=30"),
        ("pyamqp://u:pw@h/vh", "pyamqp://u:***@h/vh"),
        ("amqp://u:one@h1//;amqp://u:two@h2:5673//", "amqp://u:***@h1//;amqp://u:***@h2:5673//"),
        ("amqp://127.0.0.1//", "amqp://127.0.0.1//"),
        # A ';' inside a password does not start another URL: the password stays hidden whole.
        ("redis://:pa;ss@h:6379/0", "redis://:***@h:6379/0"),
    ],
)
def test_amqp_passwords_are_redacted_like_redis_ones(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_mqorder_config_accepts_rabbitmq_and_prints_it_redacted() -> None:
    """The issue's new user: ``MQORDER_CELERY_BROKER_URL=amqp://...`` stopped every command."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "MQORDER_REDIS_URL": REDIS,
           "MQORDER_CELERY_BROKER_URL": "amqp://guest:topsecret@127.0.0.1:5672//"}
    proc = subprocess.run([sys.executable, "-m", "mqorder.cli", "config"], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["celery_broker_url"] == "amqp://guest:***@127.0.0.1:5672//"
    assert "topsecret" not in proc.stdout + proc.stderr


def _installed(broker_url: str, own: dict[str, object] | None = None) -> Celery:
    app = Celery("t-broker", broker=broker_url, set_as_current=False)
    if own is not None:
        app.conf.broker_transport_options = own
    return install(app, load_settings(redis_url=REDIS))


def test_redis_transport_options_are_set_only_for_a_redis_broker() -> None:
    redis_app = _installed(REDIS)
    assert redis_app.conf.broker_transport_options == {"visibility_timeout": 3600}
    rabbit_app = _installed("amqp://guest:guest@127.0.0.1:5672//")
    assert rabbit_app.conf.broker_transport_options == {}
    assert rabbit_app.conf.worker_direct is True  # per-worker queues, native on RabbitMQ
    # The application's own options win on either broker.
    assert _installed(REDIS, {"visibility_timeout": 60}).conf.broker_transport_options == {"visibility_timeout": 60}
    assert _installed("amqp://", {"confirm_publish": True}).conf.broker_transport_options == {"confirm_publish": True}


@pytest.mark.parametrize(
    ("broker", "expected"),
    [(None, {"ack_emulation": False, "visibility_timeout": 3600}), ("amqp://guest:guest@127.0.0.1:5672//", {})],
)
def test_reference_app_gets_redis_options_only_on_redis(broker: str | None, expected: dict[str, object]) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "MQORDER_REDIS_URL": REDIS}
    if broker:
        env["MQORDER_CELERY_BROKER_URL"] = broker
    code = "import json; from workers.app import app; print(json.dumps([app.conf.broker_url, app.conf.broker_transport_options]))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    url, options = json.loads(proc.stdout.strip().splitlines()[-1])
    assert url == (broker or REDIS) and options == expected


@pytest.mark.e2e
@pytest.mark.rabbitmq
def test_tasks_a_killed_worker_had_fetched_go_back_to_its_rabbitmq_queue(rabbitmq: RabbitVhost, cluster: Cluster) -> None:
    """What RabbitMQ gives over Redis (README, "Choosing Celery's broker"): a task delivered to a
    worker that dies before acking it is requeued by the broker, not lost with the process."""
    from celery.utils.nodenames import worker_direct

    cluster.celery_broker_url = rabbitmq.url
    w = cluster.start_worker("kw", concurrency=1)
    direct = worker_direct(w.hostname).name
    app = Celery("t-kill", broker=rabbitmq.url, set_as_current=False)
    try:
        # Registered in Redis is not yet consuming from RabbitMQ: pause it only once it is.
        wait_for(lambda: rabbitmq.queues("consumers").get(direct, 0) >= 1, timeout=30, interval=0.3,
                 what="the worker consuming its direct queue")
        w.signal(signal.SIGSTOP)
        for _ in range(3):  # with countdowns: held unacked in the worker until due (as suspend-and-requeue does)
            app.send_task("mqorder.lock_all", queue=worker_direct(w.hostname), countdown=60)
        wait_for(lambda: rabbitmq.queues("messages_unacknowledged").get(direct, 0) >= 1, timeout=30, interval=0.3,
                 what="a task delivered to the paused worker")
        w.kill()
        wait_for(lambda: rabbitmq.queues().get(direct) == 3, timeout=30, interval=0.3,
                 what="all 3 tasks back in the killed worker's queue")
        assert rabbitmq.queues("messages_unacknowledged").get(direct) == 0
    finally:
        w.signal(signal.SIGCONT)  # a paused worker (if a wait failed) cannot take the teardown's SIGTERM
        app.close()


@pytest.mark.rabbitmq
def test_an_unreachable_rabbitmq_fails_saying_how_to_get_it_and_leaves_no_vhost() -> None:
    """The RabbitMQ variants fail (never skip) without RabbitMQ, with what to do."""
    vhost = RabbitVhost("mqorder-test", port=free_port())
    with pytest.raises(BrokerUnavailableError, match="cannot open an AMQP connection.*rabbitmq-server"):
        with vhost:
            pass
    assert vhost.name not in RabbitVhost().ctl("list_vhosts", "--quiet").split()


def test_a_missing_rabbitmqctl_fails_saying_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mqorder.testing.rabbit_vhost.shutil.which", lambda name: None)
    with pytest.raises(BrokerUnavailableError, match="rabbitmqctl is not installed.*apt-get install -y rabbitmq-server"):
        RabbitVhost().start()


def test_install_keeps_the_apps_own_results_says_what_it_replaces_and_carries_its_settings(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Celery user's walk-through: install() set task_ignore_result=True for the whole app (their
    `add.delay(2, 3).get()` answered None), replaced their pickle serializer and their prefetch
    without a word, and the worker's consumer read the environment's Redis, not the settings
    install() was given (it joined redis://127.0.0.1:6379/0 and consumed nothing)."""
    from mqorder.celery.app_settings import settings_of

    app = Celery("t-own", broker=REDIS, set_as_current=False)
    app.conf.update(task_serializer="pickle", accept_content=["pickle", "json"], worker_prefetch_multiplier=8,
                    result_backend="redis://127.0.0.1:6399/1")
    mine = load_settings(redis_url="redis://127.0.0.1:6399/0")
    with caplog.at_level("WARNING", logger="mqorder.celery.setup"):
        install(app, mine)
    assert not app.conf.task_ignore_result and app.conf.result_backend == "redis://127.0.0.1:6399/1"
    assert app.tasks["mqorder.consume_request"].ignore_result  # mqorder's own tasks still keep none
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "task_serializer='json' replaces the app's 'pickle'" in said
    assert "accept_content=['json'] replaces the app's ['pickle', 'json']" in said
    assert "worker_prefetch_multiplier=1 replaces the app's 8" in said
    assert settings_of(app) is mine
    caplog.clear()
    with caplog.at_level("WARNING", logger="mqorder.celery.setup"):
        install(Celery("t-plain", broker=REDIS, set_as_current=False), mine)  # Celery's defaults: nothing to say
    assert not caplog.records

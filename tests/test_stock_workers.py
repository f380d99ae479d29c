"""The stock workers run exactly the listener modules ``MQORDER_LISTENERS`` names (issue 24).

A worker started the way the README says, for a user's module with one group on topic
``orders``, must join that group only: not the demo's ``order-lifecycle`` (which consumed every
message of ``orders`` a second time, counted it as "bad" and wrote ``demo:*`` keys). Checked on
real ``celery worker`` subprocesses of both stock apps: the checkout's ``workers.app`` and the
installed package's ``mqorder.app``; the worker's own registration in Redis says which groups it
joined. A module that cannot be imported stops the worker with a message naming it.
"""

from __future__ import annotations

import json

import pytest
import redis

from mqorder import Producer, keys
from mqorder.rebalance.membership import decode_subscriptions
from mqorder.testing.launcher import WorkerProcess
from tests import user_listeners
from tests.support import ROOT, Cluster, wait_for

pytestmark = pytest.mark.e2e

STOCK_APPS = ("workers.app", "mqorder.app")


def _start(cluster: Cluster, name: str, app: str, listeners: str, *, wait: bool = True) -> WorkerProcess:
    """A stock worker of ``app`` for ``listeners`` only, stopped with the cluster at teardown."""
    w = WorkerProcess(name, env=cluster.env(MQORDER_LISTENERS=listeners), app=app, logfile=cluster.tmp / f"{name}.log",
                      cwd=ROOT, loglevel="INFO")
    cluster.workers[name] = w
    w.start()
    if wait:
        w.wait_registered(cluster.client, timeout=60)
    return w


@pytest.mark.parametrize("app", STOCK_APPS)
def test_a_worker_for_a_user_module_joins_only_the_users_group(cluster: Cluster, r: redis.Redis, app: str) -> None:
    producer = Producer(cluster.url)
    producer.create_topic(user_listeners.TOPIC, queues=4)
    worker = _start(cluster, "stock1", app, "tests.user_listeners")

    subs = decode_subscriptions(r.hget(keys.client_info(worker.hostname), "subs") or b"[]")
    assert {(s.group, s.topic) for s in subs} == {(user_listeners.GROUP, user_listeners.TOPIC)}

    sent = [json.dumps({"order": i % 10, "seq": i}).encode() for i in range(60)]
    producer.send_orderly_batch(user_listeners.TOPIC, [(str(i % 10), b) for i, b in enumerate(sent)])
    wait_for(lambda: r.llen(user_listeners.SEEN) >= len(sent), timeout=60, what="every message handled")
    assert sorted(r.lrange(user_listeners.SEEN, 0, -1)) == sorted(sent)

    # Nobody else subscribed to the topic, and the demo listener wrote nothing.
    assert {m.decode() for m in r.smembers(keys.topic_subs(user_listeners.TOPIC))} == {user_listeners.GROUP}
    assert {g.decode() for g in r.hkeys(keys.groups())} == {user_listeners.GROUP}
    assert r.keys("demo:*") == []
    producer.close()


@pytest.mark.parametrize("app", STOCK_APPS)
def test_a_listener_module_that_cannot_be_imported_stops_the_worker_naming_it(cluster: Cluster, app: str) -> None:
    worker = _start(cluster, "stock-bad", app, "tests.user_listeners,tests.no_such_listeners", wait=False)
    assert worker.proc is not None
    code = worker.proc.wait(60)
    assert code != 0
    log = (cluster.tmp / "stock-bad.log").read_text()
    assert "MQORDER_LISTENERS names 'tests.no_such_listeners', which cannot be imported" in log
    assert cluster.client.zscore(keys.clients(), worker.hostname) is None


def test_a_listener_module_importing_the_apps_package_runs_on_the_worker(cluster: Cluster, r: redis.Redis) -> None:
    """Celery's usual layout (``proj/__init__.py: from .celery import app``; ``proj/celery.py`` calls
    ``install``; the listener module does ``from proj import app``) was a circular import at
    ``install``: "cannot import name 'app' from partially initialized module 'proj'", the worker
    did not start. ``install`` now defers such a module to the worker's start, as Celery's
    ``autodiscover_tasks`` is lazy."""
    import textwrap

    pkg = cluster.tmp / "userapp" / "proj"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .celery import app\n")
    (pkg / "celery.py").write_text(textwrap.dedent("""
        from celery import Celery
        import mqorder.celery
        app = Celery("proj")
        app.config_from_object("config.celeryconfig")
        mqorder.celery.install(app)
    """))
    (pkg / "listeners.py").write_text(textwrap.dedent("""
        import redis
        from mqorder import ConsumeOrderlyStatus, orderly_listener
        from proj import app  # the app's package: still being imported while install() runs

        @app.task
        def report():  # an ordinary task of the same module
            return "ok"

        @orderly_listener(topic="circ", group="g-circ")
        def on_msg(msgs, ctx):
            c = redis.Redis.from_url(app.conf.broker_url)
            for m in msgs:
                c.rpush("seen:circ", m.body)
            return ConsumeOrderlyStatus.SUCCESS
    """))
    env = cluster.env(MQORDER_LISTENERS="proj.listeners")
    env["PYTHONPATH"] = f"{cluster.tmp / 'userapp'}:{ROOT}"
    import subprocess
    import sys

    plain = subprocess.run([sys.executable, "-c", "import proj; print(sorted(proj.app.tasks)[:0])"], env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr[-800:]
    producer = Producer(cluster.url)
    producer.create_topic("circ", queues=2)
    w = WorkerProcess("circ1", env=env, app="proj", logfile=cluster.tmp / "circ1.log", cwd=ROOT, loglevel="INFO")
    cluster.workers["circ1"] = w
    w.start()
    w.wait_registered(cluster.client, timeout=60)
    producer.send_orderly_batch("circ", [("k", b"%d" % i) for i in range(5)])
    wait_for(lambda: r.llen("seen:circ") >= 5, timeout=60, what="the deferred listener consuming")
    assert r.lrange("seen:circ", 0, -1) == [b"%d" % i for i in range(5)]
    producer.close()

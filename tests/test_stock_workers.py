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

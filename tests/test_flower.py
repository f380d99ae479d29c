"""Flower watches the stock workers: a real ``celery flower`` process against a real worker, with
Celery's broker on Redis or on RabbitMQ."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from mqorder.testing.embedded import free_port
from mqorder.testing.rabbit_vhost import RabbitVhost
from tests.support import ROOT, Cluster, wait_for

pytestmark = pytest.mark.e2e


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except Exception:  # noqa: BLE001
        return 0, b""


def test_flower_serves_the_stock_workers(cluster: Cluster) -> None:
    w = cluster.start_worker("fw")
    port = free_port()
    env = cluster.env(FLOWER_UNAUTHENTICATED_API="true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/healthcheck")[0] == 200, timeout=30, what="flower healthcheck")

        def worker_listed() -> bool:
            status, data = _get(f"{base}/api/workers?refresh=1")
            return status == 200 and w.hostname in json.loads(data or b"{}")

        wait_for(worker_listed, timeout=30, interval=0.5, what="worker listed by flower")
        status, data = _get(f"{base}/api/workers")
        assert "mqorder.consume_request" in json.dumps(json.loads(data)[w.hostname].get("registered", []))
    finally:
        proc.terminate()
        proc.wait(10)
        time.sleep(0.1)


def _management_api(vhost: RabbitVhost) -> str:
    """The RabbitMQ management API Flower reads queue lengths from, or a failure saying how to
    turn it on (``make test`` does): without it Flower shows RabbitMQ's workers and tasks but no
    queue lengths."""
    base = f"http://{vhost.host}:15672/api/"
    req = urllib.request.Request(f"{base}overview")
    req.add_header("Authorization", "Basic " + base64.b64encode(f"{vhost.user}:{vhost.password}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
    except OSError as exc:
        pytest.fail(f"RabbitMQ's management API does not answer at {base} ({exc}); Flower needs it for RabbitMQ "
                    "queue lengths: `rabbitmq-plugins enable rabbitmq_management`", pytrace=False)
    return base


@pytest.mark.rabbitmq
def test_flower_shows_the_rabbitmq_queues_of_the_stock_workers(rabbitmq: RabbitVhost, cluster: Cluster) -> None:
    """With RabbitMQ as Celery's broker, Flower lists each worker's direct queue and the default
    queue with their RabbitMQ message counts (``/api/queues/length``, the Broker page): five tasks
    published to a paused worker's direct queue show as five, then as none once it resumes."""
    from celery import Celery
    from celery.utils.nodenames import worker_direct

    _management_api(rabbitmq)
    cluster.celery_broker_url = rabbitmq.url
    w = cluster.start_worker("fw")
    direct = worker_direct(w.hostname).name
    port = free_port()
    env = cluster.env(FLOWER_UNAUTHENTICATED_API="true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    app = Celery("t-flower", broker=rabbitmq.url, set_as_current=False)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/healthcheck")[0] == 200, timeout=30, what="flower healthcheck")

        def lengths() -> dict[str, int]:
            status, data = _get(f"{base}/api/queues/length")
            if status != 200:
                return {}
            return {q["name"]: int(q.get("messages", 0)) for q in json.loads(data)["active_queues"]}

        def worker_queues() -> bool:
            status, data = _get(f"{base}/api/workers?refresh=1")
            info = json.loads(data or b"{}").get(w.hostname, {}) if status == 200 else {}
            return direct in {q["name"] for q in info.get("active_queues", [])}

        wait_for(worker_queues, timeout=30, interval=0.5, what="the worker's RabbitMQ queues listed by flower")
        wait_for(lambda: {direct, "celery"} <= set(lengths()), timeout=30, interval=0.5,
                 what=f"{direct} and celery in /api/queues/length")
        w.signal(signal.SIGSTOP)
        try:
            for _ in range(5):
                app.send_task("mqorder.lock_all", queue=worker_direct(w.hostname))
            # The management API refreshes its queue statistics every 5 s.
            wait_for(lambda: lengths().get(direct) == 5, timeout=30, interval=0.5, what="5 messages shown")
        finally:
            w.signal(signal.SIGCONT)
        wait_for(lambda: lengths().get(direct) == 0, timeout=30, interval=0.5, what="the queue shown empty")
        status, page = _get(f"{base}/broker")
        assert status == 200 and direct.encode() in page
    finally:
        app.close()
        proc.terminate()
        proc.wait(10)
        time.sleep(0.1)

"""Redis AUTH and TLS end to end (real redis-server with requirepass / tls-port, real workers),
JSON-only Celery, and no password in any log line."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import WorkerProcess, project_env
from tests.support import FAST, ROOT, body, check_order, ledger, wait_for

PASSWORD = "pw-9f8e7d-secret"


@pytest.mark.e2e
@pytest.mark.parametrize("tls", [False, True], ids=["auth", "tls+auth"])
def test_workers_consume_in_order_over_auth_and_tls_and_never_log_the_password(tmp_path: Path, tls: bool) -> None:
    with RedisServer(password=PASSWORD, tls=tls) as srv:
        p = Producer(srv.url)
        p.create_topic("t-order", queues=2)
        for seq in range(1, 11):
            p.send_orderly_batch("t-order", [(f"k{i}", body(f"k{i}", seq)) for i in range(10)])
        log = tmp_path / "w.log"
        w = WorkerProcess("sec", env=project_env(srv.url, **FAST), logfile=log, cwd=ROOT, loglevel="DEBUG")
        client = redis.Redis.from_url(srv.url)
        try:
            w.start()
            w.wait_registered(client, timeout=60)
            wait_for(lambda: check_order(ledger(client, "g-order"))[1] == 100, timeout=60, what="100 handled")
        finally:
            w.stop()
        violations, handled, _ = check_order(ledger(client, "g-order"))
        assert violations == [] and handled == 100
        text = log.read_text(errors="replace")
        assert "mqorder: client" in text  # the log is real and covers the worker's life
        assert PASSWORD not in text


def test_celery_app_accepts_json_only() -> None:
    from workers.app import app

    assert list(app.conf.accept_content) == ["json"]
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
    assert app.conf.worker_direct is True
    names = {e["task"] for e in app.conf.beat_schedule.values()}
    assert {"mqorder.rebalance", "mqorder.lock_all"} <= names

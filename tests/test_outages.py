"""Redis outages with real workers: a worker started before Redis answers, and Redis killed and
restarted from its AOF mid-stream (appendfsync always: nothing acknowledged may be lost)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.errors import BrokerUnavailableError
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import WorkerProcess, project_env
from tests.support import FAST, ROOT, body, check_order, ledger, wait_for

pytestmark = pytest.mark.e2e


def test_worker_started_before_redis_answers_starts_consuming_when_it_does(tmp_path: Path) -> None:
    srv = RedisServer(appendonly=True, appendfsync="always")
    w = WorkerProcess("early", env=project_env(srv.url, **FAST), logfile=tmp_path / "w.log", cwd=ROOT, loglevel="INFO")
    try:
        w.start()
        # Redis starts only once the worker said it cannot reach it (a fixed sleep was too short
        # for a worker starting on a loaded machine), then a while longer than the worker's wait
        # for its wake-up subscription.
        log = tmp_path / "w.log"
        wait_for(lambda: log.exists() and "cannot reach Redis" in log.read_text(), timeout=120,
                 what="the worker saying it cannot reach Redis")
        time.sleep(6)
        assert w.alive()
        srv.start()
        client = redis.Redis.from_url(srv.url)
        w.wait_registered(client, timeout=60)
        p = Producer(srv.url)
        p.create_topic("t-order", queues=2)
        p.send_orderly_batch("t-order", [(f"k{i}", body(f"k{i}", 1)) for i in range(20)])
        wait_for(lambda: check_order(ledger(client, "g-order"))[1] == 20, timeout=60, what="20 handled")
    finally:
        w.stop()
        srv.stop()


def test_redis_killed_and_restarted_from_aof_mid_stream_loses_nothing_and_keeps_order(tmp_path: Path) -> None:
    srv = RedisServer(appendonly=True, appendfsync="always").start()
    client = redis.Redis.from_url(srv.url)
    p = Producer(srv.url)
    p.create_topic("t-order", queues=4)
    client.hset("ctl:g-order", "sleep_ms", 2)
    workers = [
        WorkerProcess(f"o{i}", env=project_env(srv.url, **FAST), logfile=tmp_path / f"w{i}.log", cwd=ROOT, loglevel="INFO")
        for i in (1, 2)
    ]
    acked: list[tuple[str, int]] = []
    stop = threading.Event()

    def produce() -> None:
        prod = Producer(srv.url, send_msg_timeout_ms=1000)
        seq: dict[str, int] = {}
        i = 0
        while not stop.is_set():
            key = f"k{i % 50}"
            n = seq.get(key, 0) + 1
            try:
                prod.send_orderly("t-order", body(key, n), sharding_key=key)
            except BrokerUnavailableError:
                time.sleep(0.2)  # not acknowledged (appendfsync always: it was not stored either)
                continue
            seq[key] = n
            acked.append((key, n))
            i += 1
            time.sleep(0.003)

    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_registered(client, timeout=60)
        t = threading.Thread(target=produce)
        t.start()
        time.sleep(3)
        srv.kill()
        time.sleep(2)
        srv.start()
        time.sleep(4)
        stop.set()
        t.join()
        client = redis.Redis.from_url(srv.url)
        total = len(acked)
        wait_for(lambda: check_order(ledger(client, "g-order"))[1] >= total, timeout=90, what=f"{total} handled")
        violations, handled, _ = check_order(ledger(client, "g-order"))
        assert violations == []
        assert handled == total  # every acknowledged send was handled, in order per key
        assert total > 500
    finally:
        stop.set()
        for w in workers:
            w.stop()
        srv.stop()

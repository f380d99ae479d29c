"""A worker that takes another mqorder store's beat task says so (``mqorder.celery.beat_origin``).

Two applications with stores of their own on one Celery broker and default queue ran each other's
``rebalance``, ``lock_all`` and ``transaction_check`` against their own stores, and nothing said
so (a configuration walk-through; OPERATING.md, "Several applications on one Redis"). A beat
task now carries its publisher's store id (``mqorder.store.identity``), and a worker of another
store that takes it logs a WARNING naming the fix. Real workers, a real beat, a real redis-server
(its databases as the stores and Celery's broker)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import redis

from mqorder.celery import beat_origin
from mqorder.settings import load_settings
from mqorder.store.identity import store_id
from mqorder.testing.launcher import BeatProcess, project_env
from tests.support import FAST, ROOT, Cluster

WARNING = "from another mqorder store"


def on_db(url: str, db: int, host: str | None = None) -> str:
    """``url`` with its database (and host) changed."""
    base = re.sub(r"/\d*$", "", url)
    if host is not None:
        base = re.sub(r"//[^:/]+", f"//{host}", base)
    return f"{base}/{db}"


def test_a_store_id_tells_stores_apart_not_how_their_urls_are_spelt(redis_url: str, r: redis.Redis) -> None:
    one = store_id(redis.Redis.from_url(on_db(redis_url, 0, "127.0.0.1")))
    assert one and store_id(redis.Redis.from_url(on_db(redis_url, 0, "localhost"))) == one
    other = store_id(redis.Redis.from_url(on_db(redis_url, 1)))
    assert other and other != one
    r.flushall()  # a store emptied is a new store
    assert store_id(r) not in ("", one)


def test_only_a_beat_task_of_another_store_gets_the_warning(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(beat_origin, "_ids", {})  # ids an earlier test's publishes kept (its store was flushed)
    ours, theirs = load_settings(redis_url=on_db(redis_url, 0)), load_settings(redis_url=on_db(redis_url, 1))
    here = (redis.Redis.from_url(ours.redis_url), ours.redis_url)  # the worker's store
    headers: dict[str, object] = {}
    beat_origin.stamp("mqorder.lock_all", headers, theirs)
    other_id = headers[beat_origin.HEADER]
    message = beat_origin.foreign_store_warning("mqorder.lock_all", str(other_id), *here)
    assert message is not None and str(other_id) in message and "MQORDER_CELERY_BROKER_URL" in message
    mine: dict[str, object] = {}
    beat_origin.stamp("mqorder.rebalance", mine, ours)
    assert beat_origin.foreign_store_warning("mqorder.rebalance", str(mine[beat_origin.HEADER]), *here) is None
    assert beat_origin.foreign_store_warning("mqorder.rebalance", None, *here) is None  # an older publisher
    untouched: dict[str, object] = {}
    beat_origin.stamp("tasks.add", untouched, ours)  # the application's own tasks are left alone
    assert untouched == {}


def test_a_publisher_whose_store_does_not_answer_stamps_nothing_and_does_not_ask_every_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Beat never waited on the store before: a store that does not answer costs one timeout per
    ``ID_TTL_S``, not one per beat task, and the tasks go unstamped (so unchecked)."""
    import socket

    monkeypatch.setattr(beat_origin, "_ids", {})
    silent = socket.socket()  # accepts connections (the backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        settings = load_settings(redis_url=f"redis://127.0.0.1:{port}/0?socket_timeout=0.5")
        t0 = time.monotonic()
        headers: dict[str, object] = {}
        beat_origin.stamp("mqorder.lock_all", headers, settings)
        first = time.monotonic() - t0
        for name in ("mqorder.rebalance", "mqorder.transaction_check", "mqorder.lock_all"):
            beat_origin.stamp(name, headers, settings)
        assert headers == {}
        assert time.monotonic() - t0 < first + 0.4  # the later ticks did not wait on it again
    finally:
        silent.close()


def _succeeded(log: Path, task: str) -> int:
    return log.read_text(errors="replace").count(f"Task {task}[") if log.exists() else 0


def test_a_worker_names_the_beat_of_another_store_sharing_its_celery_broker(
        cluster: Cluster, redis_url: str, tmp_path: Path) -> None:
    broker = on_db(redis_url, 9)  # one Celery broker for both applications
    cluster.celery_broker_url = broker
    fast_beat = {"MQORDER_REBALANCE_INTERVAL_MS": "1000", "MQORDER_LOCK_INTERVAL_MS": "1000"}
    worker = cluster.start_worker("wa", concurrency=1)
    log = tmp_path / "wa.log"
    cluster.start_beat(**fast_beat)  # this store's own beat: no warning
    deadline = time.monotonic() + 60
    while _succeeded(log, "mqorder.lock_all") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _succeeded(log, "mqorder.lock_all") >= 3, worker.output_tail()
    assert WARNING not in log.read_text()
    assert cluster.beat is not None
    cluster.beat.stop()

    other_store = on_db(redis_url, 1)
    other = BeatProcess(env=project_env(other_store, **{**FAST, **fast_beat, "MQORDER_CELERY_BROKER_URL": broker}),
                        workdir=tmp_path / "beat-b", logfile=tmp_path / "beat-b.log", cwd=ROOT).start()
    try:
        deadline = time.monotonic() + 60
        while WARNING not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert WARNING in text, worker.output_tail()
        other_id = store_id(redis.Redis.from_url(other_store))
        line = next(line for line in text.splitlines() if WARNING in line)
        assert other_id in line and "task_default_queue" in line
        before = _succeeded(log, "mqorder.lock_all")
        while _succeeded(log, "mqorder.lock_all") < before + 3 and time.monotonic() < deadline + 30:
            time.sleep(0.2)
        assert log.read_text().count(WARNING) == 1  # once per other store, not per task
    finally:
        other.stop()

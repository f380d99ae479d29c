"""A Django project's worker: its listener modules import models, and its database connections
are closed around every listener call as Celery's Django fixup does per task
(``mqorder.celery.django_fixup``), on real workers with a real sqlite database."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import redis

from mqorder import Producer, keys
from mqorder.store.log import MessageLog
from tests.support import Cluster, body, wait_for

pytestmark = pytest.mark.e2e


def _rows(db: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT k, s FROM handled ORDER BY rowid").fetchall()


@pytest.mark.parametrize("topic,group", [("t-django", "g-django"), ("t-django-async", "g-django-async")])
def test_key_mode_calls_reconnect_after_the_database_went_away(cluster: Cluster, r: redis.Redis, tmp_path: Path,
                                                              topic: str, group: str) -> None:
    """Key mode's lane threads (and asgiref's thread-sensitive thread, for an async listener) live
    as long as the process: before the fixup a connection the database dropped stayed there, every
    later call on it raised, and every new message went to the DLQ until the worker restarted (a
    Django walk-through: 100 of 100). Also: a listener module that imports models is deferred to
    the worker's start (it raised AppRegistryNotReady inside install(), which broke every process
    importing the project)."""
    db = tmp_path / "django.sqlite3"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE handled (k TEXT, s INTEGER)")
    p = Producer(cluster.url)
    p.create_topic(topic, queues=2)
    cluster.start_worker("w1", MQORDER_LISTENERS="tests.django_listeners", DJANGO_SETTINGS_MODULE="tests.django_settings",
                         MQORDER_TEST_DJANGO_DB=str(db))
    ks = [f"k{i}" for i in range(8)]
    for s in range(1, 6):
        p.send_orderly_batch(topic, [(k, body(k, s)) for k in ks])
    wait_for(lambda: len(_rows(db)) >= 40, timeout=60, what="40 rows")
    r.hset(f"ctl:{group}", "drop_at", time.time())  # every connection open now is dead
    for s in range(6, 11):
        p.send_orderly_batch(topic, [(k, body(k, s)) for k in ks])
    wait_for(lambda: len(_rows(db)) >= 80, timeout=60, what="80 rows")
    rows = _rows(db)
    for k in ks:
        assert [s for kk, s in rows if kk == f"{group}/{k}"] == list(range(1, 11))
    dead = p.describe_topic(keys.dlq_topic(group)).message_queues
    assert sum(MessageLog(p.brokers).max_offset(mq) for mq in dead) == 0

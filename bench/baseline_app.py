"""What the two Celery baselines (naive, single-lane) share: a JSON-only app on
``BENCH_BROKER_URL`` and a per-process Redis client for their records."""

from __future__ import annotations

import os

import redis
from celery import Celery

_r: redis.Redis | None = None


def make_app(name: str) -> Celery:
    app = Celery(name, broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"))
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        worker_send_task_events=False,
    )
    return app


def r() -> redis.Redis:
    """This process's client (re-created after a fork: prefork children must not share it)."""
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["BENCH_BROKER_URL"])
    return _r

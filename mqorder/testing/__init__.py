"""Testing an application's listeners, producers and transaction checkers (docs/TESTING.md).

* Unit tests, no server: :func:`make_message`, :func:`make_orderly_context` and
  :func:`make_concurrent_context` build what a listener is called with;
  :func:`isolated_listeners` / :func:`clear_listeners` undo a test's listener registrations;
  :func:`check_transactions` runs the transaction check-back once, in the test's process.
* Integration tests on real servers: a throw-away ``redis-server`` (:class:`RedisServer`), real
  ``celery worker`` / ``beat`` subprocesses (:class:`WorkerProcess`, :class:`BeatProcess`,
  :func:`project_env` for their environment), a RabbitMQ vhost (:class:`RabbitVhost`), a
  Sentinel or Redis Cluster deployment.

mqorder's own tests, benchmarks, chaos runs and demo use the same harnesses. The names are loaded
on first use, so ``import mqorder.testing`` costs nothing until one is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mqorder.testing.builders import make_concurrent_context, make_message, make_orderly_context
    from mqorder.testing.cluster import ClusterDeployment
    from mqorder.testing.embedded import RedisServer, free_port
    from mqorder.testing.launcher import BeatProcess, WorkerProcess, project_env
    from mqorder.testing.listeners import clear_listeners, isolated_listeners
    from mqorder.testing.rabbit_vhost import RabbitVhost
    from mqorder.testing.sentinel import SentinelDeployment
    from mqorder.testing.transactions import check_transactions

#: Each exported name and the module that defines it.
_EXPORTS = {
    "make_message": "builders",
    "make_orderly_context": "builders",
    "make_concurrent_context": "builders",
    "ClusterDeployment": "cluster",
    "RedisServer": "embedded",
    "free_port": "embedded",
    "WorkerProcess": "launcher",
    "BeatProcess": "launcher",
    "project_env": "launcher",
    "clear_listeners": "listeners",
    "isolated_listeners": "listeners",
    "RabbitVhost": "rabbit_vhost",
    "SentinelDeployment": "sentinel",
    "check_transactions": "transactions",
}

__all__ = [
    "BeatProcess",
    "ClusterDeployment",
    "RabbitVhost",
    "RedisServer",
    "SentinelDeployment",
    "WorkerProcess",
    "check_transactions",
    "clear_listeners",
    "free_port",
    "isolated_listeners",
    "make_concurrent_context",
    "make_message",
    "make_orderly_context",
    "project_env",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mqorder.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mqorder.testing.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

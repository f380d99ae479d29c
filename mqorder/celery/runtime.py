"""The per-process consumer engine used by the ``consume_request`` task.

Created lazily in each pool process (after fork), because kombu and redis-py connections must not
be shared across a fork.
"""

from __future__ import annotations

import os
import threading

from mqorder.consumer.consume_request import ConsumerEngine
from mqorder.settings import get_settings

_lock = threading.Lock()
_engines: dict[tuple[int, str], ConsumerEngine] = {}
#: Set by the worker bootstep when tasks run in the worker's own process (threads pool).
_linger_pid: int | None = None


def enable_linger(pool: object) -> None:
    """Let drained ConsumeRequests linger when this worker's pool runs tasks in-process.

    Only the threads pool qualifies: its tasks can see Celery's own bookkeeping of requests
    received but not yet started. Prefork children cannot, and solo cannot receive while a task
    runs, so a lingering request there could keep another queue waiting.
    """
    global _linger_pid
    if type(pool).__module__.endswith(".thread"):
        _linger_pid = os.getpid()


def may_linger() -> bool:
    """True while no received ConsumeRequest is waiting for a free slot in this worker, and the
    worker is not shutting down (a warm shutdown waits for active tasks: do not make it wait)."""
    if _linger_pid != os.getpid():
        return False
    from celery.worker import state

    if state.should_stop is not None or state.should_terminate is not None:
        return False
    return len(state.reserved_requests) <= len(state.active_requests)


def engine_for(client_id: str) -> ConsumerEngine:
    key = (os.getpid(), client_id)
    eng = _engines.get(key)
    if eng is None:
        with _lock:
            eng = _engines.get(key)
            if eng is None:
                eng = ConsumerEngine(get_settings(), client_id)
                eng.may_linger = may_linger
                _engines[key] = eng
    return eng


def reset() -> None:
    with _lock:
        _engines.clear()

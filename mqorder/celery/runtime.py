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


def engine_for(client_id: str) -> ConsumerEngine:
    key = (os.getpid(), client_id)
    eng = _engines.get(key)
    if eng is None:
        with _lock:
            eng = _engines.get(key)
            if eng is None:
                eng = ConsumerEngine(get_settings(), client_id)
                _engines[key] = eng
    return eng


def reset() -> None:
    with _lock:
        _engines.clear()

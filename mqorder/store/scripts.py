"""Loads the ``.lua`` files once and registers them on each Redis client.

Every script is prefixed with ``_now.lua`` so that each one reads the time from Redis (``TIME``)
rather than trusting the caller's clock. redis-py's ``Script`` objects run ``EVALSHA`` and reload
the script on ``NOSCRIPT`` (after a Redis restart), so callers never see the difference.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis

NAMES = (
    "send",
    "begin",
    "commit",
    "touch",
    "finish",
    "sweep",
    "lock_batch",
    "unlock_batch",
    "assign",
)


@cache
def source(name: str) -> str:
    lua = resources.files("mqorder.store") / "lua"
    prelude = (lua / "_now.lua").read_text()
    return prelude + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    """The registered scripts of one Redis client, as attributes (``scripts.commit(keys, args)``)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - only for type checkers
        raise AttributeError(name)

"""Loads the ``.lua`` files once and registers them on each Redis client.

Every script is prefixed with the same preludes: constants generated from Python (``NOBODY``),
``_now.lua`` so that each one reads the time from Redis (``TIME``) rather than trusting the
caller's clock, ``_lock.lua`` with the lock rules every script shares (is the lock live, release a
lock), and ``_append.lua``, the one append path. redis-py's ``Script`` objects run ``EVALSHA`` and
reload the script on ``NOSCRIPT`` (after a Redis restart), so callers never see the difference.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

import redis

from mqorder import keys
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline

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
    "stage",  # mqorder.spark: a Spark task stages its rows for one queue
    "publish_staged",  # mqorder.spark: a committed job's staged rows enter the log
    "reset_offset",  # mqorder.admin.offsets: `mqorder offsets reset`, fenced
    "adopt",  # mqorder.consumer.idle_watch: a lingering request watches another idle queue
    "trim",  # mqorder.retention.trimmer: one bounded chunk of retention trimming
    "update_offset",  # mqorder.client.pull_consumer: PullConsumer.update_offset, fenced
    "txn_prepare",  # mqorder.store.transactions: phase one stores a half message
    "txn_end",  # mqorder.store.transactions: phase two (or the check-back) commits or rolls back
    "txn_due",  # mqorder.store.transactions: the check-back claims due half messages
    "delay_schedule",  # mqorder.store.delay: a delayed message waits beside its queue's log
    "delay_move",  # mqorder.store.delay: the mover appends due delayed messages, in order
    "key_commit",  # mqorder.consumer.key_request: a key-ordered run's fenced commit + offset map
)


#: Prepended to every script after the constants, in this order: the Redis clock, the shared lock
#: rules, the shared append path (which may use the lock rules), then the rules of a fenced commit.
PRELUDES = ("_now", "_lock", "_append", "_commit")

#: A constant must stay a plain Lua string literal: no quote, backslash or line break to escape.
_LUA_SAFE = re.compile(r"[^'\\\r\n]*")


def lua_string(value: str) -> str:
    """``value`` as a single-quoted Lua literal; refuses what would need escaping."""
    if not _LUA_SAFE.fullmatch(value):
        raise ValueError(f"{value!r} cannot be injected into Lua as a plain literal")
    return f"'{value}'"


def constants() -> str:
    """The Lua locals generated from Python constants, so both sides spell them alike.

    ``NOBODY`` is the assignee of a lane no live client consumes: the rebalance writes it
    (``assign.lua``) and ``finish.lua`` reads it; a second spelling in Lua could silently drift.
    """
    return f"local NOBODY = {lua_string(keys.NOBODY)}\n"


@cache
def source(name: str) -> str:
    lua = resources.files("mqorder.store") / "lua"
    parts = [(lua / f"{p}.lua").read_text() for p in PRELUDES]
    return "\n".join([constants(), *parts, (lua / f"{name}.lua").read_text()])


class Scripts:
    """The registered scripts of one Redis client, as attributes (``scripts.commit(keys, args)``)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

    def queue_in(self, pipe: Any, name: str, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Queue ``EVALSHA`` of script ``name`` on ``pipe`` *without* registering it there.

        A script called with ``client=pipe`` makes redis-py send ``SCRIPT EXISTS`` before every
        ``execute()``: one extra round trip per pulled batch on the consume path. Here the caller
        catches ``NoScriptError`` instead (only after a Redis restart or ``SCRIPT FLUSH``), calls
        ``load(name)`` and sends the pipeline again.
        """
        pipe.execute_command("EVALSHA", getattr(self, name).sha, len(keys), *keys, *args)

    def run_pipelined(self, name: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
                      via: ConnectionLease | None = None) -> list[Any]:
        """``EVALSHA`` of script ``name`` once per ``(keys, args)`` call, in one round trip.

        After ``NOSCRIPT`` (first use on this Redis, or a restart) the script is loaded and the
        pipeline sent again: every call in it was refused alike, so none of them changed anything.
        """
        for attempt in (0, 1):
            pipe = RawPipeline(via or self._client)
            for k, a in calls:
                self.queue_in(pipe, name, k, a)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self.load(name)
        raise AssertionError("unreachable")  # pragma: no cover

    def call(self, name: str, keys: Sequence[Any], args: Sequence[Any], via: ConnectionLease | None = None) -> Any:
        """One ``EVALSHA`` of script ``name`` (``run_many``'s lean round trip; the consume path's)."""
        return self.run_many([(name, keys, args)], via)[0]

    def run_many(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
                 via: ConnectionLease | None = None) -> list[Any]:
        """``EVALSHA`` of each ``(script name, keys, args)`` call, in one round trip; their replies.

        A call refused with ``NOSCRIPT`` changed nothing, so only those are sent again (their
        scripts loaded first), never one that ran; any other error of a call is raised, as a
        plain pipeline would.
        """
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in (0, 1):
            pipe = RawPipeline(via or self._client)
            for i in todo:
                self.queue_in(pipe, *calls[i])
            out = pipe.execute(raise_on_error=False)
            missing = []
            for i, res in zip(todo, out, strict=True):
                if isinstance(res, redis.exceptions.NoScriptError) and not attempt:
                    missing.append(i)
                elif isinstance(res, Exception):
                    raise res
                else:
                    replies[i] = res
            if not missing:
                return replies
            for name in {calls[i][0] for i in missing}:
                self.load(name)
            todo = missing
        raise AssertionError("unreachable")  # pragma: no cover

    def load(self, name: str) -> None:
        """(Re)load script ``name`` into Redis, e.g. after a ``NoScriptError``."""
        script = getattr(self, name)
        script.sha = self._client.script_load(script.script)

    def __getattr__(self, name: str) -> Any:  # pragma: no cover - only for type checkers
        raise AttributeError(name)

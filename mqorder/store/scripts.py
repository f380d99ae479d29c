"""Loads the ``.lua`` files once, resolves what each includes, and registers them on each client.

Each script declares the preludes it uses at its top, as bullmq's ``src/commands/*.lua`` do:
``--- @include "_lock"``. A prelude may include others (``_append`` includes ``_lock`` and
``_now``), and ``_constants`` is the block generated from Python (``NOBODY``), so both sides spell
it alike. ``source`` resolves a script once (cached): every include it reaches, each once, in
dependency order (an include before whatever includes it), then the script. So a script carries
only what it calls: ``ledger.lua`` goes out as its own 0.7 KB, not behind 12 KB of preludes, and
``touch.lua`` gets ``_now`` alone. An unknown include, a malformed include line or a cycle is an
``IncludeError`` naming the chain, raised when the scripts are loaded (``Scripts(client)``), not
on the first call of the script in production. ``tests/test_lua_includes.py`` checks that each
file's includes are exactly the preludes whose helpers (or constants) it uses.

Every script runs by SHA: redis-py's ``Script`` objects, ``queue_in`` and ``run_many`` send
``EVALSHA`` and load the script on ``NOSCRIPT`` (first use on a Redis, or after a restart), so
callers never see the difference.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import redis

from mqorder import keys
from mqorder.store.cluster_route import ClusterClient, shard_groups
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
    "txn_unclaim",  # mqorder.store.transactions: the check-back gives back claims it did not ask
    "delay_schedule",  # mqorder.store.delay: a delayed message waits beside its queue's log
    "delay_move",  # mqorder.store.delay: the mover appends due delayed messages, in order
    "key_commit",  # mqorder.consumer.key_request: a key-ordered run's fenced commit + offset map
    "ledger",  # mqorder.consumer.ledger: the consumption ledger records of a pulled batch
    "switch",  # mqorder.consumer.linger: a lingering run switches queues within its read's round trip
    "abandon",  # mqorder.consumer.client_instance: a run whose pool process died gives its queue up
)


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


#: Includes generated from Python rather than read from a file: name -> the Lua it stands for.
GENERATED: dict[str, Callable[[], str]] = {"_constants": constants}

#: A line that means to be an include (bullmq's ``--- @include "name"``), strictly or not.
_INCLUDE_LIKE = re.compile(r"^--+\s*@include\b.*$", re.MULTILINE)
_INCLUDE = re.compile(r'--- @include "([A-Za-z0-9_]+)"')


class IncludeError(ValueError):
    """A ``--- @include`` that cannot be resolved: unknown, malformed, or part of a cycle."""


def _read(name: str) -> str | None:
    """The Lua text of ``name``: a generated block, a file of ``mqorder/store/lua``, else ``None``."""
    if name in GENERATED:
        return GENERATED[name]()
    path = resources.files("mqorder.store") / "lua" / f"{name}.lua"
    return path.read_text() if path.is_file() else None


def includes(text: str, name: str) -> tuple[str, ...]:
    """The includes ``text`` (of file ``name``) declares, in the order written.

    A line that looks like an include but is not exactly ``--- @include "name"`` is refused rather
    than skipped: skipped, it would leave a helper undefined and fail only when a script runs.
    """
    out = []
    for line in _INCLUDE_LIKE.findall(text):
        m = _INCLUDE.fullmatch(line.rstrip())
        if m is None:
            raise IncludeError(f'{name}.lua: malformed include line {line!r}; write it as --- @include "_lock"')
        out.append(m.group(1))
    return tuple(out)


def include_order(name: str, read: Callable[[str], str | None] = _read) -> tuple[str, ...]:
    """Everything script ``name`` includes, directly or not, each once, in dependency order.

    Depth first, in the order the includes are written: a prelude comes after every prelude it
    includes, so each helper is defined before the first line that calls it. ``read`` gives the
    text of a name (``None``: unknown); the default reads ``mqorder/store/lua`` and ``GENERATED``.
    """
    order: list[str] = []
    done: set[str] = set()

    def visit(node: str, chain: tuple[str, ...]) -> None:
        text = read(node)
        if text is None:
            if not chain:
                raise IncludeError(f"no script {node!r}: there is no mqorder/store/lua/{node}.lua")
            raise IncludeError(
                f"{' -> '.join(chain)}: include {node!r} is neither mqorder/store/lua/{node}.lua nor a "
                f"generated block ({', '.join(GENERATED)}); fix the --- @include line of {chain[-1]}.lua"
            )
        for dep in includes(text, node):
            if dep in chain or dep == node:
                cycle = " -> ".join((*chain[chain.index(dep):], node, dep) if dep in chain else (node, dep))
                raise IncludeError(
                    f"include cycle {cycle}: a prelude cannot include, directly or not, a file that "
                    "includes it; move what both need into a prelude of its own"
                )
            if dep not in done:
                visit(dep, (*chain, node))
        if chain:  # the script itself is not one of its includes
            done.add(node)
            order.append(node)

    visit(name, ())
    return tuple(order)


@cache
def source(name: str) -> str:
    """Script ``name`` as sent to Redis: its resolved includes, each once, then the script itself."""
    parts = [*include_order(name), name]
    return "\n".join(_read(p) or "" for p in parts)


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

        After ``NOSCRIPT`` (first use on this Redis, a restart, a failover to a replica) the
        script is loaded and only the calls refused with it are sent again: the others ran. A
        round trip is not refused as a whole: on a Redis Cluster its calls go to several shards,
        one of them a promoted replica without the script, and on any Redis another client can
        load the script while Redis is still reading the round trip (once a bug: every call was
        sent again, and a rebalance's ``assign.lua`` that had run answered KEPT the second time,
        so the request it had asked for was never sent). Any other error of a call is raised.
        """
        return self.run_many([(name, k, a) for k, a in calls], via)

    def run_each(self, name: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """``run_pipelined``, each call answering for itself: a call's error (a Redis Cluster shard
        that cannot be reached, a slot no node serves, an error of the script) is left in its place
        as an exception, the other calls' replies returned; raised only if *every* call failed.

        For the lock manager's steps over every queue of a broker (lease renewals, sweeps, a
        rebalance), whose calls are independent: on a cluster with one shard down (a master with no
        replica, ``cluster-require-full-coverage no``), raising threw the other shards' replies away
        and stopped their renewals for as long as the shard was down."""
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        partial = isinstance(self._client, ClusterClient)  # off a cluster one node: its failure is raised
        for attempt in (0, 1):
            pipe = RawPipeline(self._client)
            for i in todo:
                self.queue_in(pipe, name, *calls[i])
            missing = []
            for i, res in zip(todo, pipe.execute(raise_on_error=False, partial=partial), strict=True):
                if isinstance(res, redis.exceptions.NoScriptError) and not attempt:
                    missing.append(i)
                else:
                    replies[i] = res
            if not missing:
                break
            self.load(name)
            todo = missing
        if replies and all(isinstance(r, Exception) for r in replies):
            raise replies[0]
        return replies

    def call(self, name: str, keys: Sequence[Any], args: Sequence[Any], via: ConnectionLease | None = None) -> Any:
        """One ``EVALSHA`` of script ``name`` in one round trip: the consume path's and a send's.

        On a lease, the command goes straight to ``ConnectionLease.round_trip``: ``run_many``'s
        bookkeeping for several calls (a pipeline object, reply slots, the NOSCRIPT retry list)
        cost a trickling send ~17 µs of its ~150 µs of client CPU on this machine, more than
        packing and parsing. ``NOSCRIPT`` means the call ran nothing: the script is loaded and the
        call sent once more.
        """
        if via is None:
            return self.run_many([(name, keys, args)], via)[0]
        cmd = ("EVALSHA", getattr(self, name).sha, len(keys), *keys, *args)
        reply = via.round_trip([cmd])[0]
        if isinstance(reply, redis.exceptions.NoScriptError):
            self.load(name)
            reply = via.round_trip([("EVALSHA", getattr(self, name).sha, *cmd[2:])])[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def run_many(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
                 via: ConnectionLease | None = None) -> list[Any]:
        """``EVALSHA`` of each ``(script name, keys, args)`` call, in one round trip; their replies.

        A call refused with ``NOSCRIPT`` changed nothing, so only those are sent again (their
        scripts loaded first), never one that ran; any other error of a call is raised, as a
        plain pipeline would.
        """
        return self.run_many_then(calls, (), via)[0]

    def run_many_then(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
                      then: Sequence[tuple[Any, ...]], via: ConnectionLease | None = None, *,
                      then_for: Callable[[int], Sequence[tuple[Any, ...]]] | None = None,
                      ) -> tuple[list[Any], list[Any]]:
        """``run_many``, with plain commands ``then`` sent after the scripts on the same connection,
        in the same round trip; the scripts' replies and ``then``'s.

        For what must follow the scripts on *their* connection: ``WAIT`` (a durable send,
        ``mqorder.store.durable``) counts the replicas that have this connection's writes, and
        cannot run inside a script. When a call is sent again after ``NOSCRIPT``, ``then`` is sent
        again behind it, so its replies always follow the last of the writes.

        On a Redis Cluster the calls may land on several shards, each replicating on its own:
        the trailing commands then follow *each shard's* last call, on that shard
        (``_run_many_then_per_shard``). ``then_for(i)`` gives them for the shard whose last call is
        ``calls[i]`` (a fence write must be a key of that shard); without it, ``then`` itself.
        """
        if then and isinstance(self._client, ClusterClient) and len(calls) > 1:
            return self._run_many_then_per_shard(calls, then_for or (lambda _i: then), via)
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        tail: list[Any] = []
        for attempt in (0, 1):
            pipe = RawPipeline(via or self._client)
            for i in todo:
                self.queue_in(pipe, *calls[i])
            for cmd in then:
                pipe.execute_command(*cmd)
            out = pipe.execute(raise_on_error=False)
            out, tail = out[:len(todo)], out[len(todo):]
            missing = []
            for i, res in zip(todo, out, strict=True):
                if isinstance(res, redis.exceptions.NoScriptError) and not attempt:
                    missing.append(i)
                elif isinstance(res, Exception):
                    # Which calls ran (Redis judges each on arrival): a caller that must say what
                    # was stored reads them here (QueueAppender.append_many), by call index.
                    ran = {j: r for j, r in zip(todo, out, strict=True) if not isinstance(r, Exception)}
                    ran.update((j, r) for j, r in enumerate(replies) if r is not None)
                    res.mqorder_ran = ran  # type: ignore[attr-defined]
                    raise res
                else:
                    replies[i] = res
            if not missing:
                for res in tail:
                    if isinstance(res, Exception):
                        raise res
                return replies, tail
            for name in {calls[i][0] for i in missing}:
                self.load(name)
            todo = missing
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_many_then_per_shard(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
                                 then_for: Callable[[int], Sequence[tuple[Any, ...]]],
                                 via: ConnectionLease | None) -> tuple[list[Any], list[Any]]:
        """``run_many_then`` over a cluster's shards: the calls grouped by the primary serving
        them, each group followed by ``then_for(<its last call>)`` (one fence and one ``WAIT`` per
        shard, counting that shard's replicas for all its calls), all in one round trip. Returns
        the calls' replies and the trailing replies of the shard whose last reply is the smallest
        (the fewest replicas acknowledged)."""
        groups = dict(enumerate(shard_groups(self._client, range(len(calls)), lambda i: calls[i][1][0])))
        replies: list[Any] = [None] * len(calls)
        tails: dict[int, list[Any]] = {}
        for attempt in (0, 1):
            pipe = RawPipeline(via or self._client)
            layout: list[tuple[int, list[int], int]] = []
            for g, idxs in groups.items():
                for i in idxs:
                    self.queue_in(pipe, *calls[i])
                tail_cmds = then_for(idxs[-1])
                for cmd in tail_cmds:
                    pipe.execute_command(*cmd)
                layout.append((g, idxs, len(tail_cmds)))
            res = pipe.execute(raise_on_error=False)
            missing: set[str] = set()
            pos = 0
            for g, idxs, k in layout:
                for i in idxs:
                    r = res[pos]
                    pos += 1
                    if isinstance(r, redis.exceptions.NoScriptError) and not attempt:
                        missing.add(calls[i][0])
                    elif isinstance(r, Exception):
                        raise r
                    else:
                        replies[i] = r
                tail = list(res[pos:pos + k])
                pos += k
                for x in tail:
                    if isinstance(x, Exception):
                        raise x
                tails[g] = tail
            if not missing:
                return replies, min(tails.values(), key=lambda t: t[-1] if t else 0)
            # A NOSCRIPT call stored nothing; the others did, and are idempotent only by id: send
            # just the missing scripts' calls again, with their shard's fence and WAIT behind.
            for name in missing:
                self.load(name)
            groups = {g: [i for i in idxs if calls[i][0] in missing and replies[i] is None]
                      for g, idxs in groups.items()}
            groups = {g: idxs for g, idxs in groups.items() if idxs}
        raise AssertionError("unreachable")  # pragma: no cover

    def load(self, name: str) -> None:
        """(Re)load script ``name`` into Redis, e.g. after a ``NoScriptError``. On a cluster into
        every primary that answers: one shard down must not keep the script off the others (its
        own calls fail anyway), which stopped ``run_each``'s steps on every shard."""
        script = getattr(self, name)
        client = self._client
        if not isinstance(client, ClusterClient):
            script.sha = client.script_load(script.script)
            return
        loaded: str | None = None
        errors: list[Exception] = []
        for node in client.get_primaries():
            try:
                loaded = client.node_client(node).script_load(script.script)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                errors.append(exc)
        if loaded is None:
            raise errors[0] if errors else redis.ConnectionError("no Redis Cluster primary to load scripts into")
        script.sha = loaded

    if TYPE_CHECKING:
        # For type checkers only (the scripts are set in ``__init__``): at run time a class with
        # ``__getattr__`` sends every attribute lookup on its objects down the slow generic path
        # (``queue_in``, ``call`` and a script are looked up on every round trip of a run).
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)


@cache
def bundle_digest() -> str:
    """8 hex digits naming this installation's Lua scripts (a hash of every ``.lua`` file): two
    workers with the same ``mqorder.__version__`` but other scripts (a checkout between releases)
    tell apart in ``mqorder consumers`` and ``mqorder doctor``."""
    h = hashlib.sha1(usedforsecurity=False)
    lua = resources.files("mqorder.store") / "lua"
    for f in sorted((x for x in lua.iterdir() if x.name.endswith(".lua")), key=lambda x: x.name):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:8]

"""Redis Cluster routing for mqorder's lean round trips (``ConnectionLease``, ``RawPipeline``).

On a cluster, every command goes to the primary that serves its key's hash slot. redis-py's
``RedisCluster`` does that for its own commands and pipelines; mqorder's consume path sends its
round trips through ``ConnectionLease`` instead (raw ``EVALSHA``\\s packed in one call, no
response callbacks; ``mqorder.store.raw_pipe``), so this module gives that path the same routing:

* **by slot, per node, in one round trip**: the commands of a round trip are grouped by the
  primary of their key's slot; each node gets its group in one write, *all writes go out before
  any reply is read*, so a round trip over three shards costs the slowest shard's latency, not
  the sum. Replies come back in the caller's order. A command without a key (``WAIT``) goes to
  the node of the command before it: ``WAIT`` counts the replicas that have *that* connection's
  writes (``mqorder.store.durable``).
* **MOVED** (a slot migrated, or a failover promoted a replica): the slot map is patched from the
  redirection (``NodesManager.move_slot``, as redis-py does) and the command sent again to the
  new owner. A refused command changed nothing, so resending is safe. A ``WAIT`` behind a
  redirected write that is not sent again with it (it follows other writes of the old node) has
  run where the write was refused: one more ``WAIT`` follows the write on its new node, and the
  caller's reply is the smaller count of the two (``_waits_for``).
* **ASK** (a slot *being* migrated, the key already on the target): ``ASKING`` then the command,
  on the target, once. **TRYAGAIN** (a multi-key script whose keys are split between the two
  nodes for an instant) and **CLUSTERDOWN**: a short pause, then again. All keys of one mqorder
  queue share one hash tag (``mqorder.keys.queue_tag``), so a queue's state always moves as a
  whole and its fencing (epochs, leases, offsets) moves with it.
* a node that cannot be reached: its connections are dropped, the slot map is re-read from the
  cluster (at most every ``REFRESH_MIN_S``) and a ``ConnectionError`` raised, which every retry
  loop of mqorder already treats as "Redis is away for a moment": after a cluster failover the
  next attempt finds the promoted replica. A round trip asked ``partial`` (the lock manager's
  steps over every shard: renewals, sweeps, a rebalance) gets that error *in the place of each
  command the node (or a slot no node serves) would have answered* instead, and the other
  nodes' replies: one shard down must not stop the others' lock renewals.
* **pinned** (a consume run's queue, ``ConnectionLease.pin``): the queue's slot stays on the node
  that first served a command of it for the lease. A pinned slot the map (or a ``MOVED``)
  now puts on another node is a ``SlotMovedError`` (a ``ConnectionError``) *before* anything is
  sent there: after a failover the promoted replica may lack messages the run read on the old
  primary, and the commit's ``AHEAD`` check compares offsets only, so once producers refilled
  those offsets a commit there would be accepted and skip them. The run starts over from the
  committed offset instead, as it does when the old primary dies under it (``ASK`` is followed:
  a migration moves keys, it never loses them).

Only single-slot commands are routed: a multi-key command over keys of several slots is a
``CROSSSLOT`` error on a cluster whatever the client does, so callers split multi-queue work per
slot first (``Broker.slot_batches``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.cluster import PRIMARY, ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from mqorder.store.packing import pack_commands

#: Sent before a command redirected by ASK (its reply skipped).
_ASKING = ("ASKING",)
#: Redirections (MOVED, ASK) and TRYAGAIN/CLUSTERDOWN answers followed within one round trip
#: before giving up with the last error.
MAX_REDIRECTS = 16
#: Pause before resending a command answered TRYAGAIN or CLUSTERDOWN (a migration or a failover
#: in progress; both settle in milliseconds to a couple of seconds).
RETRY_PAUSE_S = 0.05
#: The slot map is re-read from the cluster at most this often after connection failures (every
#: thread of a worker sees the same dead node at once).
REFRESH_MIN_S = 0.25

T = TypeVar("T")

_SCRIPT_COMMANDS = frozenset({b"EVALSHA", b"EVAL", b"EVALSHA_RO", b"EVAL_RO", b"FCALL", b"FCALL_RO"})
_STREAM_READS = frozenset({b"XREAD", b"XREADGROUP"})
_KEYLESS = frozenset({b"WAIT", b"PING", b"ASKING", b"TIME", b"INFO", b"ECHO"})
#: Commands that only read: resent behind a redirected command of their slot (``_resend``).
_READS = frozenset({b"XRANGE", b"XREVRANGE", b"XREAD", b"XLEN", b"HMGET", b"HGET", b"HGETALL", b"GET", b"MGET",
                    b"EXISTS", b"ZRANGE", b"ZSCORE", b"ZCARD", b"SMEMBERS", b"SCARD", b"LRANGE", b"LLEN"})


def _upper(name: Any) -> bytes:
    return (name if isinstance(name, bytes) else str(name).encode()).upper()


def _as_bytes(key: Any) -> bytes:
    if isinstance(key, bytes):
        return key
    return str(key).encode()


def shard_groups(client: object, items: Iterable[T], key_of: Callable[[T], str | bytes]) -> list[list[T]]:
    """``items`` grouped by the cluster primary serving each one's key, each group in the order
    given; one group off a cluster. What follows a shard's last write (a ``WAIT``, a fence, a
    ``TIME``) must go per group: every shard replicates, and keeps its clock, on its own."""
    items = list(items)
    if not isinstance(client, ClusterClient):
        return [items] if items else []
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(client.primary_for(key_of(item)).name, []).append(item)
    return list(groups.values())


def command_key(args: tuple[Any, ...]) -> bytes | None:
    """The key that routes command ``args`` (its first key), ``None`` for a command without one."""
    name = _upper(args[0])
    if name in _SCRIPT_COMMANDS:
        return _as_bytes(args[3]) if int(args[2]) > 0 else None
    if name in _STREAM_READS:
        for i in range(1, len(args) - 1):
            if _upper(args[i]) == b"STREAMS":
                return _as_bytes(args[i + 1])
        return None
    if name in _KEYLESS or len(args) < 2:
        return None
    return _as_bytes(args[1])


def _merge_waits(out: list[Any], extra: dict[int, int], n: int) -> list[Any]:
    """The caller's replies, each ``WAIT``'s the smaller count of its own and those added for the
    writes redirected away from its node (an error of any of them wins)."""
    for s, w in extra.items():
        mine, added = out[w], out[s]
        if isinstance(mine, Exception):
            continue
        if isinstance(added, Exception) or added is None:
            out[w] = added if added is not None else mine
        else:
            out[w] = min(int(mine), int(added))
    return out[:n]


def _packed(commands: list[tuple[Any, ...]], idxs: list[int], asking: dict[int, tuple[str, int]]
            ) -> tuple[bytes, list[bool]]:
    """One node's commands in one write (``ASKING`` before each asked one), and which replies to
    skip (``ASKING``'s)."""
    node: list[Any] = []
    discard: list[bool] = []
    for i in idxs:
        if i in asking:
            node.append(_ASKING)
            discard.append(True)
        node.append(commands[i])
        discard.append(False)
    return pack_commands(node), discard


def _read_into(replies: dict[int, Any], conn: Any, idxs: list[int], discard: list[bool]) -> None:
    """Read one node's replies into ``replies`` by command index (error replies in place)."""
    it = iter(idxs)
    for skip in discard:
        try:
            r = conn.read_response()
        except ResponseError as exc:
            r = exc
        if not skip:
            replies[next(it)] = r


class ClusterClient(RedisCluster):
    """redis-py's ``RedisCluster`` as mqorder's store client on a Redis Cluster.

    Everything redis-py routes (its commands, ``pipeline()``, ``register_script``, ``SCRIPT LOAD``
    on every primary) is unchanged; ``mqorder.store.raw_pipe`` recognises it and routes its lean
    round trips with ``ClusterRoute``. ``refresh_slots`` re-reads the slot map, rate-limited.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refresh_lock = threading.Lock()
        self._refreshed_at = 0.0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """redis-py's, with "no node answers" and "no node serves this slot" (``RedisClusterException``,
        not a ``RedisError``) raised as ``ConnectionError``: every retry loop of mqorder catches
        ``RedisError`` and would let them crash a worker's thread instead of backing off."""
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            if "same key slot" in str(exc):
                # redis-py's own refusal of keys in several slots (CROSSSLOT, before any node is
                # asked): no retry fixes it. Once said "not usable right now", as if the cluster
                # were settling, while a listener's script suspended its queue for good.
                raise redis.ResponseError(
                    f"CROSSSLOT {exc}: on a Redis Cluster the keys of one command or script must share "
                    "a hash slot; give them one hash tag (the same {...} part in every key name)"
                ) from exc
            raise redis.ConnectionError(f"Redis Cluster not usable right now: {exc}") from exc

    def refresh_slots(self, failed_node: str | None = None) -> None:
        """Re-read which primary serves which slot (after a node failed), at most every
        ``REFRESH_MIN_S`` however many threads ask; errors are left to the next attempt."""
        with self._refresh_lock:
            now = time.monotonic()
            if now - self._refreshed_at < REFRESH_MIN_S:
                return
            self._refreshed_at = now
        try:
            self.nodes_manager.initialize(last_failed_node_name=failed_node)
        except (redis.RedisError, RedisClusterException):
            pass  # the cluster is still settling (or no node answers): the next failure asks again

    def node_client(self, node: ClusterNode) -> redis.Redis:
        """The plain client of one node (its own connection pool)."""
        conn = self.get_redis_connection(node)
        assert conn is not None
        return conn

    def primary_for(self, key: bytes | str) -> ClusterNode:
        return self.nodes_manager.get_node_from_slot(key_slot(_as_bytes(key)))


class SlotMovedError(redis.ConnectionError):
    """A pinned route's slot is served by another node now than when the lease first used it
    (a failover, or a migration's end): nothing was sent; the caller starts over."""


class ClusterRoute:
    """The per-node connections of one ``ConnectionLease`` on a cluster, and its routing."""

    __slots__ = ("cluster", "_conns", "_last", "_pinned", "_pins")

    def __init__(self, cluster: ClusterClient) -> None:
        self.cluster = cluster
        #: The slots ``pin`` named (a run's queues): only they are pinned. Not every slot a run
        #: touches: its ledger records and a worker's wake-up stream live in slots of their own,
        #: whose move loses nothing (once pinned too: a reshard of the ledger's slot restarted
        #: every run of the group mid-commit, losing the audit records taken for it).
        self._pinned: set[int] = set()
        #: pinned slot -> name of the node that first served a command of it for this lease.
        self._pins: dict[int, str] = {}
        #: node name -> (pool, connection) held by this lease.
        self._conns: dict[str, tuple[Any, Any]] = {}
        #: The node of the last keyed command sent: where a round trip of keyless commands alone
        #: goes (a run's ``WAIT`` after its ``begin``, for the replicas of *that* node).
        self._last: ClusterNode | None = None

    def pin(self, key: bytes | str) -> None:
        """Keep ``key``'s slot on the node that serves it first, until ``release``."""
        self._pinned.add(key_slot(_as_bytes(key)))

    def _conn(self, node: ClusterNode) -> Any:
        held = self._conns.get(node.name)
        if held is None:
            pool = self.cluster.node_client(node).connection_pool
            held = self._conns[node.name] = (pool, pool.get_connection())
        return held[1]

    def _drop(self, name: str) -> None:
        held = self._conns.pop(name, None)
        if held is not None:
            held[1].disconnect()
            held[0].release(held[1])

    def release(self) -> None:
        for pool, conn in self._conns.values():
            pool.release(conn)
        self._conns.clear()
        self._last = None
        self._pinned.clear()
        self._pins.clear()

    def round_trip(self, commands: list[tuple[Any, ...]], partial: bool = False) -> list[Any]:
        """Every command on its slot's primary, all nodes written before any is read; the
        replies in ``commands``' order (error replies as exceptions, in place). Redirections
        are followed here; a dead node, or a slot map that cannot be read, is a
        ``ConnectionError`` (the slot map re-read), which every retry loop of mqorder takes.
        With ``partial``, a node that fails (or a slot no node serves) puts that error in the
        place of each of its commands, and the other nodes' replies are returned."""
        try:
            return self._round_trip(commands, partial)
        except (RedisClusterException, KeyError) as exc:
            # No node answered the slot map's refresh, a slot no node serves (a master down under
            # a partial cluster), a redirection to a slot the map lacks: the cluster is settling.
            self._unpin()
            self.cluster.refresh_slots()
            raise redis.ConnectionError(f"Redis Cluster not usable right now: {exc}") from exc
        except BaseException:
            # The caller starts over (a run from its committed offset): its next round trips pin
            # the slots wherever the map puts them then.
            self._unpin()
            raise

    def _unpin(self) -> None:
        self._pins.clear()

    def _round_trip(self, commands: list[tuple[Any, ...]], partial: bool = False) -> list[Any]:
        n = len(commands)
        commands = list(commands)  # a redirected write's own WAIT is added at its end (``_waits_for``)
        out: list[Any] = [None] * n
        todo = list(range(n))
        #: added WAIT's index -> the caller's WAIT it answers for too
        extra: dict[int, int] = {}
        asking: dict[int, tuple[str, int]] = {}
        node_of: dict[int, ClusterNode] = {}
        for attempt in range(MAX_REDIRECTS + 1):
            unrouted: dict[int, Exception] = {}
            batches = self._route(commands, todo, asking, node_of, unrouted if partial else None)
            replies = self._exchange(commands, batches, asking, partial)
            replies.update(unrouted)
            again: list[int] = []
            pause = False
            asked = set(asking)
            asking = {}
            served: list[int] = []
            for i in todo:
                r = replies[i]
                if isinstance(r, (MovedError, AskError, TryAgainError, ClusterDownError)):
                    if attempt == MAX_REDIRECTS:
                        out[i] = redis.ConnectionError(
                            f"Redis Cluster still redirecting after {MAX_REDIRECTS} tries "
                            f"({type(r).__name__}: {r}): a migration or failover in progress")
                        continue
                    if isinstance(r, MovedError):
                        self.cluster.nodes_manager.move_slot(r)
                    elif isinstance(r, AskError):
                        asking[i] = (r.host, r.port)
                    else:
                        pause = True
                        if isinstance(r, ClusterDownError):
                            self.cluster.refresh_slots()
                    again.append(i)
                else:
                    out[i] = r
                    if not isinstance(r, redis.ConnectionError):  # a partial round trip's failed node served nothing
                        served.append(i)
            if self._pinned:
                self._pin_served(commands, served, node_of, asked)
            if not again:
                # Where a later lone WAIT goes: the node of the last keyed command, in the caller's order.
                for i in reversed(range(n)):
                    if command_key(commands[i]) is not None and i in node_of:  # (not a partial one's unrouted)
                        self._last = node_of[i]
                        break
                return _merge_waits(out, extra, n) if extra else out
            todo = self._resend(commands, again, asking, n)
            todo = self._waits_for(commands, n, todo, asking, extra, out)
            if pause:
                time.sleep(RETRY_PAUSE_S)
        raise AssertionError("unreachable")  # pragma: no cover

    def _waits_for(self, commands: list[tuple[Any, ...]], n: int, todo: list[int], asking: dict[int, tuple[str, int]],
                   extra: dict[int, int], out: list[Any]) -> list[int]:
        """``todo`` with a ``WAIT`` after the last resent write of each node it goes to, where the
        caller's ``WAIT`` behind that write is not sent again. That ``WAIT`` ran on the node that
        refused the write (``MOVED``, ``ASK``, ``TRYAGAIN``): it counted the replicas of the other
        writes there, never of this one, which the new node stores without anyone waiting for it,
        and a durable send was acknowledged unreplicated. The added ``WAIT`` (same arguments)
        answers for the caller's too: the smaller count of the two (``_merge_waits``)."""
        resent = set(todo)

        def dest(i: int) -> str:
            """Where resent command ``i`` (keyed) goes: its ``ASK`` target, else its slot's node."""
            target = asking.get(i)
            if target is not None:
                return f"{target[0]}:{target[1]}"
            try:
                return str(self.cluster.nodes_manager.get_node_from_slot(key_slot(command_key(commands[i]) or b"")).name)
            except (RedisClusterException, KeyError):
                return f"#{i}"

        last_of: dict[tuple[int, str], int] = {}  # (caller's WAIT, destination node) -> last resent write
        for i in todo:
            if i >= n:
                continue
            key = command_key(commands[i])
            if key is None or _upper(commands[i][0]) in _READS:
                continue
            w = next((j for j in range(i + 1, n) if _upper(commands[j][0]) == b"WAIT"), None)
            if w is None:
                continue
            where = dest(i)
            if w in resent:
                # Resent too, it goes with the keyed command resent before it: enough only if that
                # one goes where this write goes (two slots of one group may leave for two nodes).
                before = next((k for k in range(w - 1, -1, -1) if k in resent and command_key(commands[k]) is not None),
                              None)
                if before is not None and dest(before) == where:
                    continue
            last_of[(w, where)] = i
        if not last_of:
            return todo
        after: dict[int, list[int]] = {}
        for (w, _), i in last_of.items():
            s = len(commands)
            commands.append(commands[w])
            out.append(None)
            extra[s] = w
            after.setdefault(i, []).append(s)
        return [x for i in todo for x in (i, *after.get(i, ()))]

    @staticmethod
    def _resend(commands: list[tuple[Any, ...]], again: list[int], asking: dict[int, tuple[str, int]],
                caller_n: int) -> list[int]:
        """What goes out again after ``again`` were redirected: them, the keyless commands that
        follow each (a ``WAIT`` counts the replicas of the node of the write before it), and the
        later *reads* of the same slot, which must still see what the redirected command did or
        read (a lingering read's state check follows its blocking read: ``linger._queue_slice``).
        A later read of the same slot goes where the redirected command goes. Only the caller's
        ``caller_n`` commands follow so: a ``WAIT`` added behind a redirected write
        (``_waits_for``) belongs to that write's node, and went along with a later group's
        redirection, its count taken on the wrong node."""
        n = caller_n
        resend = set(again)
        for i in again:
            key = command_key(commands[i])
            slot = key_slot(key) if key is not None else None
            j = i + 1
            while j < n:
                kj = command_key(commands[j])
                if kj is None:
                    if j - 1 in resend:
                        resend.add(j)
                elif slot is not None and _upper(commands[j][0]) in _READS and key_slot(kj) == slot:
                    resend.add(j)
                    if i in asking:
                        asking[j] = asking[i]
                j += 1
        return sorted(resend)

    def _route(self, commands: list[tuple[Any, ...]], todo: list[int], asking: dict[int, tuple[str, int]],
               node_of: dict[int, ClusterNode], unrouted: dict[int, Exception] | None = None,
               ) -> dict[str, tuple[ClusterNode, list[int]]]:
        """``todo``'s indices grouped by target node, each group in the caller's order; the node of
        each index is recorded in ``node_of``. A keyless command goes with the command before it
        (in this round trip, else the lease's last keyed command: a run's ``WAIT`` after its begin).
        With ``unrouted`` (a partial round trip), a command of a slot no node serves gets its
        error there (and is sent nowhere) rather than failing the round trip."""
        batches: dict[str, tuple[ClusterNode, list[int]]] = {}
        prev: ClusterNode | None = self._last
        pending_keyless: list[int] = []
        lost: Exception | None = None  # the error of an unrouted command, for keyless ones behind it
        manager = self.cluster.nodes_manager
        for i in todo:
            target = asking.get(i)
            if target is not None:
                node = manager.get_node(host=target[0], port=target[1])
                if node is None:
                    with manager._lock:
                        node = manager.nodes_cache.setdefault(
                            f"{target[0]}:{target[1]}", ClusterNode(target[0], target[1], PRIMARY))
            else:
                key = command_key(commands[i])
                if key is None:
                    if lost is not None:
                        unrouted[i] = lost  # type: ignore[index]
                        continue
                    if prev is None:
                        pending_keyless.append(i)
                        continue
                    node = prev
                else:
                    slot = key_slot(key)
                    try:
                        node = manager.get_node_from_slot(slot)
                    except (RedisClusterException, KeyError) as exc:
                        if unrouted is None:
                            raise
                        unrouted[i] = lost = redis.ConnectionError(f"no Redis Cluster node serves slot {slot} ({exc})")
                        continue  # (``lost``: a WAIT behind it has no node either)
                    lost = None
                    if self._pins:
                        self._check_pin(slot, node)
            if pending_keyless:
                batches.setdefault(node.name, (node, []))[1].extend(pending_keyless)
                for j in pending_keyless:
                    node_of[j] = node
                pending_keyless = []
            batches.setdefault(node.name, (node, []))[1].append(i)
            node_of[i] = node
            prev = node
        if pending_keyless:  # nothing keyed at all, nothing before: any primary answers
            node = self.cluster.get_random_primary_node()
            batches.setdefault(node.name, (node, []))[1].extend(pending_keyless)
            for j in pending_keyless:
                node_of[j] = node
        return batches

    def _check_pin(self, slot: int, node: ClusterNode) -> None:
        """Refuse ``node`` for ``slot`` if the slot is pinned to another node."""
        pinned = self._pins.get(slot)
        if pinned is not None and pinned != node.name:
            raise SlotMovedError(
                f"slot {slot} moved from {pinned} to {node.name} during this run (a failover or a "
                "migration): the run starts over from its committed offset")

    def _pin_served(self, commands: list[tuple[Any, ...]], served: list[int], node_of: dict[int, ClusterNode],
                    asked: set[int]) -> None:
        """Pin each slot to the node that *served* a command of it (not one the slot map named
        but that answered ``MOVED``: a stale map after a failover is not where the run read;
        not an ``ASK`` target: the map still names the source, where the next round trip goes)."""
        for i in served:
            if i in asked:
                continue
            key = command_key(commands[i])
            if key is not None and (slot := key_slot(key)) in self._pinned:
                self._pins.setdefault(slot, node_of[i].name)

    def _exchange_partial(self, commands: list[tuple[Any, ...]], batches: dict[str, tuple[ClusterNode, list[int]]],
                          asking: dict[int, tuple[str, int]]) -> dict[int, Any]:
        """``_exchange`` where a node that fails answers for its own commands only: its error in
        the place of each of them (those read before it failed keep their replies), the others'
        replies as usual. Its connection is dropped and the slot map re-read."""
        replies: dict[int, Any] = {}
        sent: list[tuple[str, Any, list[int], list[bool]]] = []
        failed: list[str] = []

        def fail(name: str, idxs: list[int], exc: BaseException) -> None:
            err = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(str(exc))
            for i in idxs:
                replies.setdefault(i, err)
            self._drop(name)
            failed.append(name)

        try:
            for name, (node, idxs) in batches.items():
                packed, discard = _packed(commands, idxs, asking)
                try:
                    conn = self._conn(node)
                    conn.send_packed_command([packed])
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    fail(name, idxs, exc)
                    continue
                sent.append((name, conn, idxs, discard))
            for name, conn, idxs, discard in sent:
                try:
                    _read_into(replies, conn, idxs, discard)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    fail(name, idxs, exc)
        except BaseException:
            for name in list(batches):
                self._drop(name)
            raise
        if failed:
            self.cluster.refresh_slots(failed[0])
        return replies

    def _exchange(self, commands: list[tuple[Any, ...]], batches: dict[str, tuple[ClusterNode, list[int]]],
                  asking: dict[int, tuple[str, int]], partial: bool = False) -> dict[int, Any]:
        """Write each node's commands, then read each node's replies."""
        if partial:  # also a retry's one node: the other nodes' first replies are in hand, their scripts ran
            return self._exchange_partial(commands, batches, asking)
        sent: list[tuple[str, Any, list[int], list[bool]]] = []
        try:
            for name, (node, idxs) in batches.items():
                conn = self._conn(node)
                packed, discard = _packed(commands, idxs, asking)
                conn.send_packed_command([packed])
                sent.append((name, conn, idxs, discard))
            replies: dict[int, Any] = {}
            for _name, conn, idxs, discard in sent:
                _read_into(replies, conn, idxs, discard)
            return replies
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            failed = sent[-1][0] if sent and len(sent) < len(batches) else None
            for name in list(batches):
                self._drop(name)
            self.cluster.refresh_slots(failed)
            if isinstance(exc, redis.RedisError):
                raise
            raise redis.ConnectionError(str(exc)) from exc
        except BaseException:
            for name in list(batches):
                self._drop(name)
            raise

"""``RebalanceLockManager``: per-(group, queue) leases with fencing epochs, in Redis.

RocketMQ keeps this table in the broker's memory (``ConcurrentHashMap<group, Map<mq, LockEntry>>``,
60 s ``lockMaxLiveTime``) and a consumer paused past its lease can go on consuming beside the new
owner. Here every grant gives the queue a new, higher *epoch* (``grant_epoch`` in ``_lock.lua``),
and every commit of progress names the epoch it was granted (``commit.lua``), so the race goes
like this and ends safely:

1. worker A holds queue q at epoch e and is paused (GC, SIGSTOP) longer than the lease;
2. the lease runs out by Redis's clock (or A's heartbeat lapses); B takes q at an epoch above e;
3. A wakes up and finishes its listener call; its commit names epoch e and is refused;
4. A's ConsumeRequest stops; B redelivers from the last committed offset, in order.

Epochs are a clock (``max(epoch + 1, now_ms * 1000)``), not a counter, so that a replica promoted
after missing the last grants never hands one of them out again (invariant 9).

Leases are judged by Redis ``TIME`` inside the scripts, never by a worker's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.settings import Settings
from mqorder.store.broker_steps import BrokerSteps
from mqorder.store.brokers import Broker, BrokerRegistry, group_by_broker
from mqorder.store.cluster_route import RedisClusterException, shard_groups
from mqorder.store.raw_pipe import RawPipeline
from mqorder.store.replication import ReplicaWait

#: The lease and pending-request TTL of a manager built without them (tests, tools), taken from
#: the settings' defaults so they cannot drift; the engine always passes its own settings' values.
DEFAULT_LOCK_MAX_LIVE_TIME_MS: int = Settings.model_fields["lock_max_live_time_ms"].default
DEFAULT_PENDING_TTL_MS: int = Settings.model_fields["pending_ttl_ms"].default
#: How long a sweep trusts that it recorded a node's identity on a queue before recording it again
#: (a topic deleted and made again drops the record with its state).
RECORD_AGAIN_S = 300.0


def _tag(mq: MessageQueue) -> str:
    return mq.tag


@dataclass(frozen=True)
class LockEntry:
    owner: str
    epoch: int
    lease_until_ms: int
    assignee: str
    running: bool


@dataclass(frozen=True)
class Redispatch:
    """A queue the sweep gave a new pending token: send a ConsumeRequest with ``token`` to ``owner``."""

    mq: MessageQueue
    owner: str
    token: str


#: Queues per ``sweep.lua`` call when the lanes of a plain Redis share calls (``_merged``): a call
#: holds Redis for its whole length, so a worker owning many queues still sweeps them in slices.
SWEEP_CALL_QUEUES = 1024

#: Queues per ``lock_batch.lua`` call when the lanes of a plain Redis share calls (``try_lock_lanes``).
LOCK_CALL_QUEUES = 1024

_Item = tuple[int, MessageQueue, str]


def _slices(items: list[_Item], limit: int) -> list[list[_Item]]:
    """``items`` in order, cut into lists of at most ``limit``."""
    return [items[i:i + limit] for i in range(0, len(items), limit)]


def _merged(groups: list[tuple[str, list[_Item], set[tuple[str, str]] | None]],
            limit: int) -> list[tuple[str, list[_Item], set[tuple[str, str]] | None]]:
    """``groups`` that pass the same identity and join the same recorded set, concatenated in
    order, then cut into slices of at most ``limit`` items."""
    joined: dict[tuple[str, int], tuple[str, list[_Item], set[tuple[str, str]] | None]] = {}
    for ident, part, recorded in groups:
        key = (ident, id(recorded) if recorded is not None else 0)
        if key not in joined:
            joined[key] = (ident, [], recorded)
        joined[key][1].extend(part)
    return [(ident, piece, recorded) for ident, part, recorded in joined.values() for piece in _slices(part, limit)]


class RebalanceLockManager:
    def __init__(self, brokers: BrokerRegistry, lock_max_live_time_ms: int = DEFAULT_LOCK_MAX_LIVE_TIME_MS,
                 replica_wait: ReplicaWait | None = None) -> None:
        self.brokers = brokers
        self.lock_max_live_time_ms = lock_max_live_time_ms
        #: Given (the pull consumer, whose application acts on the epochs returned at once): a new
        #: grant is returned only once the replicas asked for hold it. The engine leaves it out:
        #: its runs wait themselves, once per new epoch (``ConsumeRequest._epoch_replicated``).
        self.replica_wait = replica_wait
        #: (sub, queue) -> the newest epoch the replicas were seen to hold.
        self._replicated: dict[tuple[str, MessageQueue], int] = {}
        #: (broker, cluster node) -> (its identity, since when, the (sub, queue key) pairs whose
        #: state this manager's sweeps recorded it on): ``sweep_lanes``.
        self._recorded: dict[tuple[str, str], tuple[str, float, set[tuple[str, str]]]] = {}
        self._recorded_lock = threading.Lock()

    def try_lock_batch(self, sub: str, mqs: Iterable[MessageQueue], client_id: str) -> dict[MessageQueue, int]:
        """Lock what can be locked; return the locked queues with their epochs.

        Renews the caller's own locks, takes free or expired ones (new epoch) unless assigned to
        someone else, refuses live locks of other clients. One round trip per broker: one script
        call, or on a Redis Cluster one per hash slot, sent to every shard at once.
        """
        locked: dict[MessageQueue, int] = {}
        steps = BrokerSteps("lock")
        for broker_name, group_mqs in group_by_broker(mqs).items():
            with steps.of(broker_name):
                self._lock_on(self.brokers.get(broker_name), sub, group_mqs, client_id, locked, steps)
        steps.settle()
        return locked

    def _lock_on(self, broker: Broker, sub: str, group_mqs: list[MessageQueue], client_id: str,
                 locked: dict[MessageQueue, int], steps: BrokerSteps) -> None:
        """``try_lock_batch``'s part on one broker: its grants go into ``locked``."""
        batches = broker.slot_batches(group_mqs, _tag)
        calls = [([keys.sub_state(mq.tag, sub) for mq in b], [client_id, self.lock_max_live_time_ms])
                 for b in batches]
        wanted = [self.replica_wait.wanted(broker, b[0].tag) if self.replica_wait is not None else 0
                  for b in batches]
        if any(wanted):
            assert self.replica_wait is not None
            replies = self._lock_and_wait(broker, calls, wanted, [b[0].tag for b in batches],
                                          self.replica_wait.timeout_ms)
        else:
            replies = [(epochs, 0) for epochs in steps.partly(broker.name, broker.scripts.run_each("lock_batch", calls))]
        for b, want, (epochs, acked) in zip(batches, wanted, replies, strict=True):
            if epochs is None:  # its shard failed (logged): tried again next time
                continue
            for mq, epoch in zip(b, epochs, strict=True):
                epoch = int(epoch)
                if not epoch:
                    continue
                if int(acked) >= want:
                    self._replicated[(sub, mq)] = epoch
                elif self._replicated.get((sub, mq)) != epoch:
                    continue  # a new grant no replica holds yet: not used until one does
                locked[mq] = epoch

    def try_lock_lanes(
        self, lanes: Sequence[tuple[str, Sequence[MessageQueue]]], client_id: str
    ) -> list[dict[MessageQueue, int]]:
        """``try_lock_batch`` of several subscriptions at once, one answer per ``(sub, queues)``:
        every lane's ``lock_batch.lua`` call goes to each broker in one round trip (a worker of 64
        groups renewed its leases in 64 round trips, issue 27). With replica waits (durable locks)
        each lane keeps its own ``try_lock_batch``, whose WAITs follow its own calls."""
        if self.replica_wait is not None:
            return [self.try_lock_batch(sub, mqs, client_id) for sub, mqs in lanes]
        out: list[dict[MessageQueue, int]] = [{} for _ in lanes]
        flat = [(li, mq, "") for li, (_, mqs) in enumerate(lanes) for mq in mqs]
        steps = BrokerSteps("lock")
        for broker, batches in self._lane_batches(flat):
            with steps.of(broker.name):
                # On a plain Redis the lanes share calls (lock_batch.lua's keys name their subscription),
                # in slices: a worker of 64 groups renewed its leases in 64 calls (issue 27's idle cost).
                parts = [b for _, b in batches] if broker.is_cluster else _slices(
                    [it for _, b in batches for it in b], LOCK_CALL_QUEUES)
                calls = [([keys.sub_state(mq.tag, lanes[li][0]) for li, mq, _ in part], [client_id, self.lock_max_live_time_ms])
                         for part in parts]
                for part, epochs in zip(parts, steps.partly(broker.name, broker.scripts.run_each("lock_batch", calls)),
                                        strict=True):
                    if epochs is None:  # its shard failed (logged): renewed next time
                        continue
                    for (li, mq, _), epoch in zip(part, epochs, strict=True):
                        epoch = int(epoch)
                        if epoch:
                            self._replicated[(lanes[li][0], mq)] = epoch  # as try_lock_batch with nothing to wait for
                            out[li][mq] = epoch
        steps.settle()
        return out

    def _lane_batches(
        self, flat: Sequence[tuple[int, MessageQueue, str]]
    ) -> Iterator[tuple[Broker, list[tuple[int, list[tuple[int, MessageQueue, str]]]]]]:
        """``(lane index, queue, token)`` items grouped per broker, then per lane into the broker's
        slot batches (one script call each): what ``try_lock_lanes`` and ``sweep_lanes`` pipeline."""
        for broker_name, group in group_by_broker(flat, lambda item: item[1]).items():
            broker = self.brokers.get(broker_name)
            by_lane: dict[int, list[tuple[int, MessageQueue, str]]] = {}
            for item in group:
                by_lane.setdefault(item[0], []).append(item)
            yield broker, [(li, b) for li, items in by_lane.items()
                           for b in broker.slot_batches(items, lambda item: item[1].tag)]

    @staticmethod
    def _lock_and_wait(broker: Broker, calls: list[tuple[list[str], list[Any]]], wanted: list[int],
                       tags: list[str], timeout_ms: int) -> list[tuple[list[Any], int]]:
        """``lock_batch.lua`` calls with ``WAIT`` behind them in the same round trip: WAIT counts what
        its own connection wrote, so on a Redis Cluster one WAIT follows each shard's last call
        (``tags[i]``: a queue of call ``i``) and answers for all of that shard's calls. After
        ``NOSCRIPT`` (a restarted or promoted Redis) nothing ran: load, resend."""
        order = shard_groups(broker.client, range(len(calls)), lambda i: tags[i])
        for attempt in (0, 1):
            pipe = RawPipeline(broker.client)
            for idxs in order:
                for i in idxs:
                    broker.scripts.queue_in(pipe, "lock_batch", *calls[i])
                want = max(wanted[i] for i in idxs)
                pipe.execute_command("WAIT", want, timeout_ms if want else 0)
            try:
                out = pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                broker.scripts.load("lock_batch")
                continue
            replies: list[tuple[list[Any], int]] = [([], 0)] * len(calls)
            pos = 0
            for idxs in order:
                acked = int(out[pos + len(idxs)])
                for k, i in enumerate(idxs):
                    replies[i] = (list(out[pos + k]), acked)
                pos += len(idxs) + 1
            return replies
        raise AssertionError("unreachable")  # pragma: no cover

    def unlock_batch(
        self, sub: str, mqs: Iterable[MessageQueue], client_id: str, *, force: bool = False
    ) -> set[MessageQueue]:
        """Release the caller's locks where nothing is consuming (or all of them with ``force``)."""
        unlocked: set[MessageQueue] = set()
        steps = BrokerSteps("unlock")
        for broker_name, group_mqs in group_by_broker(mqs).items():
            with steps.of(broker_name):
                broker = self.brokers.get(broker_name)
                batches = broker.slot_batches(group_mqs, _tag)
                replies = steps.partly(broker.name, broker.scripts.run_each("unlock_batch", [
                    ([keys.sub_state(mq.tag, sub) for mq in b], [client_id, "1" if force else "0"]) for b in batches
                ]))
                for b, res in zip(batches, replies, strict=True):
                    if res is not None:
                        unlocked.update(mq for mq, r in zip(b, res, strict=True) if int(r))
        steps.settle()
        return unlocked

    def lock_entry(self, sub: str, mq: MessageQueue) -> LockEntry:
        broker = self.brokers.get(mq.broker_name)
        client: Any = broker.client
        if broker.is_cluster:
            # The lease is judged by the clock of the node holding it, read in the same round trip
            # (a cluster pipeline refuses TIME, which has no key): that node's own client.
            client = client.node_client(client.primary_for(mq.tag))
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.hmget(keys.sub_state(mq.tag, sub), "owner", "epoch", "lease", "assignee", "run")
        (sec, usec), (owner, epoch, lease, assignee, run) = pipe.execute()
        now = sec * 1000 + usec // 1000
        lease_ms = int(lease or 0)
        return LockEntry(
            owner=(owner or b"").decode() if lease_ms > now else "",
            epoch=int(epoch or 0),
            lease_until_ms=lease_ms,
            assignee=(assignee or b"").decode(),
            running=int(run or 0) > now,
        )

    def is_locked(self, sub: str, mq: MessageQueue, client_id: str) -> bool:
        """True if ``client_id`` holds a live lease on ``mq`` for ``sub``."""
        return self.lock_entry(sub, mq).owner == client_id

    def assign(
        self,
        sub: str,
        assignment: Sequence[tuple[MessageQueue, str, str]],
        dead_clients: Sequence[str] = (),
        pending_ttl_ms: int = DEFAULT_PENDING_TTL_MS,
    ) -> dict[MessageQueue, str]:
        """Apply a rebalance: ``(mq, assignee, token)`` triples; returns each queue's outcome."""
        out: dict[MessageQueue, str] = {}
        steps = BrokerSteps("rebalance")
        for broker_name, group in group_by_broker(assignment, lambda item: item[0]).items():
            with steps.of(broker_name):
                broker = self.brokers.get(broker_name)
                batches = broker.slot_batches(group, lambda item: item[0].tag)
                calls = []
                for items in batches:
                    kl: list[str] = []
                    args: list[object] = [self.lock_max_live_time_ms, pending_ttl_ms, len(dead_clients), *dead_clients]
                    for mq, assignee, token in items:
                        kl.append(keys.sub_state(mq.tag, sub))
                        kl.append(keys.queue_next(mq.tag))
                        args.append(assignee)
                        args.append(token)
                    calls.append((kl, args))
                for items, res in zip(batches, steps.partly(broker.name, broker.scripts.run_each("assign", calls)),
                                      strict=True):
                    if res is None:  # its shard failed (logged): no outcome, the next rebalance applies it
                        continue
                    for (mq, _, _), r in zip(items, res, strict=True):
                        out[mq] = r.decode() if isinstance(r, bytes) else str(r)
        steps.settle()
        return out

    def sweep(
        self,
        sub: str,
        candidates: Sequence[tuple[MessageQueue, str]],
        client_id: str = "",
        pending_ttl_ms: int = DEFAULT_PENDING_TTL_MS,
    ) -> list[Redispatch]:
        """Re-dispatch owned queues with a backlog and no live ConsumeRequest (invariant 5, no stall).

        ``candidates`` are ``(mq, token)`` pairs: the token a queue gets if it needs a new request
        (a task lost from the Celery broker, a pool process killed mid-run). Only queues whose live
        owner is ``client_id`` are considered (any owner when ``client_id`` is ``''``); a run whose
        lease lapsed mid-run is fenced with a new epoch. One ``sweep.lua`` call per broker.
        """
        return self.sweep_lanes([(sub, candidates)], client_id, pending_ttl_ms)[0]

    @staticmethod
    def _node_identity(broker: Broker, tag: str, seen: dict[str, str | Exception]) -> tuple[str, str]:
        """(node name, ``Broker.node_identity``) of ``tag``'s node, read once per node in a sweep
        (a node that failed to answer is not asked again in that sweep: its error is raised)."""
        client: Any = broker.client
        node = client.primary_for(tag).name if broker.is_cluster else ""
        if node not in seen:
            try:
                seen[node] = broker.node_identity(tag)
            except (redis.RedisError, RedisClusterException) as exc:
                seen[node] = exc
        got = seen[node]
        if isinstance(got, Exception):
            raise got
        return node, got

    def _recorded_on(self, where: tuple[str, str], identity: str) -> set[tuple[str, str]]:
        """The (sub, queue key) pairs this manager's sweeps recorded on node ``where`` under
        ``identity``: emptied when the identity changes (a failover) and every ``RECORD_AGAIN_S``."""
        now = time.monotonic()
        with self._recorded_lock:
            got = self._recorded.get(where)
            if got is None or got[0] != identity or now - got[1] > RECORD_AGAIN_S:
                got = self._recorded[where] = (identity, now, set())
            return got[2]

    def sweep_lanes(
        self,
        lanes: Sequence[tuple[str, Sequence[tuple[MessageQueue, str]]]],
        client_id: str = "",
        pending_ttl_ms: int = DEFAULT_PENDING_TTL_MS,
    ) -> list[list[Redispatch]]:
        """``sweep`` of several subscriptions at once, one list of redispatches per ``(sub,
        candidates)``: the ``sweep.lua`` calls of every lane go to each broker in one round trip.
        A worker of 64 single-topic groups otherwise paid 64 round trips per sweep interval, the
        bulk of its idle cost (issue 27)."""
        out: list[list[Redispatch]] = [[] for _ in lanes]
        flat = [(li, mq, tok) for li, (_, cands) in enumerate(lanes) for mq, tok in cands]
        steps = BrokerSteps("sweep")
        for broker, batches in self._lane_batches(flat):
            with steps.of(broker.name):
                # (identity passed, its items, the recorded set they join): one per lane batch and kind.
                groups: list[tuple[str, list[tuple[int, MessageQueue, str]], set[tuple[str, str]] | None]] = []
                nodes: dict[str, str | Exception] = {}  # one INFO per node and sweep (every batch on a plain Redis)
                unread: Exception | None = None
                skipped = 0
                for li, items in batches:
                    sub = lanes[li][0]
                    # sweep.lua records the node's identity on a queue, and notes a run mark written on
                    # another node, when it is passed: once per queue and identity, in a call of its own
                    # beside the queues already recorded (whose idle path stays two plain reads: a slot
                    # of an MGET and an HGET).
                    try:
                        node, identity = self._node_identity(broker, items[0][1].tag, nodes)
                    except (redis.RedisError, RedisClusterException) as exc:
                        if not broker.is_cluster:
                            raise
                        unread, skipped = exc, skipped + 1  # its shard is down: its queues are swept next time
                        continue
                    recorded = self._recorded_on((broker.name, node), identity) if identity else None
                    fresh: list[tuple[int, MessageQueue, str]] = []
                    rest: list[tuple[int, MessageQueue, str]] = items
                    if recorded is not None:
                        rest = []
                        for it in items:
                            (fresh if (sub, it[1].key) not in recorded else rest).append(it)
                    if fresh:
                        groups.append((identity, fresh, recorded))
                    if rest:
                        groups.append(("", rest, None))
                if not broker.is_cluster:
                    # Any keys may share a call on a plain Redis: the lanes' queues go in a few calls
                    # rather than one per lane (sweep.lua's keys name their subscription; its other
                    # arguments are the same for all). 64 groups of 16 queues cost 64 calls per sweep
                    # interval, each mostly the call's fixed cost (issue 27's idle cost).
                    groups = _merged(groups, SWEEP_CALL_QUEUES)
                calls = [([k for li, mq, _ in part for k in (keys.sub_state(mq.tag, lanes[li][0]), keys.queue_next(mq.tag))],
                          [client_id, pending_ttl_ms, ident, *[tok for _, _, tok in part]]) for ident, part, _ in groups]
                if unread is not None:
                    if not calls:  # no shard of the broker answered: as a broker down
                        raise unread
                    steps.missed(broker.name, skipped, len(batches), unread)
                replies = steps.partly(broker.name, broker.scripts.run_each("sweep", calls)) if calls else []
                for (_, part, recorded), res in zip(groups, replies, strict=True):
                    if res is None:  # its shard failed (logged): swept next time
                        continue
                    if recorded is not None:
                        with self._recorded_lock:
                            recorded.update((lanes[li][0], mq.key) for li, mq, _ in part)
                    for i in range(0, len(res), 3):
                        li, mq, _ = part[int(res[i]) - 1]
                        out[li].append(Redispatch(mq, res[i + 1].decode(), res[i + 2].decode()))
        steps.settle()
        return out

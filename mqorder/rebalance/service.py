"""The rebalance itself: allocate, apply to the lock table, and say whom to dispatch to.

RocketMQ runs rebalance inside every client, each one computing its own share from its own view
of the group. mqorder computes the whole assignment in one place (the ``rebalance`` task, under a
Redis mutex), so two racing rebalances, or two beats started by mistake, apply the same
deterministic answer through atomic scripts and can never assign one queue twice.

Queues move as soon as it is safe: at once when the old owner is idle or its heartbeat lapsed
(fencing covers a paused holder), or at the end of the old owner's ConsumeRequest run otherwise.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import LockError

from mqorder import keys
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.allocate import AllocateMessageQueueStrategy, allocate_all, strategy_from_settings
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.rebalance.membership import PULL_POOL, ClientInfo, ClientRegistry, redis_now_ms
from mqorder.settings import Settings
from mqorder.store.broker_steps import BrokerSteps
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.raw_pipe import RawPipeline
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: How long a rebalance waits for another one holding the mutex before it is skipped (the holder
#: applies the same deterministic answer).
REBALANCE_MUTEX_WAIT_S = 5.0
#: How often a rebalance waiting for the mutex asks again: a rebalance takes milliseconds.
MUTEX_POLL_S = 0.02



@dataclass(frozen=True)
class Dispatch:
    """Send a ConsumeRequest for (sub, mq) carrying ``token`` to ``client``."""

    sub: str
    mq: MessageQueue
    client: str
    token: str


def read_assignments(meta: redis.Redis, subs: Sequence[str]) -> list[list[Any] | dict[Any, Any]]:
    """The raw ``HGETALL`` reply of each of ``subs``' assignment hashes, in one round trip
    (``RawPipeline``: no reply callbacks, no dict built; a flat list, or a map on RESP3)."""
    pipe = RawPipeline(meta)
    for sub in subs:
        pipe.execute_command("HGETALL", keys.assignment(sub))
    return pipe.execute()


def parse_raw_assignment(raw: list[Any] | dict[Any, Any], client_id: str | None = None) -> list[MessageQueue]:
    """``parse_assignment`` of a raw ``HGETALL`` reply (``read_assignments``)."""
    return parse_assignment(raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True)),
                            client_id)


def parse_assignment(raw: dict[bytes | str, bytes | str], client_id: str | None = None) -> list[MessageQueue]:
    """The queues of an assignment hash's ``HGETALL`` (those of ``client_id``, or all), sorted."""
    return sorted(
        MessageQueue.from_key(text(k)) for k, v in raw.items() if client_id is None or text(v) == client_id
    )


@dataclass
class RebalanceReport:
    clients: list[str]
    dead: list[str]
    assigned: int = 0
    moved: int = 0
    busy: int = 0
    dispatches: list[Dispatch] = field(default_factory=list)
    took_ms: float = 0.0
    #: The mutex stayed held past the wait: nothing was computed, the caller should try again.
    skipped: bool = False


def subscriptions_by_lane(clients: list[ClientInfo]) -> dict[tuple[str, str], list[str]]:
    """(sub, topic) -> client ids: one lane per clustering group, one per broadcast client."""
    lanes: dict[tuple[str, str], list[str]] = defaultdict(list)
    for c in clients:
        for s in c.subscriptions:
            if s.model is MessageModel.BROADCASTING:
                lanes[(keys.broadcast_sub(s.group, c.client_id), s.topic)].append(c.client_id)
            else:
                lanes[(s.group, s.topic)].append(c.client_id)
    return lanes


class RebalanceService:
    def __init__(
        self, brokers: BrokerRegistry, settings: Settings, strategy: AllocateMessageQueueStrategy | None = None
    ) -> None:
        self.brokers = brokers
        self.settings = settings
        self.strategy = strategy or strategy_from_settings(settings)
        self.topics = TopicManager(brokers)
        self.locks = RebalanceLockManager(brokers, settings.lock_max_live_time_ms)
        self.registry = ClientRegistry(brokers.meta, settings.heartbeat_timeout_ms)
        #: How long the rebalance mutex outlives its holder: its liveness lease. A holder killed
        #: mid-rebalance blocks every other rebalance, and so every failover, until the mutex lapses;
        #: lapsing with the holder's heartbeat means the survivors can rebalance as soon as they can
        #: see it dead, not seconds later (a fixed 6 s lapse made one chaos failover 6.4-6.9 s when
        #: a restarted worker was killed during its first rebalance). A lapsed mutex is harmless: a
        #: rebalance takes milliseconds, and two compute the same deterministic answer and apply it
        #: through atomic scripts.
        self.mutex_timeout_s = settings.heartbeat_timeout_ms / 1000
        #: (sub, client) -> (the assignment hash as last read, its parsed queues). The hash is read
        #: at every sweep and lock renewal, but changes only at a rebalance: an unchanged one is
        #: not parsed again (parsing 1,024 queue keys every sweep was most of an idle worker's
        #: sweep, issue 27). The read itself stays: the hash, not this copy, is what counts.
        #: (sub, client) -> (the assignment hash's last raw HGETALL reply, its queues).
        self._assigned: dict[tuple[str, str | None], tuple[Any, list[MessageQueue]]] = {}

    def rebalance(self, wait_s: float = REBALANCE_MUTEX_WAIT_S) -> RebalanceReport:
        """Recompute and apply the assignment of every subscribed topic, under a mutex.

        The mutex is redis-py's ``Lock`` (``SET NX PX`` with a random token, compare-and-delete
        release). Waiting longer than ``wait_s`` skips this rebalance with an empty report: the
        holder is applying the same deterministic answer. Releasing a mutex that already lapsed
        (a rebalance slower than ``mutex_timeout_s``) only logs: the work is done and applied
        through atomic scripts, and the mutex now belongs to nobody or to the next rebalance,
        which the release must not delete.
        """
        meta = self.brokers.meta
        mutex = meta.lock(keys.rebalance_mutex(), timeout=self.mutex_timeout_s, blocking_timeout=wait_s, sleep=MUTEX_POLL_S)
        if not mutex.acquire():
            log.warning("rebalance skipped: another rebalance holds the mutex for over %.1fs", wait_s)
            return RebalanceReport([], [], skipped=True)
        try:
            report = self._rebalance()
            try:
                meta.set(keys.rebalance_last(), redis_now_ms(meta))
            except redis.RedisError as exc:  # applied already: its dispatches must still go out
                log.warning("rebalance applied; recording its time failed (%s)", exc)
            return report
        finally:
            try:
                mutex.release()
            except LockError:
                log.warning("rebalance mutex lapsed before its release (held over %.1fs)", self.mutex_timeout_s)
            except redis.RedisError as exc:  # it lapses on its own (mutex_timeout_s)
                log.warning("rebalance mutex not released (%s); it lapses within %.1fs", exc, self.mutex_timeout_s)

    def _rebalance(self) -> RebalanceReport:
        t0 = time.perf_counter()
        clients, dead, now = self.registry.clients()
        report = RebalanceReport(sorted(c.client_id for c in clients), dead)
        lanes = subscriptions_by_lane(clients)
        # Lanes of groups whose every client is gone still need their dead owners' locks released.
        for group, topics in self.topics.groups().items():
            for topic, model in topics.items():
                if model is MessageModel.CLUSTERING:
                    lanes.setdefault((group, topic), [])
        pending_ttl = self.settings.pending_ttl_ms
        pullers = {c.client_id for c in clients if c.pool == PULL_POOL}
        # The assignment hint of a lane covers every topic it subscribes to: written once per lane,
        # after all its topics are assigned (one delete per topic would keep only the last one's).
        hints: dict[str, list[str]] = defaultdict(list)
        # Every lane's route in one round trip, not one per lane (issue 27: beat rebalances every
        # 20 s, and a deployment of 64 topics paid 64 round trips for the routes alone).
        routes = self.topics.describe_topics(sorted({topic for _, topic in lanes}))
        steps = BrokerSteps("rebalance", part="lane")
        for (sub, topic), cids in sorted(lanes.items()):
            route = routes.get(topic)
            if route is None:
                log.warning("group lane %s subscribes to %r, which does not exist yet", sub, topic)
                continue
            mqs = route.message_queues
            if not route.readable:
                # Not readable (perm "w"): nobody consumes it; idle locks are released, running
                # requests hand over to nobody at their next commit.
                assignment = {}
            elif keys.BROADCAST_SEP in sub:
                assignment = {mq: cids[0] for mq in mqs}
            else:
                assignment = allocate_all(self.strategy, keys.group_of_sub(sub), mqs, cids)
            triples = [(mq, assignment.get(mq, keys.NOBODY), new_token()) for mq in mqs]
            results: dict[MessageQueue, str] = {}
            with steps.of(f"{sub}/{topic}"):  # a lane whose every broker is down: the others go on
                results = self.locks.assign(sub, triples, dead, pending_ttl)
            hints[sub].extend(x for mq, a, _ in triples if a != keys.NOBODY for x in (mq.key, a))
            for mq, assignee, tok in triples:
                r = results.get(mq)  # None: its broker failed (logged); the next rebalance applies it
                if assignee != keys.NOBODY:
                    report.assigned += 1
                if r in ("MOVED", "DISPATCH"):
                    report.moved += 1
                if r == "BUSY":
                    report.busy += 1
                if r == "DISPATCH" and assignee not in pullers:  # a PullConsumer takes no requests
                    report.dispatches.append(Dispatch(sub, mq, assignee, tok))
        steps.settle()  # every lane failed: raised; else logged, and the lanes that were applied hint
        pipe = self.brokers.meta.pipeline(transaction=False)
        for sub, hint in hints.items():
            pipe.delete(keys.assignment(sub))
            if hint:
                pipe.hset(keys.assignment(sub), items=hint)
        pipe.execute()
        # Forget heartbeats that lapsed more than a lease ago: their locks are gone by now.
        self.registry.forget_dead(dead, now - self.settings.lock_max_live_time_ms)
        report.took_ms = (time.perf_counter() - t0) * 1000
        return report

    # -- lease renewal and sweeping ------------------------------------------------------------------

    def assigned_queues(self, sub: str, client_id: str | None = None) -> list[MessageQueue]:
        """The queues of ``sub`` the last rebalance assigned (to ``client_id``, or to anyone), sorted:
        its read hint ``keys.assignment``, parsed once per change of the hash. The locks, not this
        hint, decide who consumes."""
        return self.assigned_queues_of([sub], client_id)[0]

    def assigned_queues_of(self, subs: Sequence[str], client_id: str | None = None) -> list[list[MessageQueue]]:
        """``assigned_queues`` of each of ``subs``, their hashes read in one round trip.

        Read raw (``RawPipeline``: no reply callbacks, no dict built) and compared with the reply
        last parsed: a worker reads every lane's assignment on every sweep (each 2 s), and it
        changes only with a rebalance."""
        if not subs:
            return []
        raws = read_assignments(self.brokers.meta, subs)
        return [self._parsed(sub, client_id, raw) for sub, raw in zip(subs, raws, strict=True)]

    def _parsed(self, sub: str, client_id: str | None, raw: list[Any] | dict[Any, Any]) -> list[MessageQueue]:
        """The queues of ``HGETALL``'s raw reply (a flat list, or a map on RESP3), parsed only when
        it differs from the last one seen for ``(sub, client_id)``."""
        seen = self._assigned.get((sub, client_id))
        if seen is not None and seen[0] == raw:
            return list(seen[1])
        mqs = parse_raw_assignment(raw, client_id)
        self._assigned[(sub, client_id)] = (raw, mqs)
        return list(mqs)

    def lanes_of(self, client: ClientInfo) -> list[str]:
        out = []
        for s in client.subscriptions:
            out.append(keys.broadcast_sub(s.group, client.client_id) if s.model is MessageModel.BROADCASTING else s.group)
        return sorted(set(out))

    def lock_all(self, client_id: str, subs: list[str]) -> int:
        """RocketMQ's ``lockAll`` for one client: renew (or take) every queue assigned to it."""
        n = 0
        lanes = [(sub, mqs) for sub, mqs in zip(subs, self.assigned_queues_of(subs, client_id), strict=True) if mqs]
        for locked in self.locks.try_lock_lanes(lanes, client_id):
            n += len(locked)
        return n

    def lock_all_clients(self) -> int:
        """``lock_all`` of every live client (beat's): a client whose every broker is down must not
        cost the clients after it their renewal."""
        clients, _, _ = self.registry.clients()
        steps, n = BrokerSteps("lock_all", part="client"), 0
        for c in clients:
            with steps.of(c.client_id):
                n += self.lock_all(c.client_id, self.lanes_of(c))
        steps.settle()
        return n

    def sweep(self, subs: list[str], client_id: str = "") -> list[Dispatch]:
        """Queues with a backlog, a live owner and no live ConsumeRequest: dispatch them again."""
        out: list[Dispatch] = []
        pending_ttl = self.settings.pending_ttl_ms
        pullers: set[str] = set()
        if not client_id:  # the central sweep sees every owner; PullConsumers take no requests
            pullers = {c.client_id for c in self.registry.clients()[0] if c.pool == PULL_POOL}
        # One random token per lane and sweep, suffixed per queue: unique all the same, without a
        # uuid4 per owned queue every sweep interval (an idle worker's main cost, issue 27). Every
        # lane's assignment is read in one round trip and every lane swept in one per broker.
        lanes = []
        for sub, mqs in zip(subs, self.assigned_queues_of(subs, client_id or None), strict=True):
            base = new_token()
            lanes.append((sub, [(mq, f"{base}.{i}") for i, mq in enumerate(mqs)]))
        for (sub, _), found in zip(lanes, self.locks.sweep_lanes(lanes, client_id, pending_ttl), strict=True):
            for r in found:
                if r.owner not in pullers:
                    out.append(Dispatch(sub, r.mq, r.owner, r.token))
        return out

    def all_lanes(self) -> list[str]:
        clients, _, _ = self.registry.clients()
        subs = {s for c in clients for s in self.lanes_of(c)}
        subs.update(self.topics.groups())
        return sorted(subs)

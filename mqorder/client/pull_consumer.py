"""``PullConsumer``: RocketMQ's pull consumer, where the application drives consumption itself.

    consumer = PullConsumer("audit")
    for mq in consumer.fetch_message_queues_in_balance("orders"):
        offset = consumer.fetch_consume_offset(mq)
        result = consumer.pull(mq, offset, 32)
        handle(result.msg_found_list)
        consumer.update_offset(mq, result.next_begin_offset)

It is a client of its group like a Celery worker is: registered with a heartbeat, it takes part in
the same rebalance (``mqorder.rebalance``: the configured allocation strategy, ``assign.lua``) and
holds its queues with the same leases and fencing epochs (``RebalanceLockManager``). It registers
with the ``pull`` pool, so no ConsumeRequest is ever dispatched to it. A daemon thread heartbeats,
renews its leases every ``lock_interval_ms`` and rebalances the group's lanes when a member joins or
lapses, so the application's loop only pulls and commits.

Committing is fenced like the engine's commit (invariant 3): ``update_offset`` names the epoch
``fetch_message_queues_in_balance`` granted, and ``update_offset.lua`` refuses it in the same atomic
step if a rebalance moved the queue or a lapsed lease let another consumer take it since. The
refused consumer learns it (``OffsetFencedError``) and the new holder starts from the last commit:
some messages may be handled twice, none is skipped, order per queue holds.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

from mqorder import keys
from mqorder.codec import decode_entries
from mqorder.errors import (
    BrokerUnavailableError,
    InvalidNameError,
    MQOrderError,
    OffsetFencedError,
    OffsetIllegalError,
    TopicNotFoundError,
)
from mqorder.model import MAX_OFFSET, MessageExt, MessageModel, MessageQueue
from mqorder.names import check_client_id, check_group, check_topic
from mqorder.rebalance.allocate import allocate_all, strategy_from_settings
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.rebalance.membership import PULL_POOL, ClientDetails, ClientRegistry, Subscription
from mqorder.rebalance.service import MUTEX_POLL_S
from mqorder.settings import Settings, get_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.failures import TRANSIENT
from mqorder.store.log import MessageLog
from mqorder.store.replication import ReplicaWait
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: RocketMQ's pull batch limit is 32 by default; a pull of more than this is refused.
MAX_PULL_NUMS = 1024
#: Msg ids remembered per queue for ``update_offset``'s identity check: a few full pulls' worth
#: (a commit of an offset whose message was pulled longer ago is checked by offset alone).
PULLED_IDS_KEPT = 2 * MAX_PULL_NUMS
#: How long a rebalance waits for another one holding the mutex.
REBALANCE_WAIT_S = 5.0
#: Lease of the rebalance mutex a pull consumer takes: far longer than its rebalance lasts, and it
#: is released at once (a crashed holder delays the next rebalance by at most this).
REBALANCE_MUTEX_LEASE_S = 30
#: How long close() waits for the duty thread.
THREAD_JOIN_S = 5.0


class PullStatus(enum.Enum):
    """RocketMQ's ``PullStatus`` (``NO_MATCHED_MSG`` does not arise: there is no tag filter)."""

    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


@dataclass(frozen=True)
class PullResult:
    """RocketMQ's ``PullResult``: pull again from ``next_begin_offset``.

    ``OFFSET_ILLEGAL``: the offset is below what the queue still holds (retention trimmed it) or
    past its end; ``next_begin_offset`` is then the nearest legal offset.
    """

    pull_status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    msg_found_list: list[MessageExt] = field(default_factory=list)


_instances = itertools.count(1)


@contextmanager
def _reachable(consumer: PullConsumer, action: str) -> Iterator[None]:
    """A Redis that does not answer, as the one error a caller acts on, with what to do."""
    try:
        yield
    except TRANSIENT as exc:
        raise BrokerUnavailableError(
            f"{action} of pull consumer {consumer.client_id} (group {consumer.group!r}) failed: Redis at "
            f"{consumer.brokers.default.safe_url} did not answer ({type(exc).__name__}: {exc}). Retry when it is "
            "back: pulls only read, and update_offset is fenced and only moves forward, so repeating it is safe"
        ) from exc


def default_client_id() -> str:
    """``pull-<pid>-<n>@<host>``: unique per consumer of a process, and a valid client id."""
    return f"pull-{os.getpid()}-{next(_instances)}@{socket.gethostname()}"



def _dlq_advice(topic: str) -> str:
    """The refusal of a dead-letter topic, saying how to read one: the generic name check said the
    prefix is "reserved; choose another name", which points a user who wants the DLQ away from it."""
    group = topic[len(keys.DLQ_PREFIX):] or "GROUP"
    return (
        f"{topic!r} is a dead-letter topic: a PullConsumer does not subscribe to it (nothing consumes a "
        f"DLQ as a group). Read it with `mqorder dlq list {group} --json` and `mqorder dlq show {group} "
        f"--offset N --json`, or from Python with mqorder.admin: `with Admin.open() as admin: "
        f"dlq_list(admin, {group!r}).messages` (Admin from mqorder.admin.common, dlq_list from mqorder.admin.dlq); "
        "`mqorder dlq replay` puts dead letters back in their topic"
    )

class PullConsumer:
    """A consumer group member whose application pulls and commits itself.

    ``start()`` is implicit in the first ``fetch_message_queues_in_balance``; ``shutdown()`` leaves
    the group (its queues are rebalanced to the others at once) and should be called on exit.
    """

    def __init__(
        self,
        group: str,
        *,
        settings: Settings | None = None,
        client_id: str | None = None,
        brokers: BrokerRegistry | None = None,
    ) -> None:
        self.group = check_group(group)
        self.settings = settings or get_settings()
        self.client_id = check_client_id(client_id or default_client_id())
        self._own_brokers = brokers is None
        self.brokers = brokers or BrokerRegistry(self.settings.redis_url, self.settings.brokers)
        self.topics = TopicManager(self.brokers)
        self.locks = RebalanceLockManager(self.brokers, self.settings.lock_max_live_time_ms,
                                          ReplicaWait.from_settings(self.settings))
        self.registry = ClientRegistry(self.brokers.meta, self.settings.heartbeat_timeout_ms)
        self.strategy = strategy_from_settings(self.settings)
        self.log = MessageLog(self.brokers)
        self._lock = threading.RLock()
        self._topics: list[str] = []
        #: Each topic's queues as last read (``_check_queue``).
        self._queues: dict[str, frozenset[MessageQueue]] = {}
        #: Queue -> the epoch it was granted by ``fetch_message_queues_in_balance``.
        self._epochs: dict[MessageQueue, int] = {}
        #: queue -> {offset: msg id} of what this consumer pulled lately: ``update_offset`` sends
        #: the id below the offset it commits, which the store must still hold there (after a
        #: failover the offset alone would accept skipping messages appended on the new primary).
        self._pulled: dict[MessageQueue, dict[int, str]] = {}
        #: Its own lock: ``pull`` must not wait for the duties thread, which holds ``_lock``
        #: through Redis calls (a rebalance waits up to seconds for the group's mutex).
        self._pulled_lock = threading.Lock()
        self._fingerprint = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the RocketMQ surface --------------------------------------------------------------------

    def fetch_message_queues_in_balance(self, topic: str) -> list[MessageQueue]:
        """The queues of ``topic`` this consumer holds now, each with a fresh lease and epoch.

        Subscribes (and joins the group) on first use. Call it again whenever ``update_offset``
        says a queue was fenced, and now and then anyway: a rebalance moves queues as members come
        and go, and only the queues returned here may be committed.
        """
        with _reachable(self, "fetch_message_queues_in_balance"):
            return self._fetch_in_balance(topic)

    def _fetch_in_balance(self, topic: str) -> list[MessageQueue]:
        if isinstance(topic, str) and topic.startswith(keys.DLQ_PREFIX):
            raise InvalidNameError(_dlq_advice(topic))
        topic = check_topic(topic)
        with self._lock:
            if topic not in self._topics:
                self.topics.describe_topic(topic)  # TopicNotFoundError, with its advice, if absent
                self._topics.append(topic)
                self.topics.subscribe(self.group, topic, MessageModel.CLUSTERING)
                self._register()
            if self._membership_changed():
                self._rebalance()
            assigned = [mq for mq in self._assigned() if mq.topic == topic]
            held = self.locks.try_lock_batch(self.group, assigned, self.client_id) if assigned else {}
            for mq in [m for m in self._epochs if m.topic == topic]:
                del self._epochs[mq]
            self._epochs.update(held)
            for mq in [m for m in self._pulled if m not in self._epochs]:
                self._forget_pulled(mq)  # a queue that left the balance: its ids are of no use now
            return sorted(held)

    def pull(self, mq: MessageQueue, offset: int, max_nums: int | None = None, *, block_ms: int = 0) -> PullResult:
        """Read up to ``max_nums`` messages of ``mq`` from ``offset`` (nothing is committed); by
        default ``MQORDER_PULL_BATCH_SIZE`` (RocketMQ's pullBatchSize, 32).

        Reading needs no lock, as in RocketMQ; committing does. With ``block_ms`` the call waits
        that long for a first message when there is none yet (RocketMQ's ``pullBlockIfNotFound``).
        """
        with _reachable(self, "pull"):
            self._check_queue(mq)
            return self._pull(mq, offset, self.settings.pull_batch_size if max_nums is None else max_nums, block_ms)

    def _pull(self, mq: MessageQueue, offset: int, max_nums: int, block_ms: int) -> PullResult:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise OffsetIllegalError(f"offset must be an int >= 0, got {offset!r}")
        if isinstance(max_nums, bool) or not isinstance(max_nums, int) or not 1 <= max_nums <= MAX_PULL_NUMS:
            raise OffsetIllegalError(f"max_nums must be an int from 1 to {MAX_PULL_NUMS}, got {max_nums!r}")
        client = self.brokers.get(mq.broker_name).client
        log_key = keys.queue_log(mq.tag)
        # One round trip: the queue's bounds and the batch (discarded if the offset is illegal).
        pipe = client.pipeline(transaction=False)
        pipe.xrange(log_key, count=1)
        pipe.get(keys.queue_next(mq.tag))
        # An offset past any stream id is merely illegal (the bounds below), not a Redis error.
        pipe.xrange(log_key, min=f"{min(offset, MAX_OFFSET)}-0", count=max_nums)
        head, nxt, raw = pipe.execute()
        max_off = int(nxt or 0)
        min_off = int(head[0][0].split(b"-", 1)[0]) if head else max_off
        if offset < min_off or offset > max_off:
            nearest = min_off if offset < min_off else max_off
            return PullResult(PullStatus.OFFSET_ILLEGAL, nearest, min_off, max_off)
        if not raw and block_ms > 0:
            after = f"{offset - 1}-1" if offset > 0 else "0-0"
            got: Any = client.xread({log_key: after}, count=max_nums, block=block_ms)
            # RESP2 gives [[stream, entries]]; RESP3 gives {stream: entries}.
            streams = list(got.values()) if isinstance(got, dict) else [e for _, e in got or []]
            raw = streams[0] if streams else []
        msgs = decode_entries(mq, raw, max_message_size=self.settings.max_message_size)
        self._pulled_ids(mq, msgs)
        if not msgs:
            return PullResult(PullStatus.NO_NEW_MSG, offset, min_off, max_off)
        return PullResult(PullStatus.FOUND, msgs[-1].queue_offset + 1, min_off, max(max_off, msgs[-1].queue_offset + 1),
                          msgs)

    def _pulled_ids(self, mq: MessageQueue, msgs: list[Any]) -> None:
        """Remember the msg id pulled at each offset (the last ``PULLED_IDS_KEPT`` per queue):
        ``update_offset`` names the one below the offset it commits."""
        if not msgs:
            return
        with self._pulled_lock:
            seen = self._pulled.setdefault(mq, {})
            for m in msgs:
                # A poison entry's id may be anything (decode_entries passes it on, flagged):
                # such an offset is committed unchecked.
                if type(m.msg_id) is str and m.msg_id:
                    seen[m.queue_offset] = m.msg_id
            if len(seen) > PULLED_IDS_KEPT:  # keep the newer half: one rebuild per KEPT/2 pulled
                floor = max(seen) - PULLED_IDS_KEPT // 2
                self._pulled[mq] = {o: i for o, i in seen.items() if o > floor}

    def _forget_pulled(self, mq: MessageQueue) -> None:
        with self._pulled_lock:
            self._pulled.pop(mq, None)

    def update_offset(self, mq: MessageQueue, offset: int) -> None:
        """Commit ``offset`` (the next message to consume) for the group on ``mq``, fenced.

        Raises ``OffsetFencedError`` if this consumer no longer holds ``mq`` at the epoch it was
        given (then fetch the queues in balance again), ``OffsetIllegalError`` for an offset behind
        the committed one or past the end of the queue. Renews the lease.
        """
        with _reachable(self, "update_offset"):
            self._update_offset(mq, offset)

    def _update_offset(self, mq: MessageQueue, offset: int) -> None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise OffsetIllegalError(f"offset must be an int >= 0, got {offset!r}")
        epoch = self._epochs.get(mq)
        if epoch is None:
            raise OffsetFencedError(
                f"{mq} is not in this consumer's balance (group {self.group!r}); call "
                f"fetch_message_queues_in_balance({mq.topic!r}) and commit only the queues it returns"
            )
        broker = self.brokers.get(mq.broker_name)
        with self._pulled_lock:
            pulled = self._pulled.get(mq, {}).get(offset - 1, "")
        reply = broker.scripts.update_offset(
            keys=[keys.sub_state(mq.tag, self.group), keys.queue_next(mq.tag), keys.queue_log(mq.tag)],
            args=[self.client_id, epoch, offset, self.settings.lock_max_live_time_ms, pulled],
        )
        verdict = text(reply[0])
        if verdict == "OK":
            return
        if verdict == "CHANGED":
            self._forget_pulled(mq)
            raise OffsetFencedError(
                f"update_offset({mq}, {offset}) refused: the message stored at offset {offset - 1} is "
                f"{text(reply[1]) or 'another one'}, not {pulled}, which this consumer pulled there (the "
                "store failed over to a replica that had not received it, and other messages took its "
                "offsets); nothing was committed. Resume from fetch_consume_offset: what you handled "
                "since then may be delivered again, nothing is skipped"
            )
        if verdict == "FENCED":
            with self._lock:
                self._epochs.pop(mq, None)
            owner = text(reply[2]) or "nobody"
            raise OffsetFencedError(
                f"update_offset({mq}, {offset}) refused: epoch {epoch} of {self.client_id} is stale (the queue "
                f"is at epoch {int(reply[1])}, held by {owner}); nothing was committed. Fetch the queues in "
                "balance again and resume from fetch_consume_offset"
            )
        if verdict == "BACKWARD":
            raise OffsetIllegalError(
                f"update_offset({mq}, {offset}) refused: the group already committed {int(reply[1])}, and "
                "offsets only move forward (reset them with `mqorder offsets reset`)"
            )
        raise OffsetIllegalError(
            f"update_offset({mq}, {offset}) refused: the queue holds offsets below {int(reply[1])} only; "
            "commit the offset after the last message you handled (PullResult.next_begin_offset)"
        )

    def fetch_consume_offset(self, mq: MessageQueue) -> int:
        """The group's committed offset on ``mq``: the next message to consume."""
        with _reachable(self, "fetch_consume_offset"):
            self._check_queue(mq)
            return self.log.consume_offset(self.group, mq)

    def _check_queue(self, mq: MessageQueue) -> None:
        """Refuse a queue its topic does not have (RocketMQ's broker answers a pull of a queue id
        past the topic's queues with an error): read as one it had, it answered NO_NEW_MSG and
        offset 0 for ever, so a typo in a queue id looked like a quiet queue. The topic's queues
        are cached; a miss reads the route again (the topic may have grown since)."""
        if not isinstance(mq, MessageQueue):
            raise TypeError(f"a MessageQueue is needed (from fetch_message_queues_in_balance), got {mq!r}")
        known = self._queues.get(mq.topic)
        if known is not None and mq in known:
            return
        route = self.topics.describe_topic(mq.topic)  # TopicNotFoundError, with its advice, if absent
        known = self._queues[mq.topic] = frozenset(route.message_queues)
        if mq not in known:
            layout = ", ".join(f"{n} on {b} (0-{n - 1})" for b, n in sorted(route.queues_per_broker.items()))
            raise TopicNotFoundError(f"topic {mq.topic!r} has no queue {mq.queue_id} on broker {mq.broker_name!r}: "
                                     f"its queues are {layout}; use the queues fetch_message_queues_in_balance "
                                     "returns")

    def shutdown(self) -> None:
        """Leave the group: unregister, rebalance its queues to the others, release its locks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=THREAD_JOIN_S)
        try:
            if self._thread is not None:
                self.registry.unregister(self.client_id)
                self._rebalance()
                mqs = self._assigned(everyone=True)
                if mqs:
                    self.locks.unlock_batch(self.group, mqs, self.client_id, force=True)
        except redis.RedisError as exc:
            log.warning("pull consumer %s could not leave cleanly (%s); its leases will lapse", self.client_id, exc)
        finally:
            self._epochs.clear()
            with self._pulled_lock:
                self._pulled.clear()
            if self._own_brokers:
                self.brokers.close()

    def __enter__(self) -> PullConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- membership and rebalance ----------------------------------------------------------------

    def _register(self) -> None:
        subs = [Subscription(self.group, t, MessageModel.CLUSTERING) for t in self._topics]
        self.registry.register(self.client_id, subs, ClientDetails(pool=PULL_POOL))
        self._fingerprint = ""  # rebalance on the next fetch
        if self._thread is None:
            self._thread = threading.Thread(target=self._duties, name=f"mqorder-pull-{self.client_id}", daemon=True)
            self._thread.start()

    def _register_again(self) -> None:
        """The registration vanished while this consumer runs: another process under the same
        client id left (and unregistered it), or Redis lost its data. The heartbeat alone kept a
        member with no subscriptions, which every rebalance gave no queue, so the application's
        ``fetch_message_queues_in_balance`` returned nothing for good. Register (and subscribe)
        again; the rebalance follows from the changed membership."""
        log.warning("pull consumer %s found its registration gone, registering again: another process under the "
                    "same client id stopped and unregistered it (give each consumer its own client_id), or Redis "
                    "lost its data (restarted without persistence, flushed)", self.client_id)
        for topic in self._topics:
            self.topics.subscribe(self.group, topic, MessageModel.CLUSTERING)
        self._register()

    def _fingerprint_now(self) -> str:
        topology = text(self.brokers.meta.get(keys.topology_version()))
        return f"{self.registry.membership_fingerprint()}\n{topology}"

    def _membership_changed(self) -> bool:
        return self._fingerprint_now() != self._fingerprint

    def _rebalance(self) -> None:
        """Apply the group's allocation to its lanes of the topics this consumer reads.

        The same deterministic answer a worker's rebalance computes (same strategy, same members),
        applied under the same mutex through ``assign.lua``: whoever runs it, a queue is assigned once.
        """
        fingerprint = self._fingerprint_now()
        meta = self.brokers.meta
        mutex = meta.lock(keys.rebalance_mutex(), timeout=REBALANCE_MUTEX_LEASE_S, blocking_timeout=REBALANCE_WAIT_S,
                          sleep=MUTEX_POLL_S)
        if not mutex.acquire():
            return
        try:
            clients, dead, _ = self.registry.clients()
            members: dict[str, list[str]] = defaultdict(list)
            for c in clients:
                for s in c.subscriptions:
                    if s.group == self.group and s.model is MessageModel.CLUSTERING:
                        members[s.topic].append(c.client_id)
            hint: dict[str, str] = {}
            stale: list[str] = []
            for topic in self._topics:
                route = self.topics.describe_topic(topic)
                mqs = route.message_queues
                assignment = allocate_all(self.strategy, self.group, mqs, members[topic]) if route.readable else {}
                triples = [(mq, assignment.get(mq, keys.NOBODY), new_token()) for mq in mqs]
                self.locks.assign(self.group, triples, dead, self.settings.pending_ttl_ms)
                stale += [mq.key for mq in mqs]
                hint.update({mq.key: a for mq, a, _ in triples if a != keys.NOBODY})
            pipe = meta.pipeline(transaction=False)
            if stale:
                pipe.hdel(keys.assignment(self.group), *stale)
            if hint:
                pipe.hset(keys.assignment(self.group), items=[x for kv in hint.items() for x in kv])
            pipe.execute()
        finally:
            try:
                mutex.release()
            except redis.exceptions.LockError:
                log.warning("pull consumer %s: rebalance mutex lapsed before its release", self.client_id)
        self._fingerprint = fingerprint

    def _assigned(self, everyone: bool = False) -> list[MessageQueue]:
        raw = self.brokers.meta.hgetall(keys.assignment(self.group))
        return sorted(
            MessageQueue.from_key(text(k)) for k, v in raw.items()
            if everyone or text(v) == self.client_id
        )

    def _duties(self) -> None:
        """Heartbeat, lease renewal and rebalance on a membership change, off the application's loop."""
        s = self.settings
        next_lock = 0.0
        while not self._stop.wait(s.heartbeat_interval_ms / 1000):
            try:
                beat = self.registry.heartbeat_and_watch(self.client_id)
                with self._lock:
                    if not beat.registered and not self._stop.is_set():
                        self._register_again()
                    if self._membership_changed():
                        self._rebalance()
                    now = time.monotonic()
                    if now >= next_lock:
                        next_lock = now + s.lock_interval_ms / 1000
                        self._renew()
            except redis.RedisError as exc:
                log.warning("pull consumer %s: Redis error in its duties (%s); retrying", self.client_id, exc)
            except MQOrderError as exc:
                log.warning("pull consumer %s: %s", self.client_id, exc)

    def _renew(self) -> None:
        """Renew the leases of the queues held; one whose epoch changed is dropped from the balance
        (only ``fetch_message_queues_in_balance`` grants an epoch to commit with)."""
        if not self._epochs:
            return
        held = self.locks.try_lock_batch(self.group, list(self._epochs), self.client_id)
        for mq, epoch in list(self._epochs.items()):
            if held.get(mq) != epoch:
                del self._epochs[mq]

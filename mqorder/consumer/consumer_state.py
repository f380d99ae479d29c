"""``ConsumerState``: what every consume run of one process shares.

Redis clients, the stats manager, the DLQ and retry writers, the worker's say on lingering and the
watch over this client's idle queues. A ``ConsumeRequest`` reads and writes it; the
``ConsumerEngine`` (``mqorder.consumer.engine``) adds the loop that runs requests. Split from the
engine so the request classes, which need this state, and the engine, which needs the request
classes, import each other in one direction only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mqorder import keys
from mqorder.consumer.dlq import DeadLetterWriter
from mqorder.consumer.idle_watch import IdleQueueWatch
from mqorder.consumer.listener import ListenerSpec, get_listener, registered_listeners
from mqorder.consumer.retry import RetrySender
from mqorder.consumer.stats import ConsumerStatsManager
from mqorder.model import MessageModel, MessageQueue
from mqorder.process_queue import ProcessQueue
from mqorder.rebalance.service import parse_raw_assignment, read_assignments
from mqorder.settings import Settings
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.delay import DelayStore
from mqorder.store.replication import ReplicaWait
from mqorder.store.topics import TopicManager

#: How old the list of this client's queues a lingering request watches may be.
OWNED_CACHE_S = 1.0


def _never() -> bool:
    return False


def _always() -> bool:
    return True


def _ignore(_lingering: bool) -> None:
    return None


class ConsumerState:
    """Per-process consumer state: Redis clients, stats, the DLQ writer, the linger signals."""

    def __init__(self, settings: Settings, client_id: str, brokers: BrokerRegistry | None = None) -> None:
        self.settings = settings
        self.client_id = client_id
        self.brokers = brokers or BrokerRegistry(settings.redis_url, settings.brokers)
        self.topics = TopicManager(self.brokers)
        #: Replicas that must hold a new epoch before a run calls a listener under it.
        self.replica_wait = ReplicaWait.from_settings(settings)
        #: (sub, queue key) -> the newest epoch seen on those replicas: later runs of this process
        #: under it need no ``WAIT`` (``ConsumeRequest._epoch_replicated``). A ProcessQueue is per
        #: run, so it cannot hold this.
        self.replicated_epochs: dict[tuple[str, str], int] = {}
        #: id(ListenerSpec) -> (the spec, what each of its runs reads from it and the settings):
        #: ``consume_request.run_constants``.
        self.run_constants: dict[int, tuple[ListenerSpec, dict[str, Any]]] = {}
        self.stats = ConsumerStatsManager()
        #: Whether a drained request may wait for more messages: set by the integration (the
        #: Celery threads pool can tell whether requests are waiting for a slot); never by default.
        self.may_linger: Callable[[], bool] = _never
        #: Whether a request that has not lingered yet may begin to (on top of ``may_linger``): the
        #: integration says no while this would leave no pool slot free for the next request.
        self.may_start_linger: Callable[[], bool] = _always
        #: Whether another request of this worker has waited for a pool slot (a run with a backlog
        #: then yields after ``consume_yield_after_ms``): set by the integration; never by default,
        #: and never when the signal is not known (a stale one is not "somebody waits").
        self.others_wait: Callable[[], bool] = _never
        #: Told ``True`` at every lingering read and ``False`` when a task execution that lingered
        #: ends (a prefork child notes it for its siblings' ``may_start_linger``).
        self.note_lingering: Callable[[bool], None] = _ignore
        appender = QueueAppender(
            self.brokers, pending_ttl_ms=settings.pending_ttl_ms, timeout=settings.send_msg_timeout_ms / 1000,
            topics=self.topics, action="DLQ write",
        )
        self.dlq = DeadLetterWriter(appender, self.topics, self.brokers.default_name, client_id)
        self._appender = appender
        self._retry_sender: RetrySender | None = None
        self._owned: dict[str, tuple[float, list[MessageQueue]]] = {}
        #: The newest entry of this client's nudge stream seen by a lingering read (per process).
        self.nudge_seen = "0-0"
        # Settings read on every run, worked out once (a pydantic model's attribute is a slow
        # lookup, and at a trickle a run is a message). Re-check the lock before a listener call
        # once the last confirmation is older than half a heartbeat timeout (RocketMQ: 30 s): a
        # holder resumed after a pause notices it was replaced before it calls the listener
        # again, not 30 s later.
        self._pq_lock_expire_ms = min(settings.client_lock_expire_ms, settings.heartbeat_timeout_ms // 2)
        self._linger_idle_queues = settings.consume_linger_ms > 0 and settings.consume_linger_idle_queues
        #: That stream's key, and as a reply names it (spelled once: every lingering read needs it).
        self.nudge_key = keys.linger_nudge(client_id)
        self.nudge_key_b = self.nudge_key.encode()
        #: (sub, queue key) whose trimmed messages were logged already: a warning once per queue.
        self.skips_logged: set[tuple[str, str]] = set()

    @property
    def retry_sender(self) -> RetrySender:
        """Where concurrent listeners send failed messages back to (``%RETRY%<group>``), made on
        first use: orderly consumers never need it."""
        if self._retry_sender is None:
            s = self.settings
            delays = DelayStore(self.brokers, self._appender, timeout=s.send_msg_timeout_ms / 1000)
            self._retry_sender = RetrySender(self.topics, delays, levels_ms=s.delay_levels_ms,
                                             queue_nums=s.retry_queue_nums)
        return self._retry_sender

    @property
    def nudges_idle(self) -> bool:
        """Whether a run that leaves its queue idle tells this client's lingering requests
        (``nudge.idle_entry``): when requests linger here and watch other queues."""
        return self.may_linger is not _never and self._linger_idle_queues

    def owned_queues(self, sub: str) -> list[MessageQueue]:
        """Queues of ``sub`` the rebalance assigned to this client (its read hint, at most a second
        old): what a lingering request may watch. The locks, not this list, decide who consumes."""
        return self.owned_queues_of([sub])[0]

    def owned_queues_of(self, subs: list[str]) -> list[list[MessageQueue]]:
        """``owned_queues`` of each of ``subs``; those older than ``OWNED_CACHE_S`` read again in one
        round trip (a lingering request of a worker with 60 groups watches them all)."""
        now = time.monotonic()
        stale = [sub for sub in subs if (hit := self._owned.get(sub)) is None or now - hit[0] >= OWNED_CACHE_S]
        if stale:
            for sub, raw in zip(stale, read_assignments(self.brokers.meta, stale), strict=True):
                self._owned[sub] = (now, parse_raw_assignment(raw, self.client_id))
        return [self._owned[sub][1] for sub in subs]

    def listener_subs(self) -> list[str]:
        """The subscription of every listener registered in this process (a broadcasting group's is
        this client's own), each once, in registration order."""
        subs = (keys.broadcast_sub(spec.group, self.client_id) if spec.message_model is MessageModel.BROADCASTING
                else spec.group for spec in registered_listeners())
        return list(dict.fromkeys(subs))

    def idle_watch(self, sub: str, mq: MessageQueue) -> IdleQueueWatch | None:
        """A watch over the other idle queues this client owns on ``mq``'s broker, of ``sub`` and of
        every other subscription with a listener here, for a lingering request (None when
        lingering on other queues is off)."""
        s = self.settings
        broker = self.brokers.get(mq.broker_name)
        if not s.consume_linger_idle_queues or broker.is_cluster:
            # On a Redis Cluster a queue and its owner's nudge stream are in different slots: no
            # doorbell (ring_doorbell skips it), and a blocking read names one slot's keys only.
            return None

        def watchable() -> list[tuple[str, MessageQueue]]:
            # Only queues this process has a listener for (the caller's topic's, or one registered
            # here): a switch runs the queue with its own group's and topic's listener
            # (``_listener_of``); a group's topic whose listener lives elsewhere is left to its
            # wake-ups. The caller's subscription first (``switch.lua`` offers only its queues).
            subs = [sub, *(other for other in self.listener_subs() if other != sub)]
            out: list[tuple[str, MessageQueue]] = []
            for each, queues in zip(subs, self.owned_queues_of(subs), strict=True):
                group = keys.group_of_sub(each)
                out += [(each, q) for q in queues
                        if (each == sub and q.topic == mq.topic) or get_listener(group, q.topic) is not None]
            return out

        return IdleQueueWatch(self.client_id, sub, mq.broker_name, broker.scripts, broker.client,
                              watchable, s.pending_ttl_ms, s.lock_max_live_time_ms)

    def new_process_queue(self) -> ProcessQueue:
        return ProcessQueue(self._pq_lock_expire_ms)

"""``ConsumeRequest``: one run of orderly consumption of one queue, in named steps.

RocketMQ's ``ConsumeMessageOrderlyService.ConsumeRequest.run`` is one 200-line method with five
exits. Here the same loop is split into *check* (``begin.lua``: token, lock, lease, first pull),
*take* (``ProcessQueue.take_messages`` and the poison-message split), *consume* (hooks, listener,
stats) and *settle* (commit / suspend / DLQ), and the run ends with ``finish.lua``, which decides
atomically who consumes next. Redis sees one read and one fenced commit per *pulled* batch
(the commit script also reads the next batch), never a round trip per message.

The run returns an ``Outcome``; the Celery task turns it into ``apply_async`` to the right worker
(a re-queue with a countdown is RocketMQ's ``submitConsumeRequestLater``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import redis
from redis.exceptions import NoScriptError

from mqorder import keys
from mqorder.backoff import Backoff
from mqorder.codec import decode_entries
from mqorder.consumer.context import ConsumeOrderlyContext
from mqorder.consumer.dlq import DeadLetterWriter
from mqorder.consumer.hooks import (
    ConsumeMessageContext,
    RefusedContext,
    global_hooks,
    run_after,
    run_before,
    run_refused,
)
from mqorder.consumer.idle_watch import ADOPT_TTL_MS, FollowUp, IdleQueueWatch
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome
from mqorder.consumer.listener import ListenerSpec, get_listener
from mqorder.consumer.nudge import idle_entry, idle_queues
from mqorder.consumer.retry import RetrySender
from mqorder.consumer.stats import ConsumerStatsManager
from mqorder.errors import BrokerUnavailableError
from mqorder.model import ConsumeOrderlyStatus, MessageExt, MessageQueue
from mqorder.process_queue import ProcessQueue
from mqorder.rebalance.service import assigned_queues
from mqorder.settings import Settings
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.delay import DelayStore
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

SUCCESS = ConsumeOrderlyStatus.SUCCESS
SUSPEND = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
COMMIT = ConsumeOrderlyStatus.COMMIT
ROLLBACK = ConsumeOrderlyStatus.ROLLBACK

#: RocketMQ re-submits after the time budget 10 ms later, and after a failed lock 100 ms later.
BUDGET_REQUEUE_S = 0.01
#: A lingering read blocks this long at most. It ends sooner when a message arrives on a watched
#: queue or when the worker nudges its lingering requests (a request waits for a slot,
#: ``mqorder.consumer.nudge``); the slice bounds how late a missed nudge or a reassignment of the
#: queue is noticed.
LINGER_SLICE_S = 0.1
#: How old the list of this client's queues a lingering request watches may be.
OWNED_CACHE_S = 1.0
#: Consume counters are pushed to Redis at most this often per process.
STATS_FLUSH_INTERVAL_S = 1.0
#: How long a ConsumeRequest keeps retrying through a Redis outage before leaving it to the sweep.
REDIS_RETRY_BUDGET_S = 120.0


class Verb(StrEnum):
    """What the caller must do after a run (``Outcome.verb``)."""

    #: Nothing: the queue is drained (or nobody consumes it any more).
    IDLE = "IDLE"
    #: This task was a duplicate: its token was superseded (STALE) or is already running (BUSY).
    STALE = "STALE"
    BUSY = "BUSY"
    #: The lock moved away; its new owner was dispatched by whoever moved it.
    FENCED = "FENCED"
    #: Send a ConsumeRequest with ``token`` to ``target`` (this client again, the new assignee, or
    #: the current owner) after ``countdown``.
    REQUEUE = "REQUEUE"
    HANDOVER = "HANDOVER"
    DISPATCH = "DISPATCH"
    #: The run switched to another queue of its ``IdleQueueWatch`` and its own queue, still
    #: locked by this client, is now one of the watch's adopted queues (``finish.lua`` 'adopt').
    ADOPTED = "ADOPTED"
    #: The run switched queues and left its ``finish.lua`` to the next run, which sends it in the
    #: round trip of its own ``begin.lua`` (``ConsumeRequest.prior``). Never a task's outcome.
    SWITCHED = "SWITCHED"


class Stop(StrEnum):
    """Why the consume loop of a run stopped. ``DONE``/``REQUEUE`` are ``finish.lua``'s actions."""

    #: Drained, dropped or revoked: ``finish.lua`` decides who consumes next.
    DONE = "done"
    #: A suspend or the time budget: run again after a countdown (``submitConsumeRequestLater``).
    REQUEUE = "requeue"
    #: A fenced call was refused: the run lost its queue.
    FENCED = "fenced"
    #: The last commit found the queue drained and ended the run itself (``commit.lua`` IDLE).
    IDLE = "idle"
    #: The lingering read found messages on another adopted queue (``Pull.switch``): end the run
    #: and hand this queue to the watch in the same step (``finish.lua`` 'adopt').
    SWITCH = "adopt"


@dataclass(frozen=True, slots=True)
class LoopEnd:
    stop: Stop
    countdown: float = 0.0


@dataclass(frozen=True, slots=True)
class Pull:
    """What a fenced commit-and-pull, or a lingering read, brought back.

    ``lost``: the run no longer holds its queue (stop, fenced); ``ended``: the commit ended the run
    on a drained queue; ``switch``: the lingering read found messages on another idle queue of
    this client (``ConsumeRequest.switch_to``): end this run, run that one; ``wait``: a lingering
    read ended with nothing for this run (its slice ran out, or a nudge), and the linger may go
    on; otherwise ``count`` new messages are in the ProcessQueue (0: none).
    """

    count: int = 0
    lost: bool = False
    ended: bool = False
    switch: bool = False
    wait: bool = False


LOST = Pull(lost=True)
ENDED = Pull(ended=True)
NOTHING = Pull()
SWITCH = Pull(switch=True)
WAIT = Pull(wait=True)


@dataclass(slots=True)
class Handled:
    """One listener call: its status and, when the ledger is on, its wall-clock start and end (ms).

    Not frozen: it is made once per listener call on the hot path, and a frozen dataclass's
    ``__init__`` goes through ``object.__setattr__`` for every field (measured with callgrind: a
    few thousand instructions per call at consume batch 1); nothing keeps it after ``_settle``.
    """

    status: ConsumeOrderlyStatus
    start_ms: float = 0.0
    end_ms: float = 0.0


@dataclass(frozen=True)
class Outcome:
    """What the caller must do after a run: ``verb``, the client to dispatch to, token, countdown (s)."""

    verb: Verb
    target: str = ""
    token: str = ""
    countdown: float = 0.0
    consumed: int = 0
    #: More ConsumeRequests to send, for other queues this execution ran or watched (a lingering
    #: request that switched queues, see ``IdleQueueWatch``).
    follow_ups: tuple[FollowUp, ...] = ()
    #: The queue ``verb`` is about when it is not the task's own (the run switched queues).
    queue: MessageQueue | None = None

    @property
    def needs_dispatch(self) -> bool:
        return self.verb in (Verb.REQUEUE, Verb.HANDOVER, Verb.DISPATCH)


def _never() -> bool:
    return False


def _always() -> bool:
    return True


def _ignore(_lingering: bool) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Slice:
    """The replies of a lingering read that rode on a commit (``XREAD``, then the queue's state)."""

    reply: Any
    state: list[Any]


class ConsumerEngine:
    """Per-process consumer state: Redis clients, stats, the DLQ writer, and the run loop."""

    def __init__(self, settings: Settings, client_id: str, brokers: BrokerRegistry | None = None) -> None:
        self.settings = settings
        self.client_id = client_id
        self.brokers = brokers or BrokerRegistry(settings.redis_url, settings.brokers)
        self.topics = TopicManager(self.brokers)
        self.stats = ConsumerStatsManager()
        self.stats_flushed_at = 0.0
        #: Whether a drained request may wait for more messages: set by the integration (the
        #: Celery threads pool can tell whether requests are waiting for a slot); never by default.
        self.may_linger: Callable[[], bool] = _never
        #: Whether a request that has not lingered yet may begin to (on top of ``may_linger``): the
        #: integration says no while this would leave no pool slot free for the next request.
        self.may_start_linger: Callable[[], bool] = _always
        #: Told ``True`` at every lingering read and ``False`` when a task execution that lingered
        #: ends (a prefork child notes it for its siblings' ``may_start_linger``).
        self.note_lingering: Callable[[bool], None] = _ignore
        appender = QueueAppender(
            self.brokers, pending_ttl_ms=settings.ms(settings.pending_ttl), timeout=settings.send_msg_timeout,
            topics=self.topics, action="DLQ write",
        )
        self.dlq = DeadLetterWriter(appender, self.topics, self.brokers.default_name, client_id)
        self._appender = appender
        self._retry_sender: RetrySender | None = None
        self._owned: dict[str, tuple[float, list[MessageQueue]]] = {}
        #: The newest entry of this client's nudge stream seen by a lingering read (per process).
        self.nudge_seen = "0-0"
        #: (sub, queue key) whose trimmed messages were logged already: a warning once per queue.
        self.skips_logged: set[tuple[str, str]] = set()

    @property
    def retry_sender(self) -> RetrySender:
        """Where concurrent listeners send failed messages back to (``%RETRY%<group>``), made on
        first use: orderly consumers never need it."""
        if self._retry_sender is None:
            s = self.settings
            delays = DelayStore(self.brokers, self._appender, timeout=s.send_msg_timeout)
            self._retry_sender = RetrySender(self.topics, delays, levels_ms=s.delay_levels_ms,
                                             queue_nums=s.retry_queue_nums)
        return self._retry_sender

    @property
    def nudges_idle(self) -> bool:
        """Whether a run that leaves its queue idle tells this client's lingering requests
        (``nudge.idle_entry``): when requests linger here and watch other queues."""
        s = self.settings
        return self.may_linger is not _never and s.consume_linger_ms > 0 and s.consume_linger_idle_queues

    def owned_queues(self, sub: str) -> list[MessageQueue]:
        """Queues of ``sub`` the rebalance assigned to this client (its read hint, at most a second
        old): what a lingering request may watch. The locks, not this list, decide who consumes."""
        now = time.monotonic()
        hit = self._owned.get(sub)
        if hit is not None and now - hit[0] < OWNED_CACHE_S:
            return hit[1]
        mqs = assigned_queues(self.brokers.meta, sub, self.client_id)
        self._owned[sub] = (now, mqs)
        return mqs

    def idle_watch(self, sub: str, mq: MessageQueue) -> IdleQueueWatch | None:
        """A watch over the other idle queues of ``sub`` on ``mq``'s broker, for a lingering request
        (None when lingering on other queues is off)."""
        s = self.settings
        if not s.consume_linger_idle_queues:
            return None
        broker = self.brokers.get(mq.broker_name)
        group = keys.group_of_sub(sub)

        def watchable() -> list[MessageQueue]:
            # Only queues this process has a listener for (the caller's topic's, or one registered
            # here): a switch runs the queue with its own topic's listener (``_listener_of``); a
            # group's topic whose listener lives elsewhere is left to its wake-ups.
            return [q for q in self.owned_queues(sub)
                    if q.topic == mq.topic or get_listener(group, q.topic) is not None]

        return IdleQueueWatch(self.client_id, sub, mq.broker_name, broker.scripts, broker.client,
                              watchable, s.ms(s.pending_ttl), s.ms(s.lock_max_live_time))

    @staticmethod
    def _listener_of(spec: ListenerSpec, mq: MessageQueue) -> ListenerSpec:
        """The listener of a queue a lingering run switched to. A subscription may span several
        topics (a group with listeners for two topics, or a concurrent group's retry topic), and
        each queue runs with its own topic's listener and kind of run (a bug once: the queue
        switched to ran with the lingering run's listener). The watch adopts only queues with a
        listener here (``idle_watch``)."""
        if mq.topic == spec.topic:
            return spec
        other = get_listener(spec.group, mq.topic)
        if other is None:  # pragma: no cover - unregistered since the watch adopted it
            raise RuntimeError(f"no listener of group {spec.group!r} for topic {mq.topic!r} in this process")
        return other

    def new_process_queue(self) -> ProcessQueue:
        s = self.settings
        # Re-check the lock before a listener call once the last confirmation is older than half
        # a heartbeat timeout (RocketMQ: 30 s): a holder resumed after a pause notices it was
        # replaced before it calls the listener again, not 30 s later.
        return ProcessQueue(s.ms(min(s.client_lock_expire, s.heartbeat_timeout / 2)))

    def run(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str) -> Outcome | None:
        """Run one ConsumeRequest; through a Redis outage, retry in process with backoff.

        Nothing past the last fenced commit was persisted, so re-running from the committed offset
        is safe. The same ``runner`` id lets this execution re-enter its own run mark after Redis
        comes back (a duplicate delivery of the task, with another runner id, cannot). The Celery
        broker is usually the same Redis, so a re-publish would fail too. Returns None when Redis
        stayed unreachable for ``REDIS_RETRY_BUDGET_S``: the sweep re-dispatches once it is back.

        A drained run that lingers watches the client's other idle queues too (``IdleQueueWatch``);
        when one gets messages first, the run ends and that queue runs next here, in the same task
        and pool slot. The outcome is then about the last queue run (``Outcome.queue``), and
        ``follow_ups`` lists the requests to send for the others.
        """
        # One connection for every round trip of this execution (its chain of switches stays on
        # one broker: an IdleQueueWatch watches one broker's queues).
        lease = ConnectionLease(self.brokers.get(mq.broker_name).client)
        try:
            return self._run_chain(spec, sub, mq, token, lease)
        finally:
            lease.release()
            self.note_lingering(False)

    def _run_chain(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str,
                   lease: ConnectionLease) -> Outcome | None:
        runner = new_token()
        watch: IdleQueueWatch | None = None
        follow_ups: list[FollowUp] = []
        consumed = 0
        prior: ConsumeRequest | None = None
        while True:
            req, outcome = self._run_one(spec, sub, mq, token, runner, watch, prior, lease)
            if outcome is None:
                return None  # Redis stayed down: adoptions lapse, the sweep re-dispatches
            consumed += outcome.consumed
            watch = req.watch
            if req.prior_follow_up is not None:
                # The queue the switch left needs a request (it was reassigned meanwhile): this
                # run did not linger, so the chain stops here and the caller sends it.
                follow_ups.append(req.prior_follow_up)
                break
            prior = None
            if outcome.verb is Verb.SWITCHED:
                # The switch the usual way: the next run ends this one (req.prior) and registers
                # the queue left with the watch.
                assert req.switch_to is not None and watch is not None
                prior = req
                mq, token = req.switch_to, watch.token
                spec = self._listener_of(spec, mq)
                continue
            if req.switch_to is None or watch is None or outcome.needs_dispatch:
                # No switch; or the queue just left got messages between the read and the end of
                # its run and needs a request now, which only the caller can send: stop chaining
                # (the queue switched to is released below and gets its own request).
                break
            # The lingering read found messages on an adopted idle queue: this run ended (its own
            # queue drained, and adopted by the watch when finish.lua could), that queue runs next
            # in this same task, with the adoption token.
            watch.switched(mq, req.switch_to, req.adopted_at if outcome.verb is Verb.ADOPTED else None)
            mq, token = req.switch_to, watch.token
            spec = self._listener_of(spec, mq)
        if watch is not None:
            try:
                follow_ups.extend(watch.release(lease))
            except (redis.RedisError, BrokerUnavailableError) as exc:
                log.warning("could not end the adoptions of %s (%s); they lapse within %d ms",
                            sub, exc, ADOPT_TTL_MS)
        if watch is None or (not follow_ups and consumed == outcome.consumed):
            return outcome
        return replace(outcome, consumed=consumed, follow_ups=tuple(follow_ups), queue=mq)

    def _run_one(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str, runner: str,
                 watch: IdleQueueWatch | None, prior: ConsumeRequest | None = None,
                 lease: ConnectionLease | None = None) -> tuple[ConsumeRequest, Outcome | None]:
        backoff = Backoff(first=0.25, cap=5.0)
        waited = 0.0
        cls = _request_class(spec)
        while True:
            req = cls(self, spec, sub, mq, token, runner=runner, watch=watch, prior=prior, lease=lease)
            try:
                return req, req.run()
            except (redis.RedisError, BrokerUnavailableError) as exc:
                if waited >= REDIS_RETRY_BUDGET_S:
                    log.error("ConsumeRequest %s %s: Redis unreachable for %.0fs (%s); the sweep will "
                              "re-dispatch when it is back", sub, mq.key, waited, exc)
                    return req, None
                delay = backoff.next()
                log.warning("ConsumeRequest %s %s: Redis error (%s); retrying in %.2fs", sub, mq.key, exc, delay)
                time.sleep(delay)
                waited += delay


def _request_class(spec: ListenerSpec) -> type[ConsumeRequest]:
    """``ConsumeRequest`` for RocketMQ's queue order (the default); ``KeyConsumeRequest`` for a
    listener with ``ordering="key"``, ``ConcurrentConsumeRequest`` for ``@concurrent_listener``
    (imported here: they are subclasses of this module's class)."""
    if spec.ordering == "concurrent":
        from mqorder.consumer.concurrent_request import ConcurrentConsumeRequest

        return ConcurrentConsumeRequest
    if spec.ordering == "key":
        from mqorder.consumer.key_request import KeyConsumeRequest

        return KeyConsumeRequest
    return ConsumeRequest


class ConsumeRequest:
    """One run over (subscription, queue), started with the dispatch ``token`` it was given."""

    def __init__(
        self, engine: ConsumerEngine, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str, runner: str = "",
        watch: IdleQueueWatch | None = None, prior: ConsumeRequest | None = None,
        lease: ConnectionLease | None = None,
    ) -> None:
        s = engine.settings
        self.engine = engine
        self.spec = spec
        self.sub = sub
        self.mq = mq
        self.token = token
        #: Unique per task execution (kept across in-process retries after a Redis outage).
        self.runner = runner or new_token()
        #: Unique per run (this object): hooks and listeners tell one run's calls from the next.
        self.run_id = new_token()
        self.client_id = engine.client_id
        broker = engine.brokers.get(mq.broker_name)
        self.redis = broker.client
        self.scripts = broker.scripts
        #: The connection of this run's round trips on the consume path: the task execution's
        #: (``ConsumerEngine.run``), or this run's own, released when ``run`` returns.
        self._own_lease = lease is None
        self.lease = lease if lease is not None else ConnectionLease(self.redis)
        tag = mq.tag
        self.k_state = keys.sub_state(tag, sub)
        self.k_log = keys.queue_log(tag)
        self.k_next = keys.queue_next(tag)
        self.k_retries = keys.sub_retries(tag, sub)
        self.batch_max = spec.consume_message_batch_max_size or s.consume_message_batch_max_size
        self.pull_n = spec.pull_batch_size or s.pull_batch_size
        self.max_reconsume = spec.max_reconsume_times if spec.max_reconsume_times is not None else s.max_reconsume_times
        self.suspend_ms = spec.suspend_current_queue_time_millis or s.suspend_current_queue_time_millis
        self.run_lease_ms = s.ms(s.run_lease)
        self.lock_ms = s.ms(s.lock_max_live_time)
        self.pending_ttl_ms = s.ms(s.pending_ttl)
        self.budget = s.max_time_consume_continuously
        self.linger_s = s.consume_linger_ms / 1000.0
        self.max_size = s.max_message_size
        self.hooks = [*global_hooks(), *spec.hooks]
        self.stats = engine.stats
        ledger_on = spec.ledger if spec.ledger is not None else s.ledger
        self.ledger = LedgerBuffer(spec.group, self.client_id, self.run_id, s.ledger_max_len) if ledger_on else None
        self.pq = engine.new_process_queue()
        #: The other idle queues this task execution watches while it lingers (made on first use).
        self.watch = watch
        #: Set when the lingering read found messages on one of them: the queue to run next.
        self.switch_to: MessageQueue | None = None
        #: The committed offset this queue was handed to the watch at (``Verb.ADOPTED``).
        self.adopted_at = 0
        #: The run this one switched from, whose ``finish.lua`` this run sends with its
        #: ``begin.lua`` (``Verb.SWITCHED``), and its stop.
        self.prior = prior
        self.deferred_end: LoopEnd | None = None
        #: This task execution lingers already (a chain of switches carries its watch): it goes
        #: on while ``may_linger``; a request that has not lingered yet asks ``may_start_linger`` too.
        self.lingering = watch is not None
        #: The request the prior run's queue needs when its finish did not hand it to the watch.
        self.prior_follow_up: FollowUp | None = None
        self.epoch = 0
        self.committed = 0  # offset persisted in Redis
        self.commit_point = 0  # offset the ProcessQueue says may be persisted
        self.pulled_to = 0  # one past the highest offset pulled
        self.retry_updates: dict[int, int] = {}
        self.retries: dict[int, int] | None = None
        #: Ranges retention trimmed before this run read them: (end, count), reported to Redis
        #: (``skipped``) with the first commit at or past ``end``; ``_skip_floor``: where a run that
        #: found everything up to the queue's end trimmed commits to once nothing else is held.
        self._skips: list[tuple[int, int]] = []
        self._skip_floor = 0
        # Counters of this run, handed to the stats manager once at the end (not per message).
        self.consumed = 0
        self._failed = 0
        self._rt_sum = 0.0
        self._rt_n = 0

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            return self._run()
        finally:
            if self._own_lease:
                self.lease.release()

    def _run(self) -> Outcome:
        begun = self._check()
        if begun is not None:
            return begun
        end = self._consume_loop()
        if end.stop is Stop.FENCED or end.stop is Stop.IDLE:
            self.pq.clear()
            self._flush_ledger()
            self._flush_stats()
            return Outcome(Verb.FENCED if end.stop is Stop.FENCED else Verb.IDLE, consumed=self.consumed)
        if end.stop is Stop.SWITCH and not self._needs_last_commit():
            # Its finish.lua rides on the next run's begin.lua (one round trip for the switch).
            self.deferred_end = end
            return Outcome(Verb.SWITCHED, consumed=self.consumed)
        return self._finish(end)

    # -- check -----------------------------------------------------------------------------------

    def _check(self) -> Outcome | None:
        """``begin.lua``: claim the run, verify/take the lock, first pull. None means "go on".

        After a switch, the finish of the run left (``prior``) goes in the same round trip: the
        two scripts touch two different queues, and neither depends on the other's reply."""
        begin = ("begin", [self.k_state, self.k_log, self.k_next, self.k_retries],
                 [self.client_id, self.token, self.run_lease_ms, self.lock_ms, self.pull_n, self.runner])
        prior = self.prior
        if prior is None:
            res = self.scripts.call(*begin, via=self.lease)
        else:
            assert prior.deferred_end is not None
            done, res = self.scripts.run_many([("finish", *prior._finish_call(prior.deferred_end)), begin],
                                              self.lease)
            self._after_prior(prior, prior._ended(done, prior.deferred_end))
            # Ended: let it go (a chain of switches must not keep every run it ever made alive).
            self.prior = None
        verb = text(res[0])
        if verb in ("STALE", "BUSY"):
            return Outcome(Verb(verb))
        if verb in ("NOT_LOCKED", "REVOKED"):
            # tryLockLaterAndReconsume / removeUnnecessaryMessageQueue: finish.lua knows where the
            # queue should be consumed now and hands it there.
            return self._finish(LoopEnd(Stop.DONE))
        self.epoch = int(res[1])
        self.committed = self.commit_point = int(res[2])
        self.pulled_to = self.committed
        self.pq.mark_locked()
        self._begun(res)
        return None

    def _begun(self, res: list[Any]) -> None:
        """Take ``begin.lua``'s first pull (a key-ordered run also reads its offset map there)."""
        self._put(res[4], res[5])
        if not res[4]:
            self._check_trimmed_tail(int(res[3]))

    def _put(self, entries: list[Any], raw_retries: list[Any] | None) -> None:
        # Reconsume counts exist only for the head of the queue, written by an earlier run that
        # suspended; begin.lua reads them all once, and this run's own suspends end the run.
        if raw_retries:
            self.retries = {int(raw_retries[i]): int(raw_retries[i + 1]) for i in range(0, len(raw_retries), 2)}
        msgs = decode_entries(self.mq, entries, self.retries, self.max_size)
        if msgs:
            if msgs[0].queue_offset > self.pulled_to:
                # Offsets are contiguous and only retention removes entries: the read started
                # below the queue's first stored offset.
                self._note_trimmed(self.pulled_to, msgs[0].queue_offset)
            self.pulled_to = msgs[-1].queue_offset + 1
            self.pq.put_messages(msgs)

    def _check_trimmed_tail(self, nxt: int) -> None:
        """A read from ``pulled_to`` found nothing although the queue's next offset is past it:
        everything in between was trimmed (an append stores its entry and bumps ``next`` in one
        step, so ``next`` never runs ahead of the log). Move on to ``nxt``."""
        if nxt <= self.pulled_to:
            return
        start = self.pulled_to
        self._note_trimmed(start, nxt)
        self.pulled_to = nxt
        self._skip_floor = nxt
        self._apply_skip_floor()

    def _apply_skip_floor(self) -> None:
        pq = self.pq
        if self._skip_floor > self.commit_point and not pq.consuming and not pq.msg_tree:
            self.commit_point = self._skip_floor

    def _note_trimmed(self, start: int, end: int, n: int | None = None) -> None:
        """Retention took ``[start, end)`` before this group read it (``time`` policy, or a group
        gone for longer than ``retention_ms``): the run moves past it in order, the fenced commit
        that does so counts it (``skipped`` in the queue's state), and it is logged once per queue
        per process. ``n``: how many of them the group had not consumed (default: all; a
        key-ordered run knows some finished under a previous owner)."""
        if n is None:
            n = end - start
        if n <= 0:
            return
        self._skips.append((end, n))
        seen = self.engine.skips_logged
        key = (self.sub, self.mq.key)
        level = logging.DEBUG if key in seen else logging.WARNING
        seen.add(key)
        log.log(level, "retention trimmed %d messages of %s (offsets %d..%d) before %s consumed them; moving on "
                "at offset %d, in order (counted as skipped in `mqorder status`)", n, self.mq.key, start, end - 1,
                self.sub, end)

    # -- the loop: take, consume, settle ----------------------------------------------------------

    def _consume_loop(self) -> LoopEnd:
        pq = self.pq
        deadline = time.monotonic() + self.budget
        threshold = self.engine.settings.pull_threshold_for_queue
        while True:
            if pq.dropped:
                return LoopEnd(Stop.DONE)
            if time.monotonic() > deadline:
                return LoopEnd(Stop.REQUEUE, BUDGET_REQUEUE_S)  # MAX_TIME_CONSUME_CONTINUOUSLY
            if pq.is_lock_expired() and not self._touch():
                return LoopEnd(Stop.FENCED)
            msgs = pq.take_messages(self.batch_max)
            if not msgs:
                linger = self.linger_s > 0 and not pq.consuming and self._may_linger()
                until = min(deadline, time.monotonic() + self.linger_s) if linger else None
                # Lingering, the commit carries the first lingering read in its round trip.
                pulled = self._persist(pull=not pq.is_full(threshold), idle_if_drained=not linger,
                                       linger_until=until)
                if pulled.lost:
                    return LoopEnd(Stop.FENCED)
                if pulled.ended:
                    return LoopEnd(Stop.IDLE)
                if until is not None and pulled.wait and not pq.dropped:
                    pulled = self._linger(until)
                    if pulled.lost:
                        return LoopEnd(Stop.FENCED)
                if pulled.switch:
                    return LoopEnd(Stop.SWITCH)
                if not pulled.count:
                    return LoopEnd(Stop.DONE)
                continue
            msgs = self._split_poison(msgs)
            if not msgs:
                continue
            ctx = self._context()
            handled = self._consume(msgs, ctx)
            end = self._settle(msgs, handled, ctx)
            if end is not None:
                return end

    def _may_linger(self) -> bool:
        """Whether this drained run may linger now (and, if so, it lingers from now on)."""
        eng = self.engine
        ok = eng.may_linger() and (self.lingering or eng.may_start_linger())
        self.lingering = self.lingering or ok
        return ok

    def _linger(self, until: float) -> Pull:
        """Wait on this queue's stream for new messages while the worker has idle capacity.

        A drained queue that gets a message a few milliseconds later would otherwise cost a
        wake-up and a whole Celery task; waiting here (``consume_linger_ms``, like a RocketMQ
        long-polling pull held at the broker) keeps a steady trickle on one running request, with
        its pending token still held so producers do not wake anyone. It stops as soon as the
        worker has requests waiting for a slot, and as soon as a rebalance assigned the queue to
        another client, so a lingering request never delays another queue or a handover by more
        than one slice.

        Each slice is one round trip (``_queue_slice``, ``_slice_result``); the first one usually
        rode on the commit before it (``_persist(linger_until=...)``). Returns what a slice read
        (``NOTHING`` ends the run normally), or ``LOST`` when the run lost the queue (fenced).
        """
        while True:
            pipe = RawPipeline(self.lease)
            if not self._queue_slice(pipe, until):
                return NOTHING
            reply, state = pipe.execute()
            pulled = self._slice_result(reply, state)
            if not pulled.wait:
                return pulled

    def _queue_slice(self, pipe: Any, until: float) -> bool:
        """Queue one lingering read on ``pipe``: a blocking ``XREAD`` over this queue, this client's
        nudge stream and the idle queues its watch adopted, then this queue's state. False, with
        nothing queued, when the linger is over: ``until`` passed or a request waits for a slot.

        Messages read here did not come through a fenced commit, so the queue's state is read in
        the same round trip, *after* the blocking ``XREAD`` (Redis runs a connection's commands in
        order): ``_slice_result`` uses the batch only if this run still held the lock at the epoch
        it began with (and its pending token) when it was read, what a commit checks right before
        its pipelined pull.
        """
        left = until - time.monotonic()
        if left <= 0 or not self.engine.may_linger():
            return False
        self.engine.note_lingering(True)
        if self.watch is None:
            self.watch = self.engine.idle_watch(self.sub, self.mq)
        last_id = f"{self.pulled_to - 1}-1" if self.pulled_to > 0 else "0-0"
        names, ids = [self.k_log, keys.linger_nudge(self.client_id)], [last_id, self.engine.nudge_seen]
        if self.watch is not None:
            self.watch.refresh(self.mq, self.lease)  # its own round trip, at most every ADOPT_REFRESH_S
            more, more_ids = self.watch.streams(self.mq)
            names += more
            ids += more_ids
        block_ms = max(1, int(min(left, LINGER_SLICE_S) * 1000))
        pipe.execute_command("XREAD", "COUNT", self.pull_n, "BLOCK", block_ms, "STREAMS", *names, *ids)
        pipe.execute_command("HMGET", self.k_state, "owner", "epoch", "pending", "assignee")
        return True

    def _slice_result(self, reply: Any, state: list[Any]) -> Pull:
        """What one lingering read (``_queue_slice``) brought: messages of this queue, a switch to
        an adopted queue that got some, ``WAIT`` (nothing yet), ``NOTHING`` (reassigned: ending
        the run now hands the queue over, finish.lua) or ``LOST``."""
        owner, cur_epoch, pending, assignee = state
        me = self.client_id
        if text(owner or b"") != me or int(cur_epoch or 0) != self.epoch or text(pending or b"") != self.token:
            log.warning("lingering request on %s for %s lost the queue (owner %r, epoch %s); stopping",
                        self.mq.key, self.sub, text(owner or b""), text(cur_epoch or b"0"))
            self.pq.dropped = True
            self.pq.clear()
            return LOST
        self.pq.mark_locked()
        if assignee and text(assignee) != me:
            return NOTHING
        if not reply:
            return WAIT
        # RESP2 gives [[stream, entries], ...]; RESP3 gives {stream: entries}.
        by_stream = dict(reply.items()) if isinstance(reply, dict) else {k: v for k, v in reply}
        nudges = by_stream.pop(keys.linger_nudge(me).encode(), None)
        if nudges:
            # A request waits for a slot (or an old nudge, seen once): may_linger() decides. Or a
            # queue of this client went idle: watch it from the next read on.
            self.engine.nudge_seen = text(nudges[-1][0])
            went_idle = idle_queues(nudges)
            if went_idle and self.watch is not None:
                self.watch.adopt_soon(went_idle)
        entries = by_stream.pop(self.k_log.encode(), None)
        if entries:
            self._put(entries, None)
            return Pull(len(entries))
        watch = self.watch
        for key in by_stream:
            other = watch.queue_of(text(key)) if watch is not None else None
            if other is not None:
                # Its entries are only a signal: begin.lua reads them again under the lock.
                self.switch_to = other
                return SWITCH
        return WAIT

    def _split_poison(self, msgs: list[MessageExt]) -> list[MessageExt]:
        """Send an undecodable head message to the DLQ; never hand one to the listener."""
        for i, m in enumerate(msgs):
            if m.decode_error is None:
                continue
            if i == 0:
                self.engine.dlq.send(self.spec.group, m, m.decode_error, self.epoch)
                if self.ledger is not None:
                    now_ms = time.time() * 1000
                    self.ledger.note([m], LedgerOutcome.DLQ, now_ms, now_ms, self.epoch)
                self.pq.make_message_to_consume_again(msgs[1:])
                self._commit_in_memory()
                return []
            self.pq.make_message_to_consume_again(msgs[i:])
            return msgs[:i]
        return msgs

    def _context(self) -> ConsumeOrderlyContext:
        return ConsumeOrderlyContext(
            self.mq,
            epoch=self.epoch,
            client_id=self.client_id,
            group=self.spec.group,
            still_owner=self._still_owner,
            suspend_current_queue_time_millis=self.suspend_ms,
            run_id=self.run_id,
        )

    def _consume(self, msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> Handled:
        """Hooks before, the listener, hooks after; anything but a status counts as a suspend."""
        hook_ctx = None
        if self.hooks:
            hook_ctx = ConsumeMessageContext(self.spec.group, self.mq, msgs, self.epoch, self.client_id, self.run_id)
            run_before(self.hooks, hook_ctx)
        wall0 = time.time() if self.ledger is not None else 0.0
        t0 = time.perf_counter()
        try:
            status = self.spec.func(msgs, ctx)
        except Exception:
            log.exception("listener %s raised on %s offsets %d..%d; suspending the queue",
                          self.spec.name, self.mq.key, msgs[0].queue_offset, msgs[-1].queue_offset)
            status = SUSPEND
        rt = (time.perf_counter() - t0) * 1000
        if status is None:
            log.warning("listener %s returned None for %s; treating it as SUSPEND", self.spec.name, self.mq.key)
            status = SUSPEND
        elif not isinstance(status, ConsumeOrderlyStatus):
            log.warning("listener %s returned %r, not a ConsumeOrderlyStatus; treating it as SUSPEND",
                        self.spec.name, status)
            status = SUSPEND
        self._note_rt(rt)
        if hook_ctx is not None:
            hook_ctx.status = status.value
            hook_ctx.success = status in (SUCCESS, COMMIT)
            hook_ctx.rt_ms = rt
            run_after(self.hooks, hook_ctx)
        if self.ledger is None:
            return Handled(status)
        return Handled(status, wall0 * 1000, wall0 * 1000 + rt)

    def _note_rt(self, rt: float) -> None:
        self._rt_sum += rt
        self._rt_n += 1

    def _settle(self, msgs: list[MessageExt], handled: Handled, ctx: ConsumeOrderlyContext) -> LoopEnd | None:
        """``processConsumeResult``: commit, suspend (with DLQ after max reconsume), rollback.
        None means "go on consuming"."""
        n = len(msgs)
        status = handled.status
        succeeded = status is SUCCESS or status is COMMIT or (ctx.auto_commit and status is ROLLBACK)
        if self.ledger is not None and succeeded:
            self.ledger.note(msgs, LedgerOutcome.SUCCESS, handled.start_ms, handled.end_ms, self.epoch)
        if ctx.auto_commit:
            if status in (SUCCESS, COMMIT, ROLLBACK):
                if status is not SUCCESS:
                    log.warning("%s returned %s with auto_commit on; treated as SUCCESS", self.spec.name, status.value)
                self.consumed += n
                self._commit_in_memory()
                return None
            self._failed += n
            return self._suspend(msgs, handled, ctx.suspend_current_queue_time_millis)
        if status is SUCCESS:
            self.consumed += n
            return None
        if status is COMMIT:
            self.consumed += n
            self._commit_in_memory()
            return None
        self._failed += n
        if status is ROLLBACK:
            if self.ledger is not None:
                self.ledger.note(msgs, LedgerOutcome.SUSPEND, handled.start_ms, handled.end_ms, self.epoch)
            self.pq.rollback()
            return self._stop_for_retry(ctx.suspend_current_queue_time_millis)
        return self._suspend(msgs, handled, ctx.suspend_current_queue_time_millis)

    def _suspend(self, msgs: list[MessageExt], handled: Handled, suspend_ms: int) -> LoopEnd | None:
        """``checkReconsumeTimes``: messages past ``max_reconsume_times`` go to the DLQ (a prefix
        only, so nothing overtakes); the rest are made to consume again after ``suspend_ms``."""
        limit = self.max_reconsume
        dead = 0
        if limit != -1:
            while dead < len(msgs) and msgs[dead].reconsume_times >= limit:
                dead += 1
        if dead:
            if not self._touch():
                return LoopEnd(Stop.FENCED)
            for m in msgs[:dead]:
                self.engine.dlq.send(
                    self.spec.group, m, f"max reconsume times {limit} reached (listener kept suspending)", self.epoch
                )
        rest = msgs[dead:]
        if self.ledger is not None:
            self.ledger.note(msgs[:dead], LedgerOutcome.DLQ, handled.start_ms, handled.end_ms, self.epoch)
            self.ledger.note(rest, LedgerOutcome.SUSPEND, handled.start_ms, handled.end_ms, self.epoch)
        if not rest:
            self._commit_in_memory()
            return None
        self.pq.make_message_to_consume_again(rest)
        if dead:
            self._commit_in_memory()
        for m in rest:
            m.reconsume_times += 1
            self.retry_updates[m.queue_offset] = m.reconsume_times
        return self._stop_for_retry(suspend_ms)

    def _stop_for_retry(self, suspend_ms: int) -> LoopEnd:
        if self._persist(pull=False).lost:
            return LoopEnd(Stop.FENCED)
        return LoopEnd(Stop.REQUEUE, suspend_ms / 1000.0)

    # -- Redis calls -----------------------------------------------------------------------------

    def _commit_in_memory(self) -> None:
        offset = self.pq.commit()
        if offset > self.commit_point:
            self.commit_point = offset
        if self._skip_floor:
            self._apply_skip_floor()

    def _persist(self, pull: bool, idle_if_drained: bool = False, linger_until: float | None = None) -> Pull:
        """Run ``commit.lua`` (with the next read pipelined behind it when ``pull``): what it read,
        ``ENDED`` if it ended the run on a drained queue (``idle_if_drained``), or ``LOST`` when
        the commit was refused.

        ``linger_until``: the run means to linger if nothing is left, so the read behind the commit
        is the first lingering read (``_queue_slice``), which returns at once when this queue has
        more: a message arriving on a drained queue then costs one round trip (this one), not an
        empty ``XRANGE`` and then a blocking read. Its result is ``_slice_result``'s (``WAIT``: go
        on lingering); a refused commit discards it."""
        idle = idle_if_drained and pull and not self.retry_updates and not self.pq.consuming
        # A run ending here leaves its queue idle: a lingering request of this client may watch it.
        then = idle_entry(self.client_id, [self.mq.key]) if idle and self.engine.nudges_idle else None
        skipped = self._skips_due(self.commit_point)
        args: list[Any] = [
            self.client_id, self.epoch, self.token, self.commit_point, self.run_lease_ms,
            self.lock_ms, "1" if idle else "0", skipped,
        ]
        for off, n in self.retry_updates.items():
            args.append(off)
            args.append(n)
        keys_ = [self.k_state, self.k_next, self.k_retries]
        if pull or (self.ledger is not None and self.ledger.records):
            # One round trip: the fenced commit, then a plain read of the next batch (and the
            # ledger records of the batch just handled, when the ledger is on).
            res, entries = self._commit_pipelined(keys_, args, pull, linger_until=linger_until, then=then)
        else:
            res, entries = self.scripts.commit(keys=keys_, args=args), []
        verb = text(res[0])
        if skipped and verb in ("OK", "IDLE"):
            self._skips_counted(self.commit_point, skipped)
        if verb == "IDLE":
            self.committed = self.commit_point
            return ENDED
        if verb != "OK":
            self._on_refused(verb, res)
            return LOST
        self.retry_updates.clear()
        self.committed = self.commit_point
        return self._took(res, entries, pull)

    def _took(self, res: list[Any], entries: Any, pull: bool) -> Pull:
        """After an accepted commit (``commit.lua`` or ``key_commit.lua``, same reply head): the
        lock is confirmed; a revoked queue stops here; otherwise what the read behind the commit
        brought goes in (a lingering read's ``Slice``, or ``XRANGE`` entries, an empty one past a
        trimmed tail)."""
        self.pq.mark_locked()
        if text(res[2]):
            self.pq.dropped = True  # revoked: the rebalance gave the queue to someone else
            return NOTHING
        if isinstance(entries, Slice):
            return self._slice_pulled(entries, int(res[1]))
        self._put(entries, None)
        if pull and not entries:
            self._check_trimmed_tail(int(res[1]))
        return Pull(len(entries))

    def _skips_due(self, offset: int) -> int:
        """Trimmed messages a commit of ``offset`` moves past (``_note_trimmed``): what it reports
        to the commit script (``skipped``), which counts them only if the commit passes its fence."""
        if not self._skips:
            return 0
        return sum(n for end, n in self._skips if end <= offset)

    def _skips_counted(self, offset: int, n: int) -> None:
        """The fenced commit of ``offset`` counted ``n`` skipped messages in the queue's state: the
        stats count them too, here, where the commit did (once, by the run that moved past them),
        and they are not reported again."""
        self.stats.inc_consume_skipped(self.sub, self.mq.key, n)
        self._skips = [(end, k) for end, k in self._skips if end > offset]

    def _slice_pulled(self, read: Slice, nxt: int) -> Pull:
        """What the lingering read behind a commit brought (``_slice_result``). If it brought
        nothing of this queue although the commit saw its next offset (``nxt``) past what the run
        pulled, retention trimmed those messages (as for an empty ``XRANGE``)."""
        pulled = self._slice_result(read.reply, read.state)
        if not pulled.count and not pulled.lost:
            self._check_trimmed_tail(nxt)
        return pulled

    def _commit_pipelined(self, keys_: list[str], args: list[Any], pull: bool, script: str = "commit",
                          start: int | None = None, linger_until: float | None = None,
                          then: tuple[Any, ...] | None = None) -> tuple[Any, Any]:
        """``commit.lua`` (or ``script``: a key-ordered run's ``key_commit.lua``), the ledger records,
        then ``XRANGE`` of the next batch from ``start`` (default: past what this run pulled) when
        ``pull``, pipelined: one round trip per batch. With ``linger_until`` the read is the first
        lingering read instead (``_queue_slice``), returned as a ``Slice``, unless the linger is
        over already. ``then``: one more command at the end (the idle nudge of a run that may end
        here; if the commit did not end it, the nudge's reader finds the queue busy and leaves it).

        If Redis lost its scripts (a restart), nothing of the commit and read changed any state
        (the commit was refused with NOSCRIPT, the reads only read), so they are sent once more
        after loading the script; the ledger records went through already (``EVAL`` cannot hit
        NOSCRIPT) and are not sent twice.
        """
        if start is None:
            start = max(self.commit_point, self.pulled_to)
        for attempt in (0, 1):
            pipe = RawPipeline(self.lease)
            self.scripts.queue_in(pipe, script, keys_, args)
            if self.ledger is not None:
                # Before the read: a lingering read may block, the records must not wait for it.
                self.ledger.queue_in(pipe)
            n = len(pipe)
            sliced = pull and linger_until is not None and self._queue_slice(pipe, linger_until)
            if pull and not sliced:
                pipe.execute_command("XRANGE", self.k_log, start, "+", "COUNT", self.pull_n)
            if then is not None:
                pipe.execute_command(*then)
            try:
                replies = pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                self.scripts.load(script)
                continue
            if sliced:
                return replies[0], Slice(replies[n], replies[n + 1])
            return replies[0], replies[n] if pull else []
        raise AssertionError("unreachable")  # pragma: no cover

    def _flush_ledger(self) -> None:
        """Records of a run that stopped without a last commit (fenced, or ended by the commit)."""
        if self.ledger is None or not self.ledger.records:
            return
        try:
            self.ledger.flush(self.redis)
        except Exception:
            log.warning("ledger records of %s for %s could not be written", self.mq.key, self.sub, exc_info=True)

    def _on_refused(self, verb: str, res: list[Any]) -> None:
        self.pq.dropped = True
        self.pq.clear()
        if self.hooks:
            fenced = verb == "FENCED"
            run_refused(self.hooks, RefusedContext(
                self.spec.group, self.sub, self.mq, self.client_id, self.run_id, self.epoch, verb,
                int(res[1]) if fenced else self.epoch, text(res[2]) if fenced else self.client_id,
                self.commit_point, time.time(),
            ))
        if verb == "FENCED":
            log.warning(
                "commit refused on %s for %s: epoch %d is stale (now epoch %s held by %r); "
                "stopping this ConsumeRequest, the new owner redelivers from the last commit",
                self.mq.key, self.sub, self.epoch, text(res[1]), text(res[2]),
            )
        else:
            log.warning("commit refused on %s for %s: %s", self.mq.key, self.sub, verb)

    def _touch(self) -> bool:
        res = self.scripts.touch(
            keys=[self.k_state], args=[self.client_id, self.epoch, self.token, self.run_lease_ms, self.lock_ms]
        )
        if int(res[0]):
            self.pq.mark_locked()
            return True
        self._on_refused("FENCED", res)
        return False

    def _still_owner(self) -> bool:
        res = self.scripts.touch(keys=[self.k_state], args=[self.client_id, self.epoch, self.token, 0, 0])
        return bool(int(res[0]))

    def _after_prior(self, prior: ConsumeRequest, done: Outcome) -> None:
        """The run this one switched from has ended (``done``): its queue is the watch's now, or
        (reassigned meanwhile) it needs a request, which must not wait for this run to linger."""
        assert self.watch is not None
        self.watch.switched(prior.mq, self.mq, prior.adopted_at if done.verb is Verb.ADOPTED else None)
        if done.needs_dispatch:
            self.prior_follow_up = FollowUp(prior.mq, done.target, done.token, done.countdown)
            self.linger_s = 0.0

    def _needs_last_commit(self) -> bool:
        """Whether progress is left to commit before ``finish.lua`` may end the run."""
        return bool(self.epoch) and self.commit_point > self.committed

    def _finish(self, end: LoopEnd) -> Outcome:
        """``finish.lua``: end the run and learn who consumes this queue next."""
        if self._needs_last_commit() and self._persist(pull=False).lost:
            return Outcome(Verb.FENCED, consumed=self.consumed)
        return self._ended(self.scripts.call("finish", *self._finish_call(end), via=self.lease), end)

    def _finish_call(self, end: LoopEnd) -> tuple[list[str], list[Any]]:
        """Keys and arguments of this run's ``finish.lua`` (a switch hands the queue to the watch)."""
        args: list[Any] = [self.client_id, self.token, end.stop.value, new_token(),
                           self.pending_ttl_ms + int(end.countdown * 1000), self.lock_ms]
        if end.stop is Stop.SWITCH:
            assert self.watch is not None
            args += [self.watch.token, ADOPT_TTL_MS]
        return [self.k_state, self.k_next], args

    def _ended(self, res: list[Any], end: LoopEnd) -> Outcome:
        """The run's end after ``finish.lua`` replied ``res``."""
        self.pq.clear()
        self._flush_ledger()
        self._flush_stats()
        verb = Verb(text(res[0]))
        if verb is Verb.IDLE and self.engine.nudges_idle:
            RawPipeline(self.lease).execute_command(*idle_entry(self.client_id, [self.mq.key])).execute()
        if verb is Verb.ADOPTED:
            self.adopted_at = int(res[1])
            return Outcome(verb, consumed=self.consumed)
        if verb is Verb.IDLE or verb is Verb.STALE:
            return Outcome(verb, consumed=self.consumed)
        target = text(res[1])
        countdown = end.countdown if target == self.client_id else 0.0
        return Outcome(verb, target, text(res[2]), countdown, self.consumed)

    def _flush_stats(self) -> None:
        """Hand this run's counters to the stats manager (once per run), which pushes them to
        Redis at most once a second per process."""
        key = self.mq.key
        if self.consumed:
            self.stats.inc_consume_ok(self.sub, key, self.consumed)
        if self._failed:
            self.stats.inc_consume_failed(self.sub, key, self._failed)
        if self._rt_n:
            self.stats.inc_consume_rt_total(self.sub, key, self._rt_sum, self._rt_n)
        # At most once a second per process: a short run must not pay a round trip for counters.
        now = time.monotonic()
        if now - self.engine.stats_flushed_at < STATS_FLUSH_INTERVAL_S:
            return
        self.engine.stats_flushed_at = now
        try:
            self.stats.flush(self.engine.brokers.meta)
        except Exception:
            log.debug("stats flush failed", exc_info=True)

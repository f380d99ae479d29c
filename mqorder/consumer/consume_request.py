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
import queue
import threading
import time
from typing import Any

import redis

from mqorder import keys
from mqorder.codec import decode_entries
from mqorder.consumer import native
from mqorder.consumer.async_loop import ProcessLoop
from mqorder.consumer.commit_pipeline import commit_pipelined
from mqorder.consumer.consumer_state import ConsumerState
from mqorder.consumer.context import CallContext, ConsumeOrderlyContext, suspend_ms_of
from mqorder.consumer.escapes import goes_on_up
from mqorder.consumer.hooks import RefusedContext, global_hooks, run_refused
from mqorder.consumer.idle_watch import ADOPT_TTL_MS, FollowUp, IdleQueueWatch, backlog_in
from mqorder.consumer.lease_keeper import keeper
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome
from mqorder.consumer.linger import LingeringReads
from mqorder.consumer.listener import DEFAULT_CANCEL_GRACE_MS, ListenerSpec
from mqorder.consumer.listener_call import ORDERLY, call_listener, call_listener_async
from mqorder.consumer.nudge import idle_entry
from mqorder.consumer.run_types import (
    BUDGET_REQUEUE_S,
    COMMIT,
    ENDED,
    LOST,
    NOTHING,
    REPLICA_WAIT_REQUEUE_S,
    ROLLBACK,
    SUCCESS,
    SUSPEND,
    SWITCH_END,
    Handled,
    LoopEnd,
    Outcome,
    Pull,
    PullKind,
    Slice,
    Stop,
    Verb,
)
from mqorder.consumer.trimmed import TrimmedRanges, log_trimmed
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline
from mqorder.store.replies import text
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: Queue mode with an async listener: how often the dispatcher looks at its lease while it waits.
AWAIT_POLL_S = 0.2
#: While async calls run and nothing else made a fenced commit for this long, the run commits what
#: it has (a no-op on the offset) to learn whether it still holds the queue: a revoked or fenced
#: run then cancels its calls after their grace instead of waiting for them to end.
HELD_CHECK_S = 1.0
#: How often a run past ``consume_yield_after_ms`` asks whether another request waits for its slot.
YIELD_CHECK_S = 0.05
#: How long it must have seen one waiting, check after check, before it yields.
YIELD_PATIENCE_S = 0.25


def exhausted_reason(limit: int, failure: str) -> str:
    """A dead letter's reason once ``max_reconsume_times`` ran out: what the last call raised, if
    it raised (``CallContext.failure``), so the DLQ says why and not only that it kept failing."""
    if failure:
        return f"max reconsume times {limit} reached (the last call raised {failure})"
    return f"max reconsume times {limit} reached (listener kept suspending)"


def run_constants(engine: ConsumerState, spec: ListenerSpec) -> dict[str, Any]:
    """What every run of ``spec``'s listener reads from it and from the engine's settings, as the
    run's attributes: worked out once per listener and engine (``ConsumerState.run_constants``).

    Why: at a trickle nearly every message is a run of its own (a lingering run switches to the
    queue it landed on), so a run's construction is paid per message, and these lookups (a
    pydantic model's attributes take the slow path) and divisions were redone for each. A
    ``ListenerSpec`` is read when its first run starts (it is registered once, by the decorator,
    and not changed after)."""
    cache = engine.run_constants
    hit = cache.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    s = engine.settings
    grace = spec.cancel_grace_ms if spec.cancel_grace_ms is not None else DEFAULT_CANCEL_GRACE_MS
    out: dict[str, Any] = {
        "batch_max": spec.consume_message_batch_max_size or s.consume_message_batch_max_size,
        "pull_n": spec.pull_batch_size or s.pull_batch_size,
        "max_reconsume": spec.max_reconsume_times if spec.max_reconsume_times is not None else s.max_reconsume_times,
        "suspend_ms": spec.suspend_current_queue_time_millis or s.suspend_current_queue_time_ms,
        "run_lease_ms": s.run_lease_ms,
        "lock_ms": s.lock_max_live_time_ms,
        "pending_ttl_ms": s.pending_ttl_ms,
        "budget": s.max_time_consume_continuously_ms / 1000,
        "yield_s": s.consume_yield_after_ms / 1000,
        "linger_s": s.consume_linger_ms / 1000.0,
        "max_size": s.max_message_size,
        "pull_threshold": s.pull_threshold_for_queue,
        #: How long calls of an async listener may go on after the run lost its queue.
        "cancel_grace_s": grace / 1000.0,
    }
    # Keyed by identity, the spec kept beside its constants (an id is reused only once it is gone).
    cache[id(spec)] = (spec, out)
    return out


class ConsumeRequest(LingeringReads):
    """One run over (subscription, queue), started with the dispatch ``token`` it was given."""

    # Set from ``run_constants`` (the same for every run of a listener): the consume batch, the
    # pull batch, the reconsume limit, the suspend, the leases, the time budgets (s), the linger
    # (s; 0 for a run that must not linger), the largest message, the pulled messages a run holds
    # at most, the async calls' cancel grace.
    batch_max: int
    pull_n: int
    max_reconsume: int
    suspend_ms: int
    run_lease_ms: int
    lock_ms: int
    pending_ttl_ms: int
    budget: float
    yield_s: float
    linger_s: float
    max_size: int
    pull_threshold: int
    cancel_grace_s: float

    def __init__(
        self, engine: ConsumerState, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str, runner: str = "",
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
        self.broker = broker
        self.redis = broker.client
        self.scripts = broker.scripts
        #: The connection of this run's round trips on the consume path: the task execution's
        #: (``ConsumerEngine.run``), or this run's own, released when ``run`` returns.
        self._own_lease = lease is None
        #: The thread that runs this request (``run``): only it may use ``lease``.
        self._thread = threading.get_ident()
        self.lease = lease if lease is not None else ConnectionLease(self.redis)
        tag = mq.tag
        self.k_state = keys.sub_state(tag, sub)
        # On a Redis Cluster the queue's slot stays on the node the run reads it from: after a
        # failover, its commit must not reach a promoted replica that lacks what it read.
        self.lease.pin(self.k_state)
        self.k_log = keys.queue_log(tag)
        self.k_next = keys.queue_next(tag)
        self.k_retries = keys.sub_retries(tag, sub)
        # batch_max, pull_n, max_reconsume, suspend_ms, the lease and time settings, cancel_grace_s:
        # the same for every run of this listener (``run_constants``).
        self.__dict__.update(run_constants(engine, spec))
        #: When the run next asks whether another request waits for its slot (``_yield_due``),
        #: and since when it has seen one waiting at every check (0: none seen).
        self._yield_at = float("inf")
        self._waiting_since = 0.0
        self.hooks = [*global_hooks(), *spec.hooks]
        self.stats = engine.stats
        ledger_on = spec.ledger if spec.ledger is not None else s.ledger
        self.ledger = LedgerBuffer(spec.group, self.client_id, self.run_id, s.ledger_max_len) if ledger_on else None
        self.pq = engine.new_process_queue()
        #: The other idle queues this task execution watches while it lingers (made on first use).
        self.watch = watch
        #: Set when the lingering read found messages on one of them: the queue to run next, and
        #: its subscription (the watch covers every group of the process).
        self.switch_to: MessageQueue | None = None
        self.switch_sub = sub
        #: The committed offset this queue was handed to the watch at (``Verb.ADOPTED``), and
        #: whether it had a backlog then (stored while the run held it: no doorbell rang for it).
        self.adopted_at = 0
        self.adopted_backlog = False
        #: The run this one switched from, whose ``finish.lua`` this run sends with its
        #: ``begin.lua`` (``Verb.SWITCHED``), and its stop.
        self.prior = prior
        self.deferred_end: LoopEnd | None = None
        self.pre_switched: tuple[Any, Any] | None = None
        self._offered: list[MessageQueue] = []
        #: This task execution lingers already (a chain of switches carries its watch): it goes
        #: on while ``may_linger``; a request that has not lingered yet asks ``may_start_linger`` too.
        self.lingering = watch is not None
        #: The request the prior run's queue needs when its finish did not hand it to the watch.
        self.prior_follow_up: FollowUp | None = None
        #: The token of the request this run's end asks for (finish.lua's new token), one per run.
        self.end_token = new_token()
        #: The end whose ``finish.lua`` was sent and not answered yet (``finish_again``).
        self.finishing: LoopEnd | None = None
        self.epoch = 0
        self.committed = 0  # offset persisted in Redis
        self.commit_point = 0  # offset the ProcessQueue says may be persisted
        self.pulled_to = 0  # one past the highest offset pulled
        self.retry_updates: dict[int, int] = {}
        #: The last listener exception of the run not committed yet, ``"<offset>|<ms>|<text>"``:
        #: written with the next commit, beside the reconsume counts (``error`` in the state hash).
        self.failure = ""
        self.retries: dict[int, int] | None = None
        #: Ranges retention trimmed before this run read them, until a commit counts them.
        self.trimmed = TrimmedRanges()
        # Counters of this run, handed to the stats manager once at the end (not per message).
        self.consumed = 0
        self._failed = 0
        self._rt_sum = 0.0
        self._rt_n = 0
        # The same for async calls, written on the loop's thread only (no lock needed there).
        self._art_sum = 0.0
        self._art_n = 0
        #: Set when the queue was lost while an awaited call (queue mode) ran: how the loop ends.
        self.call_lost: LoopEnd | None = None
        self._held_checked = time.monotonic()

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        self._thread = threading.get_ident()
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
        if end.stop is Stop.SWITCH and (self.pre_switched is not None or not self._needs_last_commit()):
            # Its finish.lua rides on the next run's begin.lua (one round trip for the switch), or
            # ran already, with that begin.lua, behind the lingering read (``switch.lua``).
            self.deferred_end = end
            return Outcome(Verb.SWITCHED, consumed=self.consumed)
        return self._finish(end)

    # -- check -----------------------------------------------------------------------------------

    def _check(self) -> Outcome | None:
        """``begin.lua``: claim the run, verify/take the lock, first pull. None means "go on".

        After a switch, the finish of the run left (``prior``) goes in the same round trip: the
        two scripts touch two different queues, and neither depends on the other's reply."""
        prior = self.prior
        if prior is None:
            res = self.scripts.call(*self._begin_call(), via=self.lease)
        else:
            assert prior.deferred_end is not None
            if prior.pre_switched is not None:
                # switch.lua ran both behind the prior's last read (the trickle's usual switch).
                # Taken once: a retry of this run after a Redis error sends them again (finish
                # then answers STALE, and begin.lua reads the queue as it is now, not as it was
                # at the switch).
                done, res = prior.pre_switched
                prior.pre_switched = None
            else:
                done, res = self.scripts.run_many(
                    [("finish", *prior._finish_call(prior.deferred_end)), self._begin_call()], self.lease)
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
        if not self._epoch_replicated():
            return self._finish(LoopEnd(Stop.REQUEUE, REPLICA_WAIT_REQUEUE_S))
        self._begun(res)
        return None

    def _begin_call(self) -> tuple[str, list[str], list[Any]]:
        """``begin.lua``'s call for this run: script, keys, arguments."""
        return "begin", [self.k_state, self.k_log, self.k_next, self.k_retries], self._begin_args(self.token)

    def _begin_args(self, token: str) -> list[Any]:
        """``begin.lua``'s arguments for a run of this task execution with ``token`` (this run's,
        or the watch's for a queue ``switch.lua`` begins behind a lingering read)."""
        return [self.client_id, token, self.run_lease_ms, self.lock_ms, self.pull_n, self.runner]

    def _epoch_replicated(self) -> bool:
        """Whether this run's epoch is on ``lock_wait_replicas`` replicas (``WAIT``, once per new
        epoch of the queue in this process: a grant is rare, renewals need none). Until it is, no
        listener is called under it: a failover now could promote a replica that never saw the
        grant and give the queue to somebody else (``mqorder.store.replication``)."""
        seen = self.engine.replicated_epochs
        if seen.get((self.sub, self.mq.key)) == self.epoch:
            return True
        rw = self.engine.replica_wait
        n = rw.wanted(self.broker, self.mq.tag)
        if n and rw.wait(lambda cmd: self.lease.round_trip([cmd])[0], n) < n:
            log.warning(
                "epoch %d of %s for %s is not on %d replica(s) after %d ms (WAIT); not consuming under "
                "it yet, retrying in %.0f s. Check the replicas (mqorder doctor) or lower "
                "MQORDER_LOCK_WAIT_REPLICAS", self.epoch, self.mq.key, self.sub, n, rw.timeout_ms,
                REPLICA_WAIT_REQUEUE_S,
            )
            return False
        seen[(self.sub, self.mq.key)] = self.epoch
        return True

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
        self.trimmed.floor = nxt
        self._apply_skip_floor()

    def _apply_skip_floor(self) -> None:
        pq = self.pq
        if self.trimmed.floor > self.commit_point and not pq.consuming and not pq.msg_tree:
            self.commit_point = self.trimmed.floor

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
        self.trimmed.add(end, n)
        log_trimmed(self.engine.skips_logged, self.sub, self.mq, start, end, n)

    # -- the loop: take, consume, settle ----------------------------------------------------------

    def _consume_loop(self) -> LoopEnd:
        pq = self.pq
        deadline = time.monotonic() + self.budget
        self._start_yield_clock()
        threshold = self.pull_threshold
        while True:
            if pq.dropped:
                return LoopEnd(Stop.DONE)
            now = time.monotonic()
            if now > deadline or self._yield_due(now):
                return LoopEnd(Stop.REQUEUE, BUDGET_REQUEUE_S)  # MAX_TIME_CONSUME_CONTINUOUSLY
            if pq.is_lock_expired() and not self._touch():
                return LoopEnd(Stop.FENCED)
            msgs = pq.take_messages(self.batch_max)
            if not msgs:
                end = self._drained(deadline, pull=not pq.is_full(threshold), may_linger=not pq.consuming)
                if end is not None:
                    return end
                continue
            msgs = self._split_poison(msgs)
            if not msgs:
                continue
            ctx = self._context()
            handled = self._consume(msgs, ctx)
            if self.call_lost is not None:
                return self.call_lost  # the queue was lost during an async call: settle nothing
            end = self._settle(msgs, handled, ctx)
            if end is not None:
                return end

    def _start_yield_clock(self) -> None:
        if self.yield_s > 0:
            self._yield_at = time.monotonic() + self.yield_s

    def _yield_due(self, now: float) -> bool:
        """The run has held its slot ``consume_yield_after_ms`` and another request of its worker
        waits for one: end with a re-queue behind it, as at the end of the 60 s budget. Pool slots
        are shared by every group of a worker (RocketMQ gives each group its own threads), and a
        lagging group's runs kept them for 60 s at a time: the other groups' queues on that worker
        waited about three minutes (an operator walk-through; with time retention, 25,594 of
        their messages were trimmed unread). Asked at most every ``YIELD_CHECK_S``, and only with
        messages in hand: a drained run has nothing to re-queue for (its linger gives the slot
        back by itself), and a re-queue there cost a Celery task per message at a trickle."""
        if now < self._yield_at:
            return False
        if not self._has_backlog():
            self._waiting_since = 0.0
            return False
        self._yield_at = now + YIELD_CHECK_S
        if not self.engine.others_wait():
            self._waiting_since = 0.0
            return False
        # Somebody has waited for a slot over several checks in a row (YIELD_PATIENCE_S): a run
        # that holds a message or two at a trickle ends its linger by itself long before.
        if not self._waiting_since:
            self._waiting_since = now
        return now - self._waiting_since >= YIELD_PATIENCE_S

    def _has_backlog(self) -> bool:
        """Messages in hand, not yet handled (a key or concurrent run holds them in its lanes)."""
        return self.pq.msg_count > 0

    def _drained(self, deadline: float, pull: bool, may_linger: bool = True) -> LoopEnd | None:
        """Nothing is left to hand out: commit, with the next read behind the commit, and linger
        on the queue while the worker has spare capacity (``LingeringReads``). None means "go on":
        new messages came in; otherwise how the loop ends. Every kind of run ends its loop here."""
        linger = may_linger and self.linger_s > 0 and self._may_linger()
        until = min(deadline, time.monotonic() + self.linger_s) if linger else None
        # Lingering, the commit carries the first lingering read in its round trip.
        pulled = self._persist(pull=pull, idle_if_drained=not linger, linger_until=until)
        if pulled.kind is PullKind.LOST:
            return self._fenced()
        if pulled.kind is PullKind.ENDED:
            return LoopEnd(Stop.IDLE)
        if until is not None and pulled.kind is PullKind.WAIT and not self.pq.dropped:
            pulled = self._linger(until)
            if pulled.kind is PullKind.LOST:
                return self._fenced()
        if pulled.kind is PullKind.SWITCH:
            return SWITCH_END
        if not pulled.count:
            return LoopEnd(Stop.DONE)
        return None

    def _fenced(self) -> LoopEnd:
        """The run lost its queue (a fenced call was refused, or a lingering read saw it move)."""
        return LoopEnd(Stop.FENCED)

    def _split_poison(self, msgs: list[MessageExt]) -> list[MessageExt]:
        """Send an undecodable head message to the DLQ; never hand one to the listener."""
        for i, m in enumerate(msgs):
            if m.decode_error is None:
                continue
            if i == 0:
                self.engine.dlq.send(self.spec.group, m, m.decode_error, self.epoch, self.mq)
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
        if self.spec.is_async:
            return self._consume_awaited(msgs, ctx)
        # On the run's own thread nothing else renews the lease during the call (a key run's lane
        # calls have their dispatcher for that): the process's LeaseKeeper does.
        handle = keeper().keep(self._renew_during_call, self.run_lease_ms, self._call_label) \
            if threading.get_ident() == self._thread else 0
        try:
            status, rt, wall0 = call_listener(ORDERLY, self.spec, self.hooks, self.mq, msgs, ctx, self.epoch,
                                              self.client_id, self.run_id, self.ledger is not None)
        finally:
            if handle:
                keeper().release(handle)
        self._note_rt(rt)
        if self.ledger is None:
            return Handled(status)
        return Handled(status, wall0 * 1000, wall0 * 1000 + rt)

    async def _consume_async(self, msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> Handled:
        """``_consume`` of an async listener, on the process's loop."""
        status, rt, wall0 = await call_listener_async(ORDERLY, self.spec, self.hooks, self.mq, msgs, ctx, self.epoch,
                                                      self.client_id, self.run_id, self.ledger is not None)
        self._art_sum += rt
        self._art_n += 1
        if self.ledger is None:
            return Handled(status)
        return Handled(status, wall0 * 1000, wall0 * 1000 + rt)

    def _consume_awaited(self, msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> Handled:
        """Queue mode with an async listener: the call runs on the process's loop and this run
        waits for it (one call per queue at a time, as for a plain listener), renewing its lease
        meanwhile. If the queue is lost during the call (the lease is refused, or a rebalance
        revoked it), the call gets ``cancel_grace_s`` to end and is then cancelled; a fenced run
        settles nothing of it (``call_lost``), a revoked one settles a call that ended in time."""
        box: queue.SimpleQueue[Handled] = queue.SimpleQueue()
        hand = native.to_caller()

        async def call() -> None:
            handled = Handled(SUSPEND)
            try:
                handled = await self._consume_async(msgs, ctx)
            except BaseException as exc:
                if goes_on_up(exc):
                    raise
                log.exception("call of %s on %s failed outside the listener (a hook?); suspending the queue",
                              self.spec.name, self.mq.key)
            finally:
                hand(box.put, handled)

        running = ProcessLoop.get(self.engine.settings.async_max_in_flight).submit(self.spec.name, call, lambda: hand(box.put, Handled(SUSPEND)))
        lost: LoopEnd | None = None
        cancel_at: float | None = None
        while True:
            now = time.monotonic()
            timeout = AWAIT_POLL_S if cancel_at is None else max(0.0, cancel_at - now)
            try:
                handled = box.get(timeout=timeout if cancel_at != float("inf") else None)
            except queue.Empty:
                pass
            else:
                if lost is not None and (lost.stop is Stop.FENCED or cancel_at == float("inf")):
                    self.call_lost = lost
                return handled
            if lost is None:
                lost = self._still_held(now)
                if lost is not None:
                    cancel_at = now + self.cancel_grace_s
            elif cancel_at is not None and now >= cancel_at and cancel_at != float("inf"):
                log.warning("cancelling the async call of %s on %s: the run lost the queue %.1f s ago; nothing it "
                            "did is committed", self.spec.name, self.mq.key, self.cancel_grace_s)
                running.cancel()
                cancel_at = float("inf")

    def _still_held(self, now: float) -> LoopEnd | None:
        """While async calls run: None if the run still holds its queue, else how it ends (a
        rebalance revoked it: DONE; the commit was refused: FENCED). Asks Redis with a fenced
        commit at most every ``HELD_CHECK_S`` (its reply says whether the queue was revoked)."""
        if not self.pq.dropped and now - self._held_checked >= HELD_CHECK_S:
            self._held_checked = now
            if self._persist(pull=False).kind is PullKind.LOST:
                return LoopEnd(Stop.FENCED)
        if self.pq.dropped:
            return LoopEnd(Stop.DONE)
        if self.pq.is_lock_expired() and not self._touch():
            return LoopEnd(Stop.FENCED)
        return None

    def _note_rt(self, rt: float) -> None:
        self._rt_sum += rt
        self._rt_n += 1

    def _settle(self, msgs: list[MessageExt], handled: Handled, ctx: ConsumeOrderlyContext) -> LoopEnd | None:
        """``processConsumeResult``: commit, suspend (with DLQ after max reconsume), rollback.
        None means "go on consuming"."""
        n = len(msgs)
        status = handled.status
        self._note_failure(msgs, ctx)
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
            return self._suspend(msgs, handled, self._asked_suspend_ms(ctx), ctx.failure)
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
            return self._stop_for_retry(self._asked_suspend_ms(ctx))
        return self._suspend(msgs, handled, self._asked_suspend_ms(ctx), ctx.failure)


    def _note_failure(self, msgs: list[MessageExt], ctx: CallContext) -> None:
        """The listener raised on ``msgs``: keep what it raised for the next commit (the first
        offset of the call stands for the batch)."""
        if ctx.failure:
            self.failure = f"{msgs[0].queue_offset}|{int(time.time() * 1000)}|{ctx.failure}"

    def _dead_letter_exhausted(self, msgs: list[MessageExt], failure: str = "") -> int | None:
        """``checkReconsumeTimes``: the leading messages past ``max_reconsume_times`` go to the DLQ
        (a prefix only, so nothing overtakes them). How many went; None when the run lost its
        queue (confirmed before the DLQ write, which only the holder may make)."""
        limit = self.max_reconsume
        dead = 0
        if limit != -1:
            while dead < len(msgs) and msgs[dead].reconsume_times >= limit:
                dead += 1
        if dead:
            if not self._touch():
                return None
            why = exhausted_reason(limit, failure)
            for m in msgs[:dead]:
                self.engine.dlq.send(self.spec.group, m, why, self.epoch, self.mq)
        return dead

    def _asked_suspend_ms(self, ctx: CallContext) -> int:
        """The suspend the listener's context asks for (``suspend_ms_of``), a bad value named."""
        return suspend_ms_of(ctx.suspend_current_queue_time_millis, self.suspend_ms, self.spec.name)

    def _suspend(self, msgs: list[MessageExt], handled: Handled, suspend_ms: int, failure: str = "") -> LoopEnd | None:
        """Messages past ``max_reconsume_times`` go to the DLQ (``_dead_letter_exhausted``); the
        rest are made to consume again after ``suspend_ms``."""
        dead = self._dead_letter_exhausted(msgs, failure)
        if dead is None:
            return LoopEnd(Stop.FENCED)
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
        if self._persist(pull=False).kind is PullKind.LOST:
            return LoopEnd(Stop.FENCED)
        return LoopEnd(Stop.REQUEUE, suspend_ms / 1000.0)

    # -- Redis calls -----------------------------------------------------------------------------

    def _commit_in_memory(self) -> None:
        offset = self.pq.commit()
        if offset > self.commit_point:
            self.commit_point = offset
        if self.trimmed.floor:
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
        # Nobody adopts idle queues on a Redis Cluster (ConsumerState.idle_watch): no nudge there.
        then = (idle_entry(self.client_id, [(self.sub, self.mq.key)])
                if idle and self.engine.nudges_idle and not self.lease.on_cluster else None)
        skipped = self.trimmed.due(self.commit_point)
        args: list[Any] = [
            self.client_id, self.epoch, self.token, self.commit_point, self.run_lease_ms,
            self.lock_ms, "1" if idle else "0", skipped, self.pulled_to,
        ]
        for off, n in self.retry_updates.items():
            args.append(off)
            args.append(n)
        if self.failure:
            args += ("e", self.failure)  # commit.lua: the state's 'error' field
        keys_ = [self.k_state, self.k_next, self.k_retries]
        if pull or (self.ledger is not None and self.ledger.records):
            # One round trip: the fenced commit, then a plain read of the next batch (and the
            # ledger records of the batch just handled, when the ledger is on).
            res, entries = self._commit_pipelined(keys_, args, pull, linger_until=linger_until, then=then)
        else:
            res, entries = self.scripts.call("commit", keys_, args, via=self._fenced_via()), []
        verb = text(res[0])
        if skipped and verb in ("OK", "IDLE"):
            self._skips_counted(self.commit_point, skipped)
        if verb == "IDLE":
            self.committed = self.commit_point
            self.failure = ""
            return ENDED
        if verb != "OK":
            self._switch_refused(entries)
            self._on_refused(verb, res)
            return LOST
        self.retry_updates.clear()
        self.failure = ""
        self.committed = self.commit_point
        return self._took(res, entries, pull)

    def _commit_target(self) -> int:
        return self.commit_point

    def _took(self, res: list[Any], entries: Any, pull: bool) -> Pull:
        """After an accepted commit (``commit.lua`` or ``key_commit.lua``, same reply head): the
        lock is confirmed; a revoked queue stops here; otherwise what the read behind the commit
        brought goes in (a lingering read's ``Slice``, or ``XRANGE`` entries, an empty one past a
        trimmed tail)."""
        self.pq.mark_locked()
        if text(res[2]):
            self.pq.dropped = True  # revoked: the rebalance gave the queue to someone else
            self._switch_refused(entries)
            return NOTHING
        if isinstance(entries, Slice):
            return self._slice_pulled(entries, int(res[1]))
        self._put(entries, None)
        if pull and not entries:
            self._check_trimmed_tail(int(res[1]))
        return Pull(PullKind.MESSAGES, len(entries))

    def _skips_counted(self, offset: int, n: int) -> None:
        """The fenced commit of ``offset`` counted ``n`` skipped messages in the queue's state: the
        stats count them too, here, where the commit did (once, by the run that moved past them),
        and they are not reported again."""
        self.stats.inc_consume_skipped(self.sub, self.mq.key, n)
        self.trimmed.counted(offset)

    def _commit_pipelined(self, keys_: list[str], args: list[Any], pull: bool, script: str = "commit",
                          start: int | None = None, linger_until: float | None = None,
                          then: tuple[Any, ...] | None = None) -> tuple[Any, Any]:
        """``commit.lua`` (or ``script``: a key-ordered run's ``key_commit.lua``), the ledger records,
        then ``XRANGE`` of the next batch from ``start`` (default: past what this run pulled) when
        ``pull``, pipelined: one round trip per batch. With ``linger_until`` the read is the first
        lingering read instead (``_queue_slice``), returned as a ``Slice``, unless the linger is
        over already. ``then``: one more command at the end (the idle nudge of a run that may end
        here; if the commit did not end it, the nudge's reader finds the queue busy and leaves it).

        Sent by ``commit_pipelined``, which answers a lost script (``NOSCRIPT``) safely.
        """
        if start is None:
            start = max(self.commit_point, self.pulled_to)
        sliced = False
        # _drained asked _may_linger a moment ago for the first read; a read sent again (after
        # NOSCRIPT, a blocking read later) asks again.
        first = True

        def queue_reads(pipe: RawPipeline) -> None:
            nonlocal sliced, first
            sliced = pull and linger_until is not None and self._queue_slice(pipe, linger_until, checked=first)
            first = False
            if pull and not sliced:
                pipe.execute_command("XRANGE", self.k_log, start, "+", "COUNT", self.pull_n)
            if then is not None:
                pipe.execute_command(*then)

        def kept(replies: list[Any]) -> bool:
            """The commit got NOSCRIPT: did the lingering read's ``switch.lua`` switch all the same?"""
            if not sliced:
                return False
            switched = self._slice_replies(replies)[2]
            return switched is not None and bool(int(switched[0]))

        res, read = commit_pipelined(self.scripts, self.lease, script, keys_, args, self.ledger, queue_reads, kept)
        if sliced:
            return res, Slice(*self._slice_replies(read))
        return res, read[0] if pull else []

    def _flush_ledger(self) -> None:
        """Records of a run that stopped without a last commit (fenced, or ended by the commit)."""
        if self.ledger is None or not self.ledger.records:
            return
        try:
            self.ledger.flush(self.scripts)
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
                self.commit_point, time.time(), self.committed,
            ))
        if verb == "FENCED":
            log.warning(
                "commit refused on %s for %s: epoch %d is stale (now epoch %s held by %r); "
                "stopping this ConsumeRequest, the new owner redelivers from the last commit",
                self.mq.key, self.sub, self.epoch, text(res[1]), text(res[2]),
            )
        elif verb == "AHEAD":
            log.warning(
                "commit refused on %s for %s: this run read up to offset %d but the queue now ends at %s: "
                "Redis failed over to a replica that missed the last appends. Stopping this "
                "ConsumeRequest; the next run reads the queue as the new primary has it",
                self.mq.key, self.sub, self.pulled_to - 1, text(res[1]),
            )
        else:
            log.warning("commit refused on %s for %s: %s", self.mq.key, self.sub, verb)

    def _fenced_via(self) -> ConnectionLease | None:
        """The connection for a fenced call: the run's own (its reads') on the run's thread, else
        None (a pool connection: a lease belongs to one thread).

        Why the run's own: after a failover a pool connection reaches the promoted replica, which
        may lack messages this run read on the old primary. ``AHEAD`` compares offsets only, so
        once new messages fill those offsets a commit there is accepted and skips them. On the
        connection that read, the primary's death is a Redis error instead: the run starts over
        from the committed offset on the new primary (once a bug: a SUSPEND's commit went through
        the pool and committed past two messages nobody had handled)."""
        return self.lease if threading.get_ident() == self._thread else None

    def _touch_reply(self) -> Any:
        """``touch.lua`` renewing this run's mark and lease, fenced by owner, epoch and token: on the
        run's own connection from its thread, a pool connection from any other (``_fenced_via``)."""
        return self.scripts.call(
            "touch", [self.k_state], [self.client_id, self.epoch, self.token, self.run_lease_ms, self.lock_ms],
            via=self._fenced_via(),
        )

    def _touch(self) -> bool:
        res = self._touch_reply()
        if int(res[0]):
            self.pq.mark_locked()
            return True
        self._on_refused("FENCED", res)
        return False

    def _call_label(self) -> str:
        return f"{self.spec.name} on {self.mq.key}"

    def _renew_during_call(self) -> bool:
        """``LeaseKeeper``'s renewal while the listener runs: ``_touch``'s fenced renewal, from the
        keeper's thread, so through a pool connection (the run's own belongs to its thread)."""
        # Not pq.mark_locked(): the run's own touch on its own connection, due again after a long
        # call, is what finds a primary that died meanwhile (``_fenced_via``).
        return bool(int(self._touch_reply()[0]))

    def _still_owner(self) -> bool:
        res = self.scripts.touch(keys=[self.k_state], args=[self.client_id, self.epoch, self.token, 0, 0])
        return bool(int(res[0]))

    def _after_prior(self, prior: ConsumeRequest, done: Outcome) -> None:
        """The run this one switched from has ended (``done``): its queue is the watch's now, or
        (reassigned meanwhile) it needs a request, which must not wait for this run to linger."""
        assert self.watch is not None
        self.watch.switched(prior.sub, prior.mq, self.sub, self.mq,
                            prior.adopted_at if done.verb is Verb.ADOPTED else None, prior.adopted_backlog)
        if done.needs_dispatch:
            self.prior_follow_up = FollowUp(prior.mq, done.target, done.token, done.countdown, sub=prior.sub)
            self.linger_s = 0.0

    def _needs_last_commit(self) -> bool:
        """Whether progress is left to commit before ``finish.lua`` may end the run."""
        return bool(self.epoch) and self.commit_point > self.committed

    def _finish(self, end: LoopEnd) -> Outcome:
        """``finish.lua``: end the run and learn who consumes this queue next."""
        if self._needs_last_commit() and self._persist(pull=False).kind is PullKind.LOST:
            return Outcome(Verb.FENCED, consumed=self.consumed)
        self.finishing = end
        return self._send_finish()

    def _send_finish(self) -> Outcome:
        """``finish.lua`` for ``self.finishing``; cleared once answered (a Redis error leaves it
        set: the engine's retry sends the same call, ``finish_again``)."""
        end = self.finishing
        assert end is not None
        res = self.scripts.call("finish", *self._finish_call(end), via=self.lease)
        self.finishing = None
        return self._ended(res, end)

    def finish_again(self) -> Outcome:
        """The retry of a run whose ``finish.lua`` got a Redis error instead of its reply: the same
        call again (the same new token), which answers as the first did if that one ran
        (``finished_already`` in ``_finish.lua``). Beginning the run again instead read STALE
        (the first finish had replaced the token), and the request the queue needed (REQUEUE,
        HANDOVER, DISPATCH) was never sent: the queue waited out ``pending_ttl_ms`` and a sweep.
        On this request, whose ledger records and counters are the run's."""
        self._thread = threading.get_ident()
        try:
            return self._send_finish()
        finally:
            if self._own_lease:
                self.lease.release()

    def _finish_call(self, end: LoopEnd) -> tuple[list[str], list[Any]]:
        """Keys and arguments of this run's ``finish.lua`` (a switch hands the queue to the watch).
        The new token is the run's one (``end_token``): a finish sent again after a lost reply
        must be recognised as the same call."""
        args: list[Any] = [self.client_id, self.token, end.stop.value, self.end_token,
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
        if verb is Verb.IDLE and self.engine.nudges_idle and not self.lease.on_cluster:
            # A hint, best-effort: the run has ended (finish.lua answered), so a Redis error here
            # must not fail it (once it made the engine send finish.lua a third time, on a run
            # whose end it had already read, and fail the task). A send wakes the queue anyway.
            try:
                went_idle = idle_entry(self.client_id, [(self.sub, self.mq.key)])
                RawPipeline(self.lease).execute_command(*went_idle).execute()
            except redis.RedisError as exc:
                log.debug("idle nudge of %s not written (%s)", self.mq.key, exc)
        if verb is Verb.ADOPTED:
            self.adopted_at = int(res[1])
            self.adopted_backlog = backlog_in(res)
            return Outcome(verb, consumed=self.consumed)
        if verb is Verb.IDLE or verb is Verb.STALE:
            return Outcome(verb, consumed=self.consumed)
        target = text(res[1])
        countdown = end.countdown if target == self.client_id else 0.0
        return Outcome(verb, target, text(res[2]), countdown, self.consumed)

    def _flush_stats(self) -> None:
        """Hand this run's counters to the stats manager (once per run, not per message)."""
        self.stats.add_run(self.sub, self.mq.key, self.consumed, self._failed, self._rt_sum + self._art_sum,
                           self._rt_n + self._art_n)
        self.stats.flush_due(self.engine.brokers.meta)

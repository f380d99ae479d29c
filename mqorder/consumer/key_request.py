"""``KeyConsumeRequest``: one run over one queue of a key-ordered listener (``ordering="key"``).

RocketMQ orders a whole queue: one slow or suspended message holds back every key that hashes to
that queue, and a queue is capped at one listener call at a time. In key mode the order that
matters is per sharding key (an order, an account), as in Confluent's Parallel Consumer (KEY
mode) and Pulsar's Key_Shared: messages of different keys of one queue run in parallel, up to
``key_concurrency``, while each key sees its messages one call at a time, in offset order.

How the guarantees carry over from queue mode:

* **One run per queue, as before.** The run is claimed, fenced and ended exactly like a queue-mode
  ``ConsumeRequest`` (``begin.lua``, ``touch.lua``, ``finish.lua``); only its loop differs. So
  all the calls of one queue happen inside one run, in one process, and the per-key rules below
  need no lock outside that process: *never two calls of one key at once on any worker* follows
  from *never two runs of one queue at once* (invariant 2, with the same exception: a run whose
  lease lapsed under a paused process is fenced and cannot commit).
* **Lanes.** The run's dispatcher (the task's own thread) pulls messages into ``KeyLanes``, one
  lane per key hash, and hands the head of each ready lane to a small pool of lane workers; a
  lane is busy until its call ends, and a suspended batch goes back to the head of its lane,
  which is blocked for the suspend time (``key_lanes``).
* **Offsets.** A message finishes when its call succeeds or it goes to the DLQ. The committed
  offset is the lowest unfinished one (RocketMQ's ``removeMessage``), and the offsets finished
  above it are committed with it as the offset map (``offset_map``), both in ``key_commit.lua``,
  fenced by epoch like ``commit.lua``. A new owner skips what the map says finished, and
  redelivers the rest in offset order: per key, whatever is redelivered comes before everything
  of that key that finished.
* **Retention skips.** A read that starts above the offset it asked for (retention trimmed what
  this group had not read, ``time`` policy) moves past the gap in order, and the gap is counted as
  in queue mode (``ConsumeRequest._note_trimmed``): by the fenced ``key_commit.lua`` whose offset
  passes it (the state's ``skipped``), then in the stats; offsets the inherited map says finished
  were consumed, not skipped.
* **Flow control.** No pull while the span from the lowest unfinished to the highest pulled
  offset is ``consume_concurrently_max_span`` or more (RocketMQ's ``consumeConcurrentlyMaxSpan``),
  or while ``pull_threshold_for_queue`` messages are held. That also bounds the offset map.
* **Suspend and DLQ per key.** SUSPEND (or an exception, or ROLLBACK) blocks only its lane for
  the suspend time and counts a reconsume (persisted in the retries HASH, so a new owner keeps
  counting); past ``max_reconsume_times`` the messages go to ``%DLQ%<group>`` and the lane moves
  on. Other lanes keep flowing. A run whose only work left is a blocked lane waits for it in
  place while its worker has spare pool slots (``may_linger``), and otherwise ends with a
  re-queue after the suspend time, as queue mode does, so it never holds a slot others need.

Why lanes are threads inside the run and not Celery tasks of their own: a lane task would need its
own per-key lock in Redis, its own fencing and a round trip per message to claim and finish keys,
and the offset map would be written by many tasks at once; inside one run the dispatcher alone
commits, with one fenced script per pulled batch as in queue mode. The lane workers are threads
(``LaneWorkers``, kept per process by ``LanePool``); under ``celery worker -P gevent`` threads are
greenlets (Celery monkey-patches
before anything is imported), so the same code runs lanes as greenlets there, and a prefork child
runs its lanes as threads of that child. ``ctx.epoch`` and ``ctx.still_owner()`` work per call.

``auto_commit`` has no effect in key mode: a SUCCESS or COMMIT finishes its messages, a ROLLBACK
counts as a suspend. A drained run lingers as in queue mode (``ConsumeRequest._linger``: its own
stream and its client's other idle queues, while the worker has spare slots).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from mqorder.codec import decode_entries
from mqorder.consumer.call_executor import LaneCalls
from mqorder.consumer.consume_request import HELD_CHECK_S, ConsumeRequest
from mqorder.consumer.context import ConsumeOrderlyContext
from mqorder.consumer.escapes import cancelled_by_run, counts_as_failure, goes_on_up
from mqorder.consumer.key_lanes import KeyLanes, Lanes, lane_key
from mqorder.consumer.lane_workers import LaneResult
from mqorder.consumer.ledger import LedgerOutcome
from mqorder.consumer.listener_call import ORDERLY, checked_status, listener_raised
from mqorder.consumer.nudge import idle_entry
from mqorder.consumer.offset_map import OffsetTracker, decode_done
from mqorder.consumer.run_types import (
    BUDGET_REQUEUE_S,
    COMMIT,
    ENDED,
    LOST,
    ROLLBACK,
    SUCCESS,
    SUSPEND,
    Handled,
    LoopEnd,
    Pull,
    PullKind,
    Stop,
)
from mqorder.model import ConsumeOrderlyStatus, MessageExt
from mqorder.store.replies import text

log = logging.getLogger(__name__)

#: Progress (offset, map, reconsume counts) is committed at least this often while calls finish,
#: even when no pull is due: what a failover would redeliver stays within this much work.
COMMIT_INTERVAL_S = 0.1
#: After a pull found nothing new, the next one waits this long (while calls still run).
EMPTY_PULL_BACKOFF_S = 0.05
#: ``key_commit.lua`` refuses a larger map (a bitset of a 100,000-offset span is 25,000 hex digits).
MAX_MAP_BYTES = 64 * 1024
#: Suspended keys a commit keeps for the next run (the state's ``held``): the earliest heads first.
HELD_MAX = 256
#: The longest a key is held back by a previous run's suspend (a guard against clock skew between
#: workers: the times are wall clock).
HELD_MAX_S = 300.0


def parse_held(value: str, committed: int, wall_offset: float) -> dict[int, float]:
    """The state's ``held`` (``<head offset>:<until wall ms>,...``) as head offset -> until in
    monotonic seconds (``wall_offset``: wall minus monotonic clock); entries below ``committed``,
    past their time or unreadable are left out."""
    out: dict[int, float] = {}
    now = time.monotonic()
    for part in value.split(","):
        off_s, _, ms_s = part.partition(":")
        try:
            off, until = int(off_s), int(ms_s) / 1000.0 - wall_offset
        except ValueError:
            continue
        if off >= committed and until > now:
            out[off] = min(until, now + HELD_MAX_S)
    return out


def uncommitted_bound(pull_n: int, key_concurrency: int, batch_max: int = 1) -> int:
    """At most this many messages of a queue were handled and not committed by its key-ordered run
    at any moment (what a crash may redeliver): a run commits once ``pull_n`` finished messages
    are unsaved (or ``COMMIT_INTERVAL_S`` passed), after settling every call that ended, and the
    calls in flight may have handled theirs without being settled yet."""
    return pull_n + 2 * key_concurrency * batch_max




class KeyConsumeRequest(ConsumeRequest):
    """A ``ConsumeRequest`` whose loop runs the keys of its queue in parallel (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.engine.settings
        self.key_concurrency = self.spec.key_concurrency or s.key_concurrency
        self.max_span = self.spec.consume_concurrently_max_span or s.consume_concurrently_max_span
        self.threshold = s.pull_threshold_for_queue
        self.lanes: Lanes = KeyLanes()
        self.tracker = OffsetTracker(0)
        #: Finished calls, reported by the lane workers (a C SimpleQueue: no Condition per put).
        self.results: queue.SimpleQueue[LaneResult | list[LaneResult]] = queue.SimpleQueue()
        self.in_flight = 0
        self.poison: list[MessageExt] = []
        #: Keys a previous run left suspended (begin.lua's ``held``): head offset -> until
        #: (monotonic s), held back again when pulled (``_hold_inherited``).
        self._held_in: dict[int, float] = {}
        #: The state's ``held`` as this run last read or wrote it (a commit sends it when it changed).
        self._held_sent = ""
        #: Wall clock minus monotonic clock, once per run: ``held`` times are wall clock, and a
        #: value computed from one offset encodes the same way at every commit.
        self._wall_offset = time.time() - time.monotonic()
        #: Progress not committed yet (finished offsets, skipped ones), and how many messages
        #: finished since the last commit (``uncommitted_bound``).
        self.dirty = False
        self.unsaved = 0
        self.fenced = False
        self.last_persist = 0.0
        self.empty_pull_at = 0.0
        #: When the run's time budget ends (set as its dispatch loop starts).
        self.deadline = float("inf")
        self._rt_lock = threading.Lock()
        #: Where the calls go (lane workers, or the process's loop for an async listener): made
        #: when the loop starts, once a subclass has set ``key_concurrency``.
        self.calls: LaneCalls | None = None
        #: The listener's name for the loop's blocked-loop warning (``spec.name`` formats it).
        self._name = self.spec.name
        #: ``_settle_fast``, or None for a run whose settling is not key mode's (a subclass's own
        #: ``_settle_one``: the concurrent run sends retries), which keeps the dispatcher's path.
        self._fast: Callable[[LaneResult], bool] | None = (
            self._settle_fast if type(self)._settle_one is KeyConsumeRequest._settle_one else None)
        #: What ``_settle_fast`` raised (a bug): raised by the dispatcher at its next look.
        self._fast_error: Exception | None = None
        self._fast_failed = False

    # -- check: begin.lua's reply carries the offset map ----------------------------------------

    def _begun(self, res: list[Any]) -> None:
        raw_map = res[6] if len(res) > 6 else None
        self.tracker = OffsetTracker(self.committed, decode_done(raw_map, self.committed))
        raw_held = res[7] if len(res) > 7 else None
        self._held_sent = text(raw_held) if raw_held else ""
        if self._held_sent and isinstance(self.lanes, KeyLanes):
            self._held_in = parse_held(self._held_sent, self.committed, self._wall_offset)
        self._put(res[4], res[5])
        if not res[4]:
            self._check_trimmed_tail(int(res[3]))

    def _check_trimmed_tail(self, nxt: int) -> None:
        """Everything from ``pulled_to`` to the queue's end was trimmed by retention: the tracker
        moves on to ``nxt``, and the skip is counted as in queue mode (``_trimmed``)."""
        t = self.tracker
        if nxt <= t.pulled_to:
            return
        self._trimmed(t.pulled_to, nxt)
        t.skip_to(nxt)
        self.pulled_to = nxt
        self.dirty = True

    def _trimmed(self, start: int, end: int) -> None:
        """Retention took ``[start, end)`` before this run read it. Queue mode's rule
        (``_note_trimmed``): the key-ordered commit that moves its offset past ``end`` counts it,
        fenced (``key_commit.lua``), then the stats. Offsets a previous owner finished (the
        inherited map) were consumed, not skipped: they are not counted, and forgotten."""
        t = self.tracker
        gone = [o for o in t.inherited if start <= o < end] if t.inherited else []
        t.inherited.difference_update(gone)
        self._note_trimmed(start, end, end - start - len(gone))

    def _put(self, entries: list[Any], raw_retries: list[Any] | None) -> None:
        if raw_retries:
            self.retries = {int(raw_retries[i]): int(raw_retries[i + 1]) for i in range(0, len(raw_retries), 2)}
        if not entries:
            return
        t, lanes = self.tracker, self.lanes
        msgs = self._decode(entries)
        if msgs and msgs[0].queue_offset > t.pulled_to:
            # Offsets are contiguous and only retention removes entries (from the head): the read
            # started below the queue's first stored offset. The tracker moves past the gap.
            self._trimmed(t.pulled_to, msgs[0].queue_offset)
            self.dirty = True
        put = lanes.put
        if t.pulled_all([m.queue_offset for m in msgs]):  # the usual read: all of it new
            for m in msgs:
                if m.decode_error is None:
                    put(m)
                else:
                    self.poison.append(m)
        else:
            for m in msgs:
                if not t.pulled(m.queue_offset):
                    self.dirty = True  # finished by a previous owner: skipped, never handed out
                elif m.decode_error is not None:
                    self.poison.append(m)
                else:
                    put(m)
        if self._held_in:
            self._hold_inherited(msgs)
        self.pulled_to = t.pulled_to

    def _hold_inherited(self, msgs: list[MessageExt]) -> None:
        """Keys a previous run of this queue left suspended stay suspended until their time: that
        run ended (no spare slot, its time budget) at the *earliest* key's time, and this one
        retried every key at once (a 2 s suspend retried after 50 ms; under a downstream outage
        keys reached the DLQ in a fraction of suspend x max_reconsume_times)."""
        held, now = self._held_in, time.monotonic()
        busy = self.lanes.busy
        for m in msgs:
            until = held.pop(m.queue_offset, None)
            # Not a key with a call running: retry() ends its busy mark, and its next message
            # would go out beside that call (a 'held' that outlived an offset reset did that).
            if until is not None and until > now and m.decode_error is None and lane_key(m) not in busy:
                self.lanes.retry(lane_key(m), [], until)

    def _held(self) -> str:
        """The state's ``held`` for this commit: each suspended key's head offset and its time."""
        lanes = self.lanes
        if not lanes.blocked or not isinstance(lanes, KeyLanes):
            return ""
        now, wall = time.monotonic(), self._wall_offset
        heads = sorted((off, until) for off, until in lanes.held_heads() if until > now)[:HELD_MAX]
        return ",".join(f"{off}:{int((until + wall) * 1000)}" for off, until in heads)

    def _decode(self, entries: list[Any]) -> list[MessageExt]:
        return decode_entries(self.mq, entries, self.retries, self.max_size)

    # -- the loop: dispatch to lanes, settle, commit ----------------------------------------------

    def _consume_loop(self) -> LoopEnd:
        calls = self.calls = LaneCalls(self.key_concurrency, self.results.put, self.cancel_grace_s,
                                       self.engine.settings.async_max_in_flight)
        try:
            return self._dispatch_loop()
        finally:
            # Never leave a call running past the run (an exception included): the next run of
            # this queue, maybe in this process, must not call the same key beside it. Async
            # calls of a run that ends on an exception are cancelled: nothing of them is settled.
            try:
                # A settle failure not raised yet (the run ends on another exception that came
                # first) must not cut this wait short: it is the same bug's second report.
                self._fast_error = None
                if self.in_flight:
                    calls.cancel_all(f"the run of {self.mq.key} ended on an error")
                while self.in_flight:
                    self._wait_one(None, discard=True)
            finally:
                calls.close()  # the process loop given back, whatever happened above

    def _dispatch_loop(self) -> LoopEnd:
        deadline = self.deadline = time.monotonic() + self.budget
        self._start_yield_clock()
        lanes = self.lanes
        stop: LoopEnd | None = None
        while True:
            stop = self._settle_finished(stop)
            if stop is None:
                stop = self._should_stop(deadline)
            if stop is not None:
                if self.in_flight:
                    if stop.stop is Stop.FENCED or self.pq.dropped:
                        stop = self._wait_one(self._calls().wait_for_lost(), stop=stop)
                    else:
                        stop = self._wait_out(stop)
                    continue
                return stop
            if self.poison:
                stop = self._dead_letter_poison()
                continue
            now = time.monotonic()
            lanes.unblock(now)
            while self.in_flight < self.key_concurrency:
                got = lanes.take(self.batch_max)
                if got is None:
                    break
                self._submit(*got)
            if self._wants_pull(now):
                pulled = self._persist(pull=True)
                if pulled.kind is PullKind.LOST:
                    stop = LoopEnd(Stop.FENCED)
                    continue
                self.empty_pull_at = 0.0 if pulled.count else now
                if pulled.count:
                    continue
            elif ((self.dirty or self.retry_updates) and (
                self.unsaved >= self.pull_n or now - self.last_persist >= COMMIT_INTERVAL_S
            )) or (self._calls().calls and now - self.last_persist >= HELD_CHECK_S):
                # (Async calls run and nothing was committed for a while: the commit also says
                # whether the queue is still this run's, so lost calls get cancelled.)
                if self._persist(pull=False).kind is PullKind.LOST:
                    stop = LoopEnd(Stop.FENCED)
                    continue
            if self.in_flight:
                stop = self._wait_one(self._wait_time(now, COMMIT_INTERVAL_S), fast=self._fast)
                continue
            # Nothing runs: drained, or only suspended keys are left. A run driving the loop
            # gives it back before it blocks here (a lingering read, a suspended key's wait).
            self._calls().release()
            if not lanes.buffered and not lanes.blocked:
                # Queue mode's end of a drained loop, lingering read included (fenced alike).
                end = self._drained(deadline, pull=True)
                if end is not None:
                    return end
                continue
            nxt = lanes.next_unblock()
            if nxt is None:  # pragma: no cover - a buffered lane is ready or blocked
                time.sleep(EMPTY_PULL_BACKOFF_S)
                continue
            if not self.engine.may_linger():
                # No spare slot: give this one back and come back after the suspend time.
                return LoopEnd(Stop.REQUEUE, max(BUDGET_REQUEUE_S, nxt - now))
            time.sleep(max(0.0, min(nxt - now, EMPTY_PULL_BACKOFF_S)))

    def _wait_out(self, stop: LoopEnd) -> LoopEnd:
        """The run ends (its time budget) with calls still running: wait for them, still checking
        the queue is this run's as the loop does (a fenced commit every ``HELD_CHECK_S`` while async
        calls run, the lease), or a queue lost meanwhile would never get its async calls cancelled
        after their grace (a hung call kept the run, and its pool slot, until it returned)."""
        now = time.monotonic()
        if ((self.dirty or self.retry_updates or self._calls().calls)
                and now - self.last_persist >= HELD_CHECK_S):
            if self._persist(pull=False).kind is PullKind.LOST:
                return LoopEnd(Stop.FENCED)
        elif self.pq.is_lock_expired() and not self._touch():
            return self._fenced()
        return self._wait_one(COMMIT_INTERVAL_S, stop=stop) or stop

    def _has_backlog(self) -> bool:
        """What was pulled and not handed to a call yet waits in the lanes, not in ``pq``."""
        return self.lanes.buffered > 0

    def _should_stop(self, deadline: float) -> LoopEnd | None:
        if self.pq.dropped:
            return LoopEnd(Stop.DONE)  # revoked: finish.lua hands the queue over
        now = time.monotonic()
        if now > deadline or self._yield_due(now):
            return LoopEnd(Stop.REQUEUE, BUDGET_REQUEUE_S)  # MAX_TIME_CONSUME_CONTINUOUSLY
        if self.pq.is_lock_expired() and not self._touch():
            return self._fenced()
        return None

    def _fenced(self) -> LoopEnd:
        """Lost the queue: calls still in flight are waited for but settle nothing."""
        self.fenced = True
        return LoopEnd(Stop.FENCED)

    def _wants_pull(self, now: float) -> bool:
        """Pull while fewer keys are ready than lanes exist, within the span and the threshold
        (RocketMQ's consumeConcurrentlyMaxSpan and pullThresholdForQueue)."""
        t, lanes = self.tracker, self.lanes
        if t.span >= self.max_span or lanes.buffered + self.in_flight >= self.threshold:
            return False
        if lanes.ready_count() >= self.key_concurrency:
            return False
        return not self.empty_pull_at or now - self.empty_pull_at >= EMPTY_PULL_BACKOFF_S

    def _wait_time(self, now: float, cap: float) -> float:
        nxt = self.lanes.next_unblock()
        if nxt is not None:
            cap = min(cap, max(0.0, nxt - now))
        return cap

    # -- lanes ------------------------------------------------------------------------------------

    def _calls(self) -> LaneCalls:
        assert self.calls is not None, "calls exist while the consume loop runs"
        return self.calls

    def _submit(self, key: int, msgs: list[MessageExt]) -> None:
        ctx = self._context()
        if self.spec.is_async:
            self._calls().submit_async(self._name, key, lambda: self._lane_call_async(key, msgs, ctx),
                                       LaneResult(key, msgs, Handled(SUSPEND), ctx, True))
        else:
            self._calls().submit(self._lane_call, key, msgs, ctx)
        self.in_flight += 1  # once submitted: a call that never went out is never waited for

    def _lane_call(self, key: int, msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> None:
        """Runs on a lane worker: hooks, the listener, hooks (``_consume``), then reports back.
        Whatever happens, a result is reported, or the dispatcher would wait for it forever."""
        handled = Handled(SUSPEND)
        try:
            handled = self._consume(msgs, ctx)
        except BaseException as exc:
            if not counts_as_failure(exc):  # only a process or greenlet ending (escapes)
                raise
            log.exception("lane call of %s on %s failed outside the listener (a hook?); suspending its key",
                          self.spec.name, self.mq.key)
        finally:
            self._calls().put_plain(LaneResult(key, msgs, handled, ctx))

    async def _lane_call_async(self, key: int, msgs: list[MessageExt], ctx: ConsumeOrderlyContext) -> None:
        """``_lane_call`` of an async listener, on the process's loop. A cancelled call (the run
        lost its queue) reports itself cancelled: its messages stay unfinished and count no
        reconsume (the next owner delivers them)."""
        handled = Handled(SUSPEND)
        cancelled = False
        try:
            if self.hooks:
                handled = await self._consume_async(msgs, ctx)
            else:
                # ``_consume_async`` without hooks, in this coroutine: one coroutine per call
                # where the layers (this, ``_consume_async``, ``call_listener_async``) made three,
                # each started and resumed per call (the same status rule and timing).
                spec, mq = self.spec, self.mq
                wall0 = time.time() if self.ledger is not None else 0.0
                t0 = time.perf_counter()
                status: Any
                try:
                    status = await spec.func(msgs, ctx)
                except Exception as exc:  # noqa: BLE001 - logged with its traceback by listener_raised
                    status = listener_raised(ORDERLY, spec, mq, msgs, ctx, exc)
                except asyncio.CancelledError as exc:
                    if cancelled_by_run():
                        raise
                    status = listener_raised(ORDERLY, spec, mq, msgs, ctx, exc)
                except BaseException as exc:
                    if not counts_as_failure(exc):
                        raise
                    status = listener_raised(ORDERLY, spec, mq, msgs, ctx, exc)
                rt = (time.perf_counter() - t0) * 1000
                if type(status) is not ConsumeOrderlyStatus:
                    status = checked_status(ORDERLY, spec, mq, status)
                self._art_sum += rt
                self._art_n += 1
                handled = Handled(status) if wall0 == 0.0 else Handled(status, wall0 * 1000, wall0 * 1000 + rt)
        except BaseException as exc:
            # Only the run's own cancel leaves the call unsettled (goes_on_up).
            if goes_on_up(exc):
                cancelled = isinstance(exc, asyncio.CancelledError)
                raise
            log.exception("lane call of %s on %s failed outside the listener (a hook?); suspending its key",
                          self.spec.name, self.mq.key)
        finally:
            self._calls().deliver(LaneResult(key, msgs, handled, ctx, cancelled))

    def _settle_fast(self, res: LaneResult) -> bool:
        """A call that ended while this run drives the loop itself (``LaneCalls.next_result``): a
        success is settled here, at once, in this thread, as the dispatcher would settle it
        (``_settle_one``), and the freed place goes to the next ready lane (``_submit``); the
        dispatcher is woken only when it has work of its own: ``pull_n`` finished messages to
        commit (its commit pulls the next batch), or a free place and no ready lane (a pull).
        Its timed checks (deadline, lease, commit interval, suspended lanes) still run at least
        every ``COMMIT_INTERVAL_S``: the loop is driven with that timeout. Anything else (a
        suspend, a cancelled call, a lost or revoked queue) goes to the dispatcher as before.
        False: not settled here."""
        status = res.handled.status
        if (res.cancelled or self.fenced or self.pq.dropped or self._fast_failed
                or (status is not SUCCESS and status is not COMMIT)):
            return False
        calls = self._calls()
        try:
            calls.ended(res.key)
            # (``_settle_one`` counts the call out of ``in_flight`` first: whatever fails after
            # that, the run's end does not wait for this call again.)
            self._settle_one(res, None, False)  # a success: finishes, never stops the run
            if self.unsaved >= self.pull_n:
                # The dispatcher's commit is due: no new call before it (it refills the places),
                # so what is finished and not committed stays within uncommitted_bound.
                calls.wake()
                return True
            if time.monotonic() > self.deadline:
                # The budget is over: no new call (the run waits for those in flight, then ends).
                calls.wake()
                return True
            lanes = self.lanes
            starved = False
            while self.in_flight < self.key_concurrency:
                got = lanes.take(self.batch_max)
                if got is None:
                    starved = True
                    break
                self._submit(*got)
            if starved:
                calls.wake()
        except Exception as exc:  # noqa: BLE001 - re-raised by the dispatcher
            # A bug here would otherwise end in the call's task, unseen ("Task exception was never
            # retrieved"), with a lane left busy for ever: the dispatcher raises it instead, as it
            # would have raised it settling the result itself.
            self._fast_error = exc
            self._fast_failed = True
            calls.wake()
        return True

    def _note_rt(self, rt: float) -> None:
        with self._rt_lock:  # lane workers report concurrently
            self._rt_sum += rt
            self._rt_n += 1

    def _wait_one(self, timeout: float | None, stop: LoopEnd | None = None, discard: bool = False,
                  fast: Callable[[LaneResult], bool] | None = None) -> LoopEnd | None:
        """Wait up to ``timeout`` for a call to end, then settle every call that ended (``fast``:
        ``_settle_fast``, while the run drives the loop)."""
        res = self._calls().next_result(self.results, timeout, fast)
        err = self._fast_error
        if err is not None:
            self._fast_error = None  # raised once: the run ends on it, waiting for its calls
            if res is not None:
                self.results.put(res)  # settled (discarded) by the run's end, not lost
            raise err
        if res is None:
            return stop
        stop = self._settle_item(res, stop, discard)
        return self._settle_finished(stop, discard)

    def _settle_finished(self, stop: LoopEnd | None, discard: bool = False) -> LoopEnd | None:
        results = self.results
        while not results.empty():  # (a raised queue.Empty per turn of the dispatcher costs more)
            try:
                res = results.get_nowait()
            except queue.Empty:  # pragma: no cover - the queue has one reader, this thread
                return stop
            stop = self._settle_item(res, stop, discard)
        return stop

    def _settle_item(self, item: LaneResult | list[LaneResult], stop: LoopEnd | None, discard: bool) -> LoopEnd | None:
        """One result of a lane worker, or the results of async calls that ended in one turn of the
        loop (``LaneCalls.deliver`` hands them over together: one wake-up of this thread)."""
        calls = self._calls()
        if type(item) is list:
            for res in item:
                calls.ended(res.key)
                stop = self._settle_one(res, stop, discard)
            return stop
        assert isinstance(item, LaneResult)
        calls.ended(item.key)
        return self._settle_one(item, stop, discard)

    def _settle_one(self, res: LaneResult, stop: LoopEnd | None, discard: bool) -> LoopEnd | None:
        """``processConsumeResult`` for one key: finish its messages, or suspend only its lane
        (DLQ past ``max_reconsume_times``). A fenced run settles nothing: the new owner
        redelivers from the last commit."""
        self.in_flight -= 1
        if discard or self.fenced or res.cancelled:
            self.lanes.release(res.key)
            return stop
        msgs, handled, ctx = res.msgs, res.handled, res.ctx
        status = handled.status
        self._note_failure(msgs, ctx)
        if status is SUCCESS or status is COMMIT:
            self._finished(msgs, LedgerOutcome.SUCCESS, handled)
            self.consumed += len(msgs)
            self.lanes.done(res.key)
            return stop
        if status is ROLLBACK:
            log.warning("%s returned ROLLBACK in key mode; its key is suspended", self.spec.name)
        self._failed += len(msgs)
        dead = self._dead_letter_exhausted(msgs, ctx.failure)
        if dead is None:
            return self._fenced()
        if dead:
            self._finished(msgs[:dead], LedgerOutcome.DLQ, handled)
        rest = msgs[dead:]
        if not rest:
            self.lanes.done(res.key)
            return stop
        self._hold_back(res.key, rest, handled, self._asked_suspend_ms(ctx))
        return stop

    def _hold_back(self, key: int, msgs: list[MessageExt], handled: Handled, suspend_ms: int) -> None:
        """Messages to handle again in this run after ``suspend_ms``: their lane waits, their
        reconsume counts go up (persisted with the next commit, so a new owner keeps counting)."""
        if self.ledger is not None:
            self.ledger.note(msgs, LedgerOutcome.SUSPEND, handled.start_ms, handled.end_ms, self.epoch)
        for m in msgs:
            m.reconsume_times += 1
            self.retry_updates[m.queue_offset] = m.reconsume_times
        self.lanes.retry(key, msgs, time.monotonic() + suspend_ms / 1000.0)

    def _finished(self, msgs: list[MessageExt], outcome: LedgerOutcome, handled: Handled) -> None:
        if self.ledger is not None:
            self.ledger.note(msgs, outcome, handled.start_ms, handled.end_ms, self.epoch)
        t = self.tracker
        for m in msgs:
            t.finish(m.queue_offset)
            if m.reconsume_times:
                self.retry_updates[m.queue_offset] = 0  # its reconsume count is void now
        self.dirty = True
        self.unsaved += len(msgs)

    def _dead_letter_poison(self) -> LoopEnd | None:
        """Undecodable messages have no key to wait behind: straight to the DLQ, finished."""
        msgs, self.poison = self.poison, []
        for m in msgs:
            self.engine.dlq.send(self.spec.group, m, m.decode_error or "undecodable", self.epoch, self.mq)
        now_ms = time.time() * 1000
        self._finished(msgs, LedgerOutcome.DLQ, Handled(SUSPEND, now_ms, now_ms))
        return None

    # -- Redis calls ------------------------------------------------------------------------------

    def _persist(self, pull: bool, idle_if_drained: bool = False, linger_until: float | None = None) -> Pull:
        """``key_commit.lua``: the lowest unfinished offset and the map of what finished above it,
        fenced (with the next read pipelined behind it when ``pull``: the first lingering read
        with ``linger_until``, as in ``ConsumeRequest._persist``)."""
        t = self.tracker
        idle = (idle_if_drained and pull and not self.retry_updates and not self.in_flight
                and not self.lanes.buffered and not self.lanes.blocked)
        # Nobody adopts idle queues on a Redis Cluster (ConsumerState.idle_watch): no nudge there.
        then = (idle_entry(self.client_id, [(self.sub, self.mq.key)])
                if idle and self.engine.nudges_idle and not self.lease.on_cluster else None)
        offset = t.base
        skipped = self.trimmed.due(offset)
        args: list[Any] = [
            self.client_id, self.epoch, self.token, offset, self.run_lease_ms, self.lock_ms,
            "1" if idle else "0", t.encoded(), MAX_MAP_BYTES, skipped, t.pulled_to,
        ]
        for off, n in self.retry_updates.items():
            args.append(off)
            args.append(n)
        if self.failure:
            args += ("e", self.failure)  # key_commit.lua: the state's 'error' field
        held = self._held() if (self.lanes.blocked or self._held_sent) else ""
        if held != self._held_sent:
            args += ("u", held)  # key_commit.lua: the state's 'held' field
        res, entries = self._commit_pipelined([self.k_state, self.k_next, self.k_retries], args, pull, "key_commit",
                                              self.tracker.pulled_to, linger_until, then)
        verb = text(res[0])
        self.last_persist = time.monotonic()
        if skipped and verb in ("OK", "IDLE"):
            self._skips_counted(offset, skipped)
        if verb in ("OK", "IDLE"):
            self._held_sent = held
        if verb == "IDLE":
            self.committed = self.commit_point = offset
            self.failure = ""
            self.dirty = False
            self.unsaved = 0
            return ENDED
        if verb != "OK":
            if verb == "BADMAP":
                log.error("offset map of %s for %s refused: %s", self.mq.key, self.sub, text(res[1]))
            self.fenced = True
            self._switch_refused(entries)
            self._on_refused(verb, res)
            return LOST
        self.retry_updates.clear()
        self.failure = ""
        self.committed = self.commit_point = offset
        self.dirty = False
        self.unsaved = 0
        return self._took(res, entries, pull)

    def _needs_last_commit(self) -> bool:
        return bool(self.epoch) and not self.fenced and bool(self.dirty or self.retry_updates)

    def _commit_target(self) -> int:
        return self.tracker.base

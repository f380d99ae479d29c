"""``ConcurrentConsumeRequest``: one run over one queue of a concurrent listener.

RocketMQ's ``ConsumeMessageConcurrentlyService``: messages of a queue are handled in parallel, in
batches of ``consume_message_batch_max_size``, with no order at all; what the listener does not
acknowledge goes back to the broker (``sendMessageBack``) and returns later through the group's
retry topic, up to ``max_reconsume_times`` (16), then to the DLQ.

This is the key-mode run (``KeyConsumeRequest``) with every message free to go beside every other
(``ConcurrentLanes`` instead of one lane per key), so it keeps what that run guarantees:

* **One run per queue, fenced.** Claimed by ``begin.lua``, renewed by ``touch.lua``, ended by
  ``finish.lua`` like every run. RocketMQ's concurrent consumer takes no lock at all (a queue
  moving between two clients is consumed by both for a while); here the calls of one queue all
  run inside its one fenced run, so a rebalance never has two clients consuming a queue at once,
  and ``ctx.epoch`` / ``ctx.still_owner()`` work as for orderly listeners.
* **Offsets.** The committed offset is the lowest unfinished one (RocketMQ's ``removeMessage``:
  ``msgTreeMap.firstKey()``), with the offsets finished above it in the fenced offset map
  (``key_commit.lua``): a crash never skips an unfinished message, and a new owner redelivers only
  those (RocketMQ redelivers everything above the committed offset).
* **Flow control.** No pull while the in-flight span is ``consume_concurrently_max_span`` (2000)
  or more, or ``pull_threshold_for_queue`` messages are held (RocketMQ's two limits).
* **Retries.** A message not acknowledged (``RECONSUME_LATER``, ``None``, an exception, or past
  ``ctx.ack_index``) is sent back to ``%RETRY%<group>`` with its delay (``RetrySender``) and then
  finishes here; one that came back ``max_reconsume_times`` times, or whose listener set
  ``ctx.delay_level_when_next_consume = -1``, goes to ``%DLQ%<group>``. Both writes happen
  before the commit that finishes the original, after a lease check (``touch.lua``), so a stale
  run sends nothing back; a crash between the write and the commit redelivers the original too
  (at least once, never lost). Broadcasting listeners retry in place instead, like key mode: the
  retry topic is the group's, and every client of a broadcasting group reads every message.

The retry topic is consumed by the same kind of run; each of its batches holds messages of one
original topic (``ConcurrentLanes``) and goes to that topic's listener, with the message restored
as it was sent (``retry.restore``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mqorder import keys
from mqorder.consumer.concurrent_lanes import ConcurrentLanes
from mqorder.consumer.context import ConsumeConcurrentlyContext
from mqorder.consumer.escapes import counts_as_failure, goes_on_up
from mqorder.consumer.hooks import global_hooks
from mqorder.consumer.key_request import KeyConsumeRequest
from mqorder.consumer.lane_workers import LaneResult
from mqorder.consumer.ledger import LedgerOutcome
from mqorder.consumer.listener import ListenerSpec, Ordering, get_listener
from mqorder.consumer.listener_call import CONCURRENT, call_listener, call_listener_async
from mqorder.consumer.retry import restore
from mqorder.consumer.run_types import SUCCESS, SUSPEND, Handled, LoopEnd, Stop
from mqorder.model import ConsumeConcurrentlyStatus, MessageExt, MessageModel

log = logging.getLogger(__name__)

CONSUME_SUCCESS = ConsumeConcurrentlyStatus.CONSUME_SUCCESS
RECONSUME_LATER = ConsumeConcurrentlyStatus.RECONSUME_LATER
#: RocketMQ: ``maxReconsumeTimes == -1`` means 16 for concurrent consumers.
DEFAULT_MAX_RECONSUME = 16


class ConcurrentConsumeRequest(KeyConsumeRequest):
    """A ``KeyConsumeRequest`` whose messages need no order, with retries through the retry topic."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.engine.settings
        self.key_concurrency = self.spec.key_concurrency or s.consume_concurrency
        self.lanes = ConcurrentLanes(self.batch_max)
        #: A broadcasting subscription has no retry topic: failed batches retry in place.
        self.in_place = self.spec.message_model is MessageModel.BROADCASTING or keys.BROADCAST_SEP in self.sub
        self._specs: dict[str, ListenerSpec | None] = {}

    def _decode(self, entries: list[Any]) -> list[MessageExt]:
        msgs = super()._decode(entries)
        if self.spec.is_retry:
            restore(msgs)
        return msgs

    # -- calls ------------------------------------------------------------------------------------

    def _listener_of(self, msgs: list[MessageExt]) -> ListenerSpec | None:
        """The listener of a batch: this subscription's, or for a retry topic the group's listener
        of the batch's original topic (None when this worker has none)."""
        if not self.spec.is_retry:
            return self.spec
        topic = msgs[0].topic
        if topic not in self._specs:
            spec = get_listener(self.spec.group, topic)
            self._specs[topic] = spec if spec is not None and spec.ordering is Ordering.CONCURRENT else None
        return self._specs[topic]

    def _submit(self, key: int, msgs: list[MessageExt]) -> None:
        ctx = ConsumeConcurrentlyContext(
            self.mq, epoch=self.epoch, client_id=self.client_id, group=self.spec.group,
            still_owner=self._still_owner, ack_index=len(msgs) - 1,
            suspend_current_queue_time_millis=self.suspend_ms, run_id=self.run_id,
        )
        spec = self._listener_of(msgs)
        if spec is not None and spec.is_async:
            self._calls().submit_async(spec.name, key, lambda: self._concurrent_call_async(key, msgs, ctx),
                                       LaneResult(key, msgs, Handled(SUSPEND), ctx, True))
        else:
            self._calls().submit(self._concurrent_call, key, msgs, ctx)
        self.in_flight += 1  # once submitted: a call that never went out is never waited for

    def _concurrent_call(self, key: int, msgs: list[MessageExt], ctx: ConsumeConcurrentlyContext) -> None:
        """Runs on a lane worker; whatever happens, a result is reported."""
        handled = Handled(SUSPEND)
        try:
            handled = self._consume_concurrently(msgs, ctx)
        except BaseException as exc:
            if not counts_as_failure(exc):  # only a process or greenlet ending (escapes)
                raise
            log.exception("concurrent call of %s on %s failed outside the listener (a hook?); retrying its "
                          "messages", self.spec.name, self.mq.key)
        finally:
            self._calls().put_plain(LaneResult(key, msgs, handled, ctx))

    async def _concurrent_call_async(self, key: int, msgs: list[MessageExt], ctx: ConsumeConcurrentlyContext) -> None:
        """``_concurrent_call`` of an async listener, on the process's loop."""
        handled = Handled(SUSPEND)
        cancelled = False
        try:
            spec = self._listener_of(msgs)
            assert spec is not None
            hooks = self.hooks if spec is self.spec else [*global_hooks(), *spec.hooks]
            status, rt, wall0 = await call_listener_async(CONCURRENT, spec, hooks, self.mq, msgs, ctx, self.epoch,
                                                          self.client_id, self.run_id, self.ledger is not None)
            self._art_sum += rt
            self._art_n += 1
            handled = self._concurrent_handled(status, ctx, wall0, rt)
        except BaseException as exc:
            if goes_on_up(exc):
                cancelled = isinstance(exc, asyncio.CancelledError)
                raise
            log.exception("concurrent call of %s on %s failed outside the listener (a hook?); retrying its "
                          "messages", self.spec.name, self.mq.key)
        finally:
            self._calls().deliver(LaneResult(key, msgs, handled, ctx, cancelled))

    def _consume_concurrently(self, msgs: list[MessageExt], ctx: ConsumeConcurrentlyContext) -> Handled:
        """Hooks, the listener, hooks; ``SUCCESS`` for ``CONSUME_SUCCESS`` (``ctx.ack_index`` says
        how much of it), ``SUSPEND`` for anything else (RocketMQ: null or an exception counts as
        ``RECONSUME_LATER``)."""
        spec = self._listener_of(msgs)
        if spec is None:
            log.error("no concurrent listener of group %s for topic %s in this worker: its retried messages "
                      "go back to %s (register the listener in every worker of the group)",
                      self.spec.group, msgs[0].topic, self.mq.topic)
            ctx.ack_index = -1
            return Handled(SUSPEND)
        hooks = self.hooks if spec is self.spec else [*global_hooks(), *spec.hooks]
        status, rt, wall0 = call_listener(CONCURRENT, spec, hooks, self.mq, msgs, ctx, self.epoch, self.client_id,
                                          self.run_id, self.ledger is not None)
        self._note_rt(rt)
        return self._concurrent_handled(status, ctx, wall0, rt)

    def _concurrent_handled(self, status: Any, ctx: ConsumeConcurrentlyContext, wall0: float, rt: float) -> Handled:
        ok = status is CONSUME_SUCCESS
        if not ok:
            ctx.ack_index = -1
        handled = Handled(SUCCESS if ok else SUSPEND)
        if self.ledger is not None:
            handled.start_ms, handled.end_ms = wall0 * 1000, wall0 * 1000 + rt
        return handled

    # -- settle -----------------------------------------------------------------------------------

    def _settle_one(self, res: LaneResult, stop: LoopEnd | None, discard: bool) -> LoopEnd | None:
        """``processConsumeResult``: the acknowledged prefix finishes; the rest is sent back to the
        retry topic (or the DLQ) and finishes too, or, in place, waits for its suspend time."""
        self.in_flight -= 1
        if discard or self.fenced or res.cancelled:
            self.lanes.release(res.key)
            return stop
        msgs, handled = res.msgs, res.handled
        ctx = res.ctx
        assert isinstance(ctx, ConsumeConcurrentlyContext)
        ack = ctx.ack_index if handled.status is SUCCESS else -1
        if type(ack) is not int:
            # Named by the batch's own listener: on %RETRY%<group> self.spec is a placeholder.
            log.warning("%s set ack_index to %r, not an int; acknowledging nothing",
                        (self._listener_of(msgs) or self.spec).name, ack)
            ack = -1
        ack = max(-1, min(ack, len(msgs) - 1))
        ok, failed = msgs[: ack + 1], msgs[ack + 1 :]
        if ok:
            self._finished(ok, LedgerOutcome.SUCCESS, handled)
            self.consumed += len(ok)
        if not failed:
            self.lanes.done(res.key)
            return stop
        self._failed += len(failed)
        spec = self._listener_of(msgs) or self.spec
        limit = spec.max_reconsume_times if spec.max_reconsume_times is not None else self.max_reconsume
        if limit == -1:
            limit = DEFAULT_MAX_RECONSUME
        level = ctx.delay_level_when_next_consume
        if type(level) is not int:
            level = 0
        if self.in_place:
            return self._retry_in_place(res.key, failed, handled, limit, level, stop)
        if not self._touch():
            self.fenced = True
            return LoopEnd(Stop.FENCED)
        dead = [m for m in failed if level < 0 or m.reconsume_times >= limit]
        back = [m for m in failed if not (level < 0 or m.reconsume_times >= limit)]
        for m in dead:
            why = ("the listener asked for the DLQ (delay_level_when_next_consume=-1)" if level < 0
                   else f"max reconsume times {limit} reached (the last call raised {ctx.failure})" if ctx.failure
                   else f"max reconsume times {limit} reached (listener returned CONSUME_SUCCESS with "
                        f"ctx.ack_index {ack}, leaving it unacknowledged)" if handled.status is SUCCESS
                   else f"max reconsume times {limit} reached (listener returned RECONSUME_LATER or nothing)")
            self.engine.dlq.send(spec.group, m, why, self.epoch, self.mq)
        sender = self.engine.retry_sender
        for m in back:
            sender.send_back(spec.group, m, level, queue=self.mq, epoch=self.epoch)
        if dead:
            self._finished(dead, LedgerOutcome.DLQ, handled)
        if back:
            self._finished(back, LedgerOutcome.RETRY, handled)
        self.lanes.done(res.key)
        return stop

    def _retry_in_place(self, key: int, failed: list[MessageExt], handled: Handled, limit: int, level: int,
                        stop: LoopEnd | None) -> LoopEnd | None:
        dead = [m for m in failed if level < 0 or m.reconsume_times >= limit]
        if dead:
            if not self._touch():
                self.fenced = True
                return LoopEnd(Stop.FENCED)
            for m in dead:
                self.engine.dlq.send(self.spec.group, m, f"max reconsume times {limit} reached (broadcasting, "
                                     "retried in place)", self.epoch, self.mq)
            self._finished(dead, LedgerOutcome.DLQ, handled)
        rest = [m for m in failed if not (level < 0 or m.reconsume_times >= limit)]
        if not rest:
            self.lanes.done(key)
            return stop
        self._hold_back(key, rest, handled, self.suspend_ms)
        return stop

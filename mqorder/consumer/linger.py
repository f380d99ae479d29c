"""Lingering reads: a drained run waits on its queue's stream (and its client's other idle queues).

A drained queue that gets a message a few milliseconds later would otherwise cost a wake-up and a
whole Celery task. Like a RocketMQ long-polling pull held at the broker, a drained run may block on
a read while its worker has idle capacity (``consume_linger_ms``). This mixin holds that read, for
``ConsumeRequest`` and, through it, the key-ordered and concurrent runs: one copy of the fenced
check that makes a read outside a commit safe.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from mqorder import keys
from mqorder.consumer.consumer_state import ConsumerState
from mqorder.consumer.idle_watch import IdleQueueWatch, Party, ReadPlan, backlog_in
from mqorder.consumer.nudge import read_nudges
from mqorder.consumer.run_types import LOST, NOTHING, SWITCH, SWITCH_END, WAIT, LoopEnd, Pull, PullKind, Slice
from mqorder.model import MessageQueue
from mqorder.process_queue import ProcessQueue
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline, packed_args
from mqorder.store.replies import text

log = logging.getLogger(__name__)

#: A lingering read blocks this long at most. It ends sooner when a message arrives on a watched
#: queue or when the worker nudges its lingering requests (a request waits for a slot,
#: ``mqorder.consumer.nudge``); the slice bounds how late a missed nudge or a reassignment of the
#: queue is noticed.
LINGER_SLICE_S = 0.1
#: Entries of the nudge stream a lingering read takes at once (only the newest id matters, and
#: "went idle" entries that adopt queues are not used on a Redis Cluster).
NUDGE_READ_COUNT = 16


def switch_command(sha: str, own_keys: list[str], plan: ReadPlan, args: list[Any]) -> bytes:
    """``EVALSHA`` of ``switch.lua`` (``sha``) packed for ``RawPipeline.execute_packed``: the run's
    own keys, the plan's keys, ``args``, the plan's offsets. The plan's parts come packed already
    (``ReadPlan.key_segs``, ``seen_segs``): the same bytes as packing the whole call."""
    n = 3 + len(own_keys) + len(plan.keys) + len(args) + len(plan.seen)
    return b"".join([
        b"*%d\r\n" % n, packed_args(("EVALSHA", sha, len(own_keys) + len(plan.keys), *own_keys)),
        *plan.key_segs, packed_args(tuple(args)), *plan.seen_segs,
    ])


class LingeringReads:
    """The lingering read of a ``ConsumeRequest`` (which provides the state declared here)."""

    engine: ConsumerState
    sub: str
    mq: MessageQueue
    client_id: str
    token: str
    epoch: int
    lease: ConnectionLease
    pq: ProcessQueue
    k_log: str
    k_state: str
    pull_n: int
    pulled_to: int
    lingering: bool
    watch: IdleQueueWatch | None
    switch_to: MessageQueue | None
    #: The subscription of ``switch_to``: the watch covers every group of the process.
    switch_sub: str
    scripts: Any
    k_next: str
    #: ``switch.lua``'s replies (finish.lua's, begin.lua's) when a lingering read switched this run
    #: to ``switch_to`` in its own round trip: the next run takes them instead of sending both.
    pre_switched: tuple[Any, Any] | None
    #: The adopted queues the last lingering read offered ``switch.lua``, in its order.
    _offered: list[MessageQueue]

    def _put(self, entries: list[Any], raw_retries: list[Any] | None) -> None:
        raise NotImplementedError  # ConsumeRequest's: messages read go into the run

    def _check_trimmed_tail(self, nxt: int) -> None:
        raise NotImplementedError  # ConsumeRequest's: retention took what was to be read

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
        its pending token still held so producers do not wake anyone. It stops once a request of
        the worker has waited ``capacity.YIELD_AFTER_S`` (25 ms) for a slot, and as soon as a
        rebalance assigned the queue to another client, so a lingering request never delays
        another queue by much more than that, nor a handover by more than one slice.

        Each slice is one round trip (``_queue_slice``, ``_slice_result``); the first one usually
        rode on the commit before it (``_persist(linger_until=...)``). Returns what a slice read
        (``NOTHING`` ends the run normally), or ``LOST`` when the run lost the queue (fenced).
        """
        while True:
            pipe = RawPipeline(self.lease)
            if not self._queue_slice(pipe, until):
                return NOTHING
            reply, state, switched = self._slice_replies(pipe.execute(raise_on_error=False))
            pulled = self._slice_result(reply, state, switched)
            if pulled.kind is not PullKind.WAIT:
                return pulled

    def _queue_slice(self, pipe: Any, until: float, checked: bool = False) -> bool:
        """Queue one lingering read on ``pipe``: a blocking ``XREAD`` over this queue and this
        client's nudge stream (where a send to a queue its watch adopted rings a doorbell), then
        this queue's state. False, with nothing queued, when the linger is over: ``until`` passed
        or a request waits for a slot.

        Messages read here did not come through a fenced commit, so the queue's state is read in
        the same round trip, *after* the blocking ``XREAD`` (Redis runs a connection's commands in
        order): ``_slice_result`` uses the batch only if this run still held the lock at the epoch
        it began with (and its pending token) when it was read, what a commit checks right before
        its pipelined pull.

        ``checked``: the caller asked ``_may_linger`` a moment ago (the first read, behind the
        commit of a drained run): not asked again.
        """
        left = until - time.monotonic()
        if left <= 0 or not (checked or self.engine.may_linger()):
            return False
        self.engine.note_lingering(True)
        last_id = f"{self.pulled_to - 1}-1" if self.pulled_to > 0 else "0-0"
        block_ms = max(1, int(min(left, LINGER_SLICE_S) * 1000))
        if self.lease.on_cluster:
            # One blocking read may only name keys of one slot on a Redis Cluster: it blocks on this
            # queue alone (no adopted queues: ``ConsumerState.idle_watch``), and the client's nudge
            # stream, in a slot of its own, is read without blocking in the same round trip. A
            # nudge is then seen within a slice or two (LINGER_SLICE_S) instead of at once.
            pipe.execute_command("XREAD", "COUNT", self.pull_n, "BLOCK", block_ms, "STREAMS", self.k_log, last_id)
            pipe.execute_command("HMGET", self.k_state, "owner", "epoch", "pending", "assignee")
            pipe.execute_command("XREAD", "COUNT", NUDGE_READ_COUNT, "STREAMS", keys.linger_nudge(self.client_id),
                                 self.engine.nudge_seen)
            return True
        if self.watch is None:
            self.watch = self.engine.idle_watch(self.sub, self.mq)
            if self.watch is not None:
                self.watch.start_reading(keys.linger_nudge(self.client_id), self.lease)
        plan = None
        watch = self.watch
        nudge_seen = self.engine.nudge_seen
        if watch is not None:
            nudge_seen = watch.nudge_seen
            watch.refresh(self.sub, self.mq, self.lease)  # its own round trip, at most every ADOPT_REFRESH_S
            plan = watch.plan(self.sub, self.mq)
            if watch.rung:
                # An adopted queue has news already (a doorbell read with this queue's messages, a
                # backlog at a hand-over or a renewal): look, but do not block (once 20 ms of
                # latency per message at 300 msg/s: the read waited for the next doorbell).
                block_ms = 0
        # The adopted queues are not named: a send to one rings the nudge stream (a doorbell).
        blocking = ("BLOCK", block_ms) if block_ms else ()
        pipe.execute_command("XREAD", "COUNT", self.pull_n, *blocking, "STREAMS", self.k_log,
                             self.engine.nudge_key, last_id, nudge_seen)
        pipe.execute_command("HMGET", self.k_state, "owner", "epoch", "pending", "assignee")
        if plan is not None and plan.offered:
            self._offer_switch(pipe, plan)
        return True

    def _offer_switch(self, pipe: Any, plan: ReadPlan) -> None:
        """Queue ``switch.lua`` behind the read: if an adopted queue of this run's listener has a
        backlog when the read returns (and this run has nothing new), Redis ends this run and
        begins that queue's in the same round trip (``_slice_result`` takes the replies). A
        trickling message on another queue of the worker then costs one round trip, not two."""
        watch = self.watch
        self._offered = plan.offered
        if watch is None:
            return
        pipe.execute_packed(switch_command(self.scripts.switch.sha, [self.k_state, self.k_next], plan, [
            self.epoch, self.pulled_to, self._commit_target(),
            *self._finish_call(SWITCH_END)[1], *self._begin_args(watch.token),
        ]))

    def _finish_call(self, end: LoopEnd) -> tuple[list[str], list[Any]]:
        raise NotImplementedError  # ConsumeRequest's: finish.lua's keys and arguments

    def _begin_args(self, token: str) -> list[Any]:
        raise NotImplementedError  # ConsumeRequest's: begin.lua's arguments

    def _commit_target(self) -> int:
        """The offset this run has committed once the commit it sends with its read (if any) is
        accepted: ``switch.lua`` switches only if the queue's state says so."""
        raise NotImplementedError  # ConsumeRequest's (and KeyConsumeRequest's)

    def _switch_refused(self, read: Any) -> None:
        """The commit sent before a lingering read was refused, or found the queue revoked, yet the
        read's ``switch.lua`` switched (it judges the state after the commit: appends during the
        read can make a queue refused as AHEAD look read to its end again). This run ends without
        taking the switch: its queue, now adopted by the watch, and the queue begun are both the
        watch's, whose ``release`` ends them with its token (``finish.lua``: a request for
        either if it has a backlog), not left to lapse."""
        switched = read.switched if isinstance(read, Slice) else None
        if switched is None or not int(switched[0]) or self.watch is None:
            return
        log.warning("the commit of %s for %s was refused but the lingering read had switched to %s; "
                    "both queues go back to the watch", self.mq.key, self.sub, self._offered[int(switched[0]) - 1].key)
        done = switched[1]
        self.watch.took_back(self.sub, self.mq, int(done[1]), backlog_in(done))

    def _slice_replies(self, replies: list[Any]) -> tuple[Any, Any, Any]:
        """(stream read, queue state, ``switch.lua``'s reply or None) of a lingering read's replies
        (``_queue_slice``). On a Redis Cluster the nudge stream came in a read of its own, merged
        here into the stream read (and no switch is offered there: no queue is adopted).

        ``switch.lua`` unknown to Redis (first use, a restart) ran nothing: it is loaded for the
        next read, and this one decides as if it had not been offered. Any other error raises."""
        switched = None
        if not self.lease.on_cluster and len(replies) > 2:
            switched = replies[2]
            if isinstance(switched, NoScriptError):
                self.scripts.load("switch")
                switched = None
            replies = replies[:2]
        for r in (*replies, switched):
            if isinstance(r, ResponseError):
                raise r
        if not self.lease.on_cluster:
            return replies[0], replies[1], switched
        read, state, nudges = replies[0], replies[1], replies[2]
        if not nudges:
            return read, state, None
        if isinstance(read, dict) or isinstance(nudges, dict):
            merged = dict(read.items()) if isinstance(read, dict) else {k: v for k, v in read or []}
            merged.update(nudges.items() if isinstance(nudges, dict) else {k: v for k, v in nudges})
            return merged, state, None
        return [*(read or []), *nudges], state, None

    def _slice_result(self, reply: Any, state: list[Any], switched: Any = None) -> Pull:
        """What one lingering read (``_queue_slice``) brought: messages of this queue, a switch to
        an adopted queue that got some, ``WAIT`` (nothing yet), ``NOTHING`` (reassigned: ending
        the run now hands the queue over, finish.lua) or ``LOST``.

        ``switched``: ``switch.lua``'s reply. When it switched, this run has ended in Redis and the
        queue it began runs next, whatever else the read says (its own queue had nothing new,
        and was still its own, when the script ran)."""
        me = self.client_id
        if switched is not None and int(switched[0]):
            self.switch_to = self._offered[int(switched[0]) - 1]
            self.switch_sub = self.sub
            self.pre_switched = (switched[1], switched[2])
            self._take_nudges(reply)
            return SWITCH
        owner, cur_epoch, pending, assignee = state
        if text(owner or b"") != me or int(cur_epoch or 0) != self.epoch or text(pending or b"") != self.token:
            log.warning("lingering request on %s for %s lost the queue (owner %r, epoch %s); stopping",
                        self.mq.key, self.sub, text(owner or b""), text(cur_epoch or b"0"))
            self.pq.dropped = True
            self.pq.clear()
            return LOST
        # (No ``pq.mark_locked()`` here: this read checked owner, epoch and token, not the lease,
        # which only a fenced commit or touch confirms. A slice behind a commit was confirmed by
        # it, ``_took``; after the local trust lapses, the next listener call touches first.)
        if assignee and text(assignee) != me:
            return NOTHING
        by_stream = self._take_nudges(reply)
        entries = by_stream.pop(self.k_log.encode(), None)
        if entries:
            self._put(entries, None)
            return Pull(PullKind.MESSAGES, len(entries))
        watch = self.watch
        if watch is not None:
            # An adopted queue whose doorbell rang (this read's, or one left from a read that
            # brought this queue's own messages), or whose renewal found a backlog.
            party = watch.next_rung(self.sub, self.mq)
            if party is not None:
                # The doorbell is only a signal: begin.lua reads the queue under the lock.
                return self._switch_to(party)
        return WAIT

    def _switch_to(self, party: Party) -> Pull:
        """End this run; the adopted queue ``party`` (of any group of the process) runs next."""
        self.switch_sub, self.switch_to = party[0], party[1]
        return SWITCH

    def _take_nudges(self, reply: Any) -> dict[bytes, Any]:
        """A lingering read's streams by key, this client's nudge stream taken out and heeded."""
        if not reply:
            return {}
        # RESP2 gives [[stream, entries], ...]; RESP3 gives {stream: entries}.
        by_stream = dict(reply.items()) if isinstance(reply, dict) else {k: v for k, v in reply}
        nudges = by_stream.pop(self.engine.nudge_key_b, None)
        if nudges:
            # A request waits for a slot (or an old nudge, seen once): may_linger() decides. Or a
            # queue of this client went idle: watch it from the next read on. Or an adopted queue
            # got a message: its doorbell.
            self.engine.nudge_seen = newest = text(nudges[-1][0])
            if self.watch is not None:
                self.watch.nudge_seen = newest
                went_idle, bells = read_nudges(nudges)
                if went_idle:
                    self.watch.adopt_soon(went_idle)
                if bells:
                    self.watch.ring(bells)
        return by_stream

    def _slice_pulled(self, read: Slice, nxt: int) -> Pull:
        """What the lingering read behind a commit brought (``_slice_result``). If it brought
        nothing of this queue although the commit saw its next offset (``nxt``) past what the run
        pulled, retention trimmed those messages (as for an empty ``XRANGE``)."""
        pulled = self._slice_result(read.reply, read.state, read.switched)
        # Only a read that looked at this queue's stream and found it empty (WAIT) says so: a
        # reassignment between the commit and the read's state check gives NOTHING without looking
        # at the entries the read did bring, and taking that for a trimmed tail committed past
        # messages nobody had consumed (the next owner started after them).
        if pulled.kind is PullKind.WAIT:
            self._check_trimmed_tail(nxt)
        return pulled

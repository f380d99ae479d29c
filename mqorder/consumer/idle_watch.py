"""``IdleQueueWatch``: a lingering ConsumeRequest watches every idle queue its client owns, in every group.

With fewer pool slots than owned queues (stock ``celery worker``: one slot per core, 8 queues per
worker), a request that lingers on its own drained queue leaves the worker's other idle queues to
the wake-up path: the producer publishes a wake-up, the worker's main process sends a Celery task,
and the task waits for a slot, which the lingering request gives back within a slice. Each step is
small, but together they put milliseconds, sometimes tens, between a send and its handling.

Instead the lingering request *adopts* the other idle queues its client owns on the same broker,
of every subscription this process has a listener for (``adopt.lua``: their pending slot takes
this watch's token, so a send wakes nobody). A send to an adopted queue rings the client's
doorbell instead: an entry naming the queue's state key in its nudge stream (``ring_doorbell`` in
``_append.lua``, for tokens marked ``DOORBELL_MARK``), which the lingering read blocks on beside
its own queue's log. The request then ends its own run and runs that queue next in the same task,
with that queue's listener, claiming it through ``begin.lua`` like any dispatched request (lock,
epoch, run mark: the same fencing). When the request stops lingering, ``release`` ends every
adoption through ``finish.lua`` with the same token, which also says who must consume a queue
that got messages meanwhile (a follow-up the caller dispatches).

Every group, not only the request's own: RocketMQ gives each consumer group threads of its own, a
Celery worker's few pool slots serve them all, and with a watch per group an operator's 60 groups
at a trickle on two stock workers cost a wake-up and a Celery task for nearly every message (p99
send to handle 0.8-6 s, where one group measures milliseconds). A doorbell, not a read of every
adopted queue's log: an ``XREAD`` blocking on the 240 queues a worker of those 60 groups adopts
cost Redis 0.6 ms per call, most of its CPU per message. A doorbell trimmed from the nudge stream
before it was read is made up for by the next renewal (``adopt.lua`` reports a backlog).

An adoption is an ordinary pending request with a short ``pend_until`` renewed while the request
lingers, so a process that dies while adopting costs at most ``ADOPT_TTL_MS`` plus a sweep on
those queues, never a lost message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from mqorder import keys
from mqorder.consumer.nudge import idle_entry
from mqorder.errors import BrokerUnavailableError
from mqorder.model import MessageQueue
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline, packed_args
from mqorder.store.replies import text
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: How often a lingering request adopts the idle queues it does not watch yet.
ADOPT_REFRESH_S = 0.2
#: pend_until of an adoption: what a crash while adopting can cost a queue before the send path or
#: the sweep dispatch it normally.
ADOPT_TTL_MS = 2000
#: How often the adoptions are renewed (each a script call): a third of their lease. Renewing them
#: all at every refresh cost a worker watching 240 queues of 60 groups 1,200 ``adopt.lua`` calls a
#: second, most of Redis's CPU at a trickle.
ADOPT_RENEW_S = ADOPT_TTL_MS / 1000 / 3
#: Pauses before ``release`` sends its ``finish.lua`` calls again after a connection error: the
#: same calls, so a first send that ran (its reply lost) answers the same (``finished_already``).
RELEASE_RETRY_PAUSES_S = (0.05, 0.25)
#: The errors after which ``release`` tries again: the calls may or may not have run.
_RETRIED = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError, BrokerUnavailableError)


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A ConsumeRequest to send after the run: (queue, target client, token, countdown in s, and
    the subscription it is of: a lingering run watches every group of its process)."""

    mq: MessageQueue
    target: str
    token: str
    countdown: float = 0.0
    #: The subscription of ``mq``; "" for the task's own (the run that made the follow-up's).
    sub: str = ""


def backlog_in(reply: Any) -> bool:
    """Whether an adoption's reply (``adopt.lua``'s {1, offset, next}, ``finish.lua``'s
    {'ADOPTED', offset, next}) says the queue holds messages past its committed offset: no
    doorbell rang for them, or it may have been trimmed unread."""
    return len(reply) > 2 and int(reply[2]) > int(reply[1])


#: One adopted queue: (its subscription, the queue, its committed offset when adopted).
Party = tuple[str, MessageQueue, int]
#: The first character of a watch's token: a send to a queue whose pending request is such a token
#: (and that is not running) rings its owner's doorbell (``ring_doorbell`` in ``_append.lua``).
DOORBELL_MARK = "!"


@dataclass(slots=True)
class ReadPlan:
    """What a lingering read of the run on (``sub``, ``exclude``) offers ``switch.lua``
    (``IdleQueueWatch.plan``). Not frozen (nothing changes one once made): one is made per
    trickling message, and a frozen dataclass sets each field through ``object.__setattr__``."""

    sub: str
    exclude: MessageQueue
    #: The adopted queues of ``exclude``'s topic and subscription, in the order ``switch.lua`` is
    #: given them, their four keys each (``_switch_keys``) and the committed offsets they were
    #: adopted at.
    offered: list[MessageQueue]
    keys: list[str]
    seen: list[int]
    #: The same keys and offsets packed (``raw_pipe.packed_args``), one piece per queue:
    #: ``switch.lua`` is offered behind every lingering read, and packing them anew cost more than
    #: any other part of that read's command (``LingeringReads._offer_switch``).
    key_segs: list[bytes]
    seen_segs: list[bytes]


class IdleQueueWatch:
    """The adopted idle queues of one task execution (one pool slot), on one broker: of every
    subscription ``owned`` names (each group of the process with a listener here)."""

    def __init__(
        self, client_id: str, sub: str, broker_name: str, scripts: Any, redis_client: Any,
        owned: Callable[[], list[tuple[str, MessageQueue]]], pending_ttl_ms: int, lock_ms: int,
    ) -> None:
        self.client_id = client_id
        #: The subscription of the task that made the watch (for its logs).
        self.sub = sub
        self.broker_name = broker_name
        self.scripts = scripts
        self.redis = redis_client
        #: (subscription, queue) of every queue this client owns and may watch.
        self._owned = owned
        self.pending_ttl_ms = pending_ttl_ms
        self.lock_ms = lock_ms
        #: The pending token of every adopted queue; a queue switched to runs with it. Its mark
        #: makes a send to an adopted queue ring this client's doorbell.
        self.token = DOORBELL_MARK + new_token()
        #: Adopted queues: (subscription, log stream key) -> (queue, committed offset when adopted).
        self.adopted: dict[tuple[str, str], tuple[MessageQueue, int]] = {}
        self._refreshed = 0.0
        self._renewed = 0.0
        #: ``plan``'s last answer: read on every lingering read, it changes only with the adopted
        #: queues (``_changed`` forgets it).
        self._plan: ReadPlan | None = None
        #: ``switch.lua``'s keys of each queue this watch adopted, by (subscription, log stream key),
        #: and the same four keys packed (``raw_pipe.packed_args``).
        self._keys: dict[tuple[str, str], tuple[tuple[str, str, str, str], bytes]] = {}
        #: Queues this client's other runs said went idle (``nudge.idle_entry``): adopted at the
        #: next read, without waiting for the next full refresh.
        self._soon: list[tuple[str, MessageQueue]] = []
        #: Adopted queues with news, in the order it came (an ordered set of ``adopted`` keys).
        self.rung: dict[tuple[str, str], None] = {}
        #: Where this watch reads the client's nudge stream from (``linger.LingeringReads``): its
        #: own, not the process's, so that two lingering requests of one process (the threads
        #: pool) each see every doorbell; and from the stream's end when the watch is made
        #: (``start_reading``), not from doorbells of queues other watches adopted before it.
        self.nudge_seen = "0-0"
        #: The ``adopted`` key of every queue this watch ever adopted, by its state key (``ring``):
        #: kept across changes (a doorbell of a queue let go since is skipped by ``next_rung``), so
        #: a switch, which changes ``adopted``, does not cost a pass over every adopted queue.
        self._by_state: dict[str, tuple[str, str]] = {}

    def _changed(self) -> None:
        self._plan = None

    def plan(self, sub: str, exclude: MessageQueue) -> ReadPlan:
        """What the lingering read of the run on (``sub``, ``exclude``) offers ``switch.lua``: the
        adopted queues of the run's own topic and subscription, with their keys and adopted
        offsets. (Any other adopted queue that gets a message rings the doorbell: ``ring``.)

        Made in one pass over the adopted queues, with each queue's keys spelled once per watch:
        at a trickle nearly every message switches the run to another queue, which changes the
        adopted queues, so the plan is remade once per message (``_changed``) and its cost is
        paid per message."""
        cached = self._plan
        if cached is not None and cached.exclude is exclude and cached.sub == sub:
            return cached
        offered: list[MessageQueue] = []
        ks: list[str] = []
        seen: list[int] = []
        key_segs: list[bytes] = []
        topic, own = exclude.topic, keys.queue_log(exclude.tag)
        for (psub, k), (mq, offset) in self.adopted.items():
            # A queue of another topic or group runs with its own listener and settings.
            if psub == sub and mq.topic == topic and k != own:
                offered.append(mq)
                four, seg = self._switch_keys(psub, k, mq)
                ks += four
                key_segs.append(seg)
                seen.append(offset)
        plan = self._plan = ReadPlan(sub, exclude, offered, ks, seen, key_segs, [packed_args((o,)) for o in seen])
        return plan

    def ring(self, state_keys: list[str]) -> None:
        """Doorbells read from the nudge stream: the adopted queues of these state keys got
        messages (``ring_doorbell`` in ``_append.lua``); ``next_rung`` hands them out in order.
        A state key of a queue this watch does not adopt (another watch's, or let go) is skipped."""
        by_state = self._by_state
        for sk in state_keys:
            hit = by_state.get(sk)
            if hit is not None:
                self.rung[hit] = None

    def next_rung(self, sub: str, running: MessageQueue) -> Party | None:
        """The first adopted queue with news (its doorbell rang, or a renewal found a backlog);
        None when there is none. (``sub``, ``running``): the caller's queue. It stays on the list
        until ``switched`` runs it: a switch that fails on a Redis error before it gets there
        (the run's last commit) leaves it for the retry, whose own doorbell was read already."""
        own = (sub, keys.queue_log(running.tag))
        while self.rung:
            key = next(iter(self.rung))
            hit = self.adopted.get(key)
            if hit is not None and key != own:
                return (key[0], hit[0], hit[1])
            del self.rung[key]  # let go since, or the caller's own: no news for the watch
        return None

    def start_reading(self, nudge_key: str, via: ConnectionLease | None = None) -> None:
        """Read the client's nudge stream from its newest entry on (one round trip, when a lingering
        request makes the watch): what is older belongs to watches before this one (a sibling
        process's queues, released since), each of which would cost a switch to an empty queue."""
        newest = RawPipeline(via or self.redis).execute_command("XREVRANGE", nudge_key, "+", "-", "COUNT", 1).execute()
        entries = newest[0] if newest else None
        if entries:
            self.nudge_seen = text(entries[0][0])

    def _switch_keys(self, sub: str, stream_key: str, mq: MessageQueue) -> tuple[tuple[str, str, str, str], bytes]:
        """``switch.lua``'s four keys of an adopted queue (state, log, next, retries), and packed,
        spelled once."""
        hit = self._keys.get((sub, stream_key))
        if hit is None:
            tag = mq.tag
            four = (keys.sub_state(tag, sub), stream_key, keys.queue_next(tag), keys.sub_retries(tag, sub))
            hit = self._keys[(sub, stream_key)] = (four, packed_args(four))
        return hit

    def refresh(self, running_sub: str, running: MessageQueue, via: ConnectionLease | None = None) -> None:
        """Adopt the idle owned queues not adopted yet (at most every ``ADOPT_REFRESH_S``) and renew
        the others (every ``ADOPT_RENEW_S``, when those the renewal refused are let go).
        (``running_sub``, ``running``): the caller's own queue, never adopted; ``via``: the
        caller's connection."""
        now = time.monotonic()
        mine = (running_sub, running)
        if now - self._refreshed < ADOPT_REFRESH_S:
            if self._soon:
                soon, self._soon = self._soon, []
                self._adopt([x for x in soon if x != mine], via, keep=True)
            return
        self._refreshed = now
        self._soon = []
        wanted = [(sub, mq) for sub, mq in self._owned() if mq.broker_name == self.broker_name and (sub, mq) != mine]
        if not wanted:
            self.adopted.clear()
            self._changed()
            return
        if now - self._renewed >= ADOPT_RENEW_S:
            self._renewed = now
            self._adopt(wanted, via)
            return
        adopted = self.adopted
        self._adopt([(sub, mq) for sub, mq in wanted if (sub, keys.queue_log(mq.tag)) not in adopted], via,
                    keep=True)

    def adopt_soon(self, went_idle: list[tuple[str, str]]) -> None:
        """Queues of this client that just went idle ((subscription, queue key), named in its nudge
        stream): adopt them at the next read. Only a try: ``adopt.lua`` takes a queue only if it
        is idle and this client's."""
        for sub, k in went_idle:
            try:
                mq = MessageQueue.from_key(k)
            except ValueError:
                continue
            if mq.broker_name == self.broker_name and (sub, keys.queue_log(mq.tag)) not in self.adopted:
                self._soon.append((sub, mq))

    def _adopt(self, wanted: list[tuple[str, MessageQueue]], via: ConnectionLease | None, keep: bool = False) -> None:
        """``adopt.lua`` on each of ``wanted`` in one round trip: adopt or renew. ``keep``: add to
        the adopted queues; otherwise (a full refresh) the queues it refused are no longer adopted."""
        if not wanted:
            return
        calls = [([keys.sub_state(mq.tag, sub), keys.queue_next(mq.tag)], [self.client_id, self.token, ADOPT_TTL_MS])
                 for sub, mq in wanted]
        replies = self.scripts.run_pipelined("adopt", calls, via)
        adopted: dict[tuple[str, str], tuple[MessageQueue, int]] = dict(self.adopted) if keep else {}
        by_state = self._by_state
        for (sub, mq), call, res in zip(wanted, calls, replies, strict=True):
            if int(res[0]):
                key = (sub, keys.queue_log(mq.tag))
                adopted[key] = (mq, int(res[1]))
                by_state[call[0][0]] = key
                if backlog_in(res):
                    # A backlog on a queue adopted already: its doorbell entry may have been
                    # trimmed from the nudge stream before it was read.
                    self.rung[key] = None
        self.adopted = adopted
        self._changed()

    def switched(self, left_sub: str, left: MessageQueue, to_sub: str, to: MessageQueue,
                 adopted_at: int | None, backlog: bool = False) -> None:
        """The caller's run on (``left_sub``, ``left``) ended and (``to_sub``, ``to``) runs next with
        this watch's token: ``to``'s run ends its adoption. ``adopted_at``: the committed offset
        ``left`` was handed to this watch at, in the same step that ended its run (``finish.lua``
        'adopt'), so no send to it falls between the two; None when it was not (no longer the
        caller's: the next full refresh finds out again). ``backlog``: ``left`` had messages past
        ``adopted_at`` when it was handed over, stored while its run held it (no doorbell rang)."""
        to_key = (to_sub, keys.queue_log(to.tag))
        self.adopted.pop(to_key, None)
        self.rung.pop(to_key, None)
        if adopted_at is None:
            self._changed()
            return
        plan = self._plan
        before = len(self.adopted)
        key = self._hand_over(left_sub, left, adopted_at)
        left_new = len(self.adopted) > before  # (its key spelled once, by ``_hand_over``)
        # A doorbell of ``left`` read beside its run's own messages is no news any more.
        self.rung.pop(key, None)
        if backlog:
            self.rung[key] = None
        self._plan = self._plan_after(plan, key, left, to_key, to, adopted_at) if left_new else None

    def _plan_after(self, plan: ReadPlan | None, left_key: tuple[str, str], left: MessageQueue,
                    to_key: tuple[str, str], to: MessageQueue, adopted_at: int) -> ReadPlan | None:
        """``plan`` (the run on ``left``'s) made into the plan of the run on ``to`` that follows it,
        without a pass over the adopted queues: ``to`` leaves the offer and ``left``, handed over at
        ``adopted_at`` and new to ``adopted`` (so last in its order), joins it. What ``plan``
        would make from ``adopted`` now, in the same order; None (``plan`` makes it) unless the
        two runs are of one subscription and topic and ``plan`` was ``left``'s and offered ``to``.

        Why: at a trickle nearly every message is such a switch, and remaking the plan was the
        largest single piece of the engine's Python per message (a pass over every adopted queue,
        seven on a stock worker; 240 for one watching 60 groups)."""
        sub = left_key[0]
        to_sub, to_log = to_key
        # (Two groups may adopt one queue: only a switch within the plan's own group keeps it.)
        if plan is None or plan.exclude is not left or plan.sub != sub or to_sub != sub or to.topic != left.topic:
            return None
        # Found by its log key, compared in C (each queue's four keys in a row, the log second;
        # ``list.index`` of the queue itself ran the dataclass's ``__eq__`` on those before it).
        try:
            at = plan.keys.index(to_log)
        except ValueError:
            return None
        i, second = divmod(at, 4)
        if second != 1 or plan.offered[i] is not to:
            return None
        offered = [*plan.offered[:i], *plan.offered[i + 1:], left]
        four, seg = self._switch_keys(sub, left_key[1], left)
        ks = [*plan.keys[:4 * i], *plan.keys[4 * i + 4:], *four]
        seen = [*plan.seen[:i], *plan.seen[i + 1:], adopted_at]
        key_segs = [*plan.key_segs[:i], *plan.key_segs[i + 1:], seg]
        seen_segs = [*plan.seen_segs[:i], *plan.seen_segs[i + 1:], packed_args((adopted_at,))]
        return ReadPlan(sub, to, offered, ks, seen, key_segs, seen_segs)

    def took_back(self, sub: str, mq: MessageQueue, adopted_at: int, backlog: bool = False) -> None:
        """``mq`` was handed to this watch at ``adopted_at`` (``switch.lua`` ended its run) although
        the caller does not go on to the queue that switch began, which stays adopted too: both
        are ended by ``release``. ``backlog``: as for ``switched``."""
        key = self._hand_over(sub, mq, adopted_at)
        if backlog:
            self.rung[key] = None
        self._changed()

    def _hand_over(self, sub: str, mq: MessageQueue, adopted_at: int) -> tuple[str, str]:
        """``mq`` (of ``sub``) adopted at ``adopted_at`` by a run's end, not by ``_adopt``: its key,
        and its state key known to ``ring`` (the task's first queue was never adopted before)."""
        tag = mq.tag
        key = (sub, keys.queue_log(tag))
        self.adopted[key] = (mq, adopted_at)
        self._by_state[keys.sub_state(tag, sub)] = key
        return key

    def release(self, via: ConnectionLease | None = None) -> list[FollowUp]:
        """End every adoption (``finish.lua``, action done): an idle queue gets its pending slot
        back; one that got messages meanwhile gets a new request, returned for the caller to send.

        Each call's new token is drawn once, and after a connection error the same calls are sent
        again (``RELEASE_RETRY_PAUSES_S``): a call that ran before its reply was lost answers the
        same request again (``finished_already``). Once a bug: the first send's tokens were the
        queues' pending ones, nobody sent their requests, and a queue that got messages while
        adopted waited out ``pending_ttl_ms`` and a sweep. Raises the last error if every try
        failed (the caller logs it: those queues wait for the sweep)."""
        if not self.adopted:
            return []
        items = [(sub, mq) for (sub, _), (mq, _) in self.adopted.items()]
        self.adopted = {}
        self.rung.clear()
        self._changed()
        calls = [([keys.sub_state(mq.tag, sub), keys.queue_next(mq.tag)],
                  [self.client_id, self.token, "done", new_token(), self.pending_ttl_ms, self.lock_ms])
                 for sub, mq in items]
        for pause in (*RELEASE_RETRY_PAUSES_S, None):
            try:
                replies = self.scripts.run_pipelined("finish", calls, via)
                break
            except _RETRIED as exc:
                if pause is None:
                    raise
                log.info("ending the adoptions of %s: %s; sending the same calls again in %.2f s",
                         self.sub, exc, pause)
                time.sleep(pause)
        out: list[FollowUp] = []
        went_idle: list[tuple[str, str]] = []
        for (sub, mq), res in zip(items, replies, strict=True):
            verb = text(res[0])
            if verb in ("REQUEUE", "HANDOVER", "DISPATCH"):
                out.append(FollowUp(mq, text(res[1]), text(res[2]), sub=sub))
            elif verb == "IDLE":
                went_idle.append((sub, mq.key))
        if went_idle:
            # Another lingering request of this client may watch them now (nudge.idle_entry). Only
            # a hint: its error must not lose the follow-ups above (the next refresh finds them).
            try:
                RawPipeline(via or self.redis).execute_command(*idle_entry(self.client_id, went_idle)).execute()
            except _RETRIED as exc:
                log.debug("no idle nudge for %s: %s", went_idle, exc)
        return out

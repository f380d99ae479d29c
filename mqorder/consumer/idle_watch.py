"""``IdleQueueWatch``: a lingering ConsumeRequest waits on every idle queue its client owns.

With fewer pool slots than owned queues (stock ``celery worker``: one slot per core, 8 queues per
worker), a request that lingers on its own drained queue leaves the worker's other idle queues to
the wake-up path: the producer publishes a wake-up, the worker's main process sends a Celery task,
and the task waits for a slot, which the lingering request gives back within a slice. Each step is
small, but together they put milliseconds, sometimes tens, between a send and its handling.

Instead the lingering request *adopts* the other idle queues of its subscription on the same
broker (``adopt.lua``: their pending slot takes this watch's token, so a send wakes nobody), reads
all of them in its one blocking ``XREAD``, and when one gets a message it ends its own run and
runs that queue next in the same task, claiming it through ``begin.lua`` like any dispatched
request (lock, epoch, run mark: the same fencing). When the request stops lingering, ``release``
ends every adoption through ``finish.lua`` with the same token, which also says who must consume a
queue that got messages meanwhile (a follow-up the caller dispatches).

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
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline
from mqorder.store.replies import text
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: How often a lingering request re-adopts: new idle queues, and the renewal of its adoptions.
ADOPT_REFRESH_S = 0.2
#: pend_until of an adoption, renewed every refresh: what a crash while adopting can cost a queue
#: before the send path or the sweep dispatch it normally.
ADOPT_TTL_MS = 2000
#: Pauses before ``release`` sends its ``finish.lua`` calls again after a connection error: the
#: same calls, so a first send that ran (its reply lost) answers the same (``finished_already``).
RELEASE_RETRY_PAUSES_S = (0.05, 0.25)
#: The errors after which ``release`` tries again: the calls may or may not have run.
_RETRIED = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError, BrokerUnavailableError)


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A ConsumeRequest to send after the run: (queue, target client, token, countdown in s)."""

    mq: MessageQueue
    target: str
    token: str
    countdown: float = 0.0


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """The adopted queues a lingering read of the run on ``exclude`` names (``IdleQueueWatch.plan``)."""

    exclude: MessageQueue
    #: Stream keys and ``XREAD`` ids of every adopted queue but ``exclude``.
    names: list[str]
    ids: list[str]
    #: The adopted queues of ``exclude``'s topic, in the order ``switch.lua`` is given them, their
    #: four keys each (``_switch_keys``) and the committed offsets they were adopted at.
    offered: list[MessageQueue]
    keys: list[str]
    seen: list[int]


class IdleQueueWatch:
    """The adopted idle queues of one task execution (one pool slot), on one broker."""

    def __init__(
        self, client_id: str, sub: str, broker_name: str, scripts: Any, redis_client: Any,
        owned: Callable[[], list[MessageQueue]], pending_ttl_ms: int, lock_ms: int,
    ) -> None:
        self.client_id = client_id
        self.sub = sub
        self.broker_name = broker_name
        self.scripts = scripts
        self.redis = redis_client
        self._owned = owned
        self.pending_ttl_ms = pending_ttl_ms
        self.lock_ms = lock_ms
        #: The pending token of every adopted queue; a queue switched to runs with it.
        self.token = new_token()
        #: Adopted queues: log stream key -> (queue, committed offset when adopted).
        self.adopted: dict[str, tuple[MessageQueue, int]] = {}
        self._refreshed = 0.0
        #: ``plan``'s last answer: read on every lingering read, it changes only with the adopted
        #: queues (``_changed`` forgets it).
        self._plan: ReadPlan | None = None
        #: ``switch.lua``'s keys of each queue this watch adopted, by log stream key.
        self._keys: dict[str, tuple[str, str, str, str]] = {}
        #: Queues this client's other runs said went idle (``nudge.idle_entry``): adopted at the
        #: next read, without waiting for the next full refresh.
        self._soon: list[MessageQueue] = []

    def _changed(self) -> None:
        self._plan = None

    def plan(self, exclude: MessageQueue) -> ReadPlan:
        """What the lingering read of the run on ``exclude`` names from this watch: every adopted
        queue but ``exclude`` (its stream and ``XREAD`` id), and those of ``exclude``'s topic that
        ``switch.lua`` may switch to, with their keys and adopted offsets.

        Made in one pass over the adopted queues, with each queue's keys spelled once per watch:
        at a trickle nearly every message switches the run to another queue, which changes the
        adopted queues, so the plan is remade once per message (``_changed``) and its cost is
        paid per message."""
        cached = self._plan
        if cached is not None and cached.exclude is exclude:
            return cached
        names: list[str] = []
        ids: list[str] = []
        offered: list[MessageQueue] = []
        ks: list[str] = []
        seen: list[int] = []
        topic, own = exclude.topic, keys.queue_log(exclude.tag)
        for k, (mq, offset) in self.adopted.items():
            if k == own:
                continue
            names.append(k)
            ids.append(f"{offset - 1}-1" if offset > 0 else "0-0")
            # A queue of another topic of the subscription runs with its own listener and settings.
            if mq.topic == topic:
                offered.append(mq)
                ks += self._switch_keys(k, mq)
                seen.append(offset)
        plan = self._plan = ReadPlan(exclude, names, ids, offered, ks, seen)
        return plan

    def _switch_keys(self, stream_key: str, mq: MessageQueue) -> tuple[str, str, str, str]:
        """``switch.lua``'s four keys of an adopted queue (state, log, next, retries), spelled once."""
        ks = self._keys.get(stream_key)
        if ks is None:
            tag = mq.tag
            ks = self._keys[stream_key] = (keys.sub_state(tag, self.sub), stream_key, keys.queue_next(tag),
                                           keys.sub_retries(tag, self.sub))
        return ks

    def queue_of(self, stream_key: str) -> MessageQueue | None:
        hit = self.adopted.get(stream_key)
        return hit[0] if hit else None

    def refresh(self, running: MessageQueue, via: ConnectionLease | None = None) -> None:
        """Adopt the idle owned queues not adopted yet and renew the others (at most every
        ``ADOPT_REFRESH_S``). ``running``: the caller's own queue, never adopted; ``via``: the
        caller's connection."""
        now = time.monotonic()
        if now - self._refreshed < ADOPT_REFRESH_S:
            if self._soon:
                soon, self._soon = self._soon, []
                self._adopt([mq for mq in soon if mq != running], via, keep=True)
            return
        self._refreshed = now
        self._soon = []
        wanted = [mq for mq in self._owned() if mq.broker_name == self.broker_name and mq != running]
        if not wanted:
            self.adopted.clear()
            self._changed()
            return
        self._adopt(wanted, via)

    def adopt_soon(self, mq_keys: list[str]) -> None:
        """Queues of this client that just went idle (named in its nudge stream): adopt them at the
        next read. Only a try: ``adopt.lua`` takes a queue only if it is idle and this client's."""
        for k in mq_keys:
            try:
                mq = MessageQueue.from_key(k)
            except ValueError:
                continue
            if mq.broker_name == self.broker_name and keys.queue_log(mq.tag) not in self.adopted:
                self._soon.append(mq)

    def _adopt(self, wanted: list[MessageQueue], via: ConnectionLease | None, keep: bool = False) -> None:
        """``adopt.lua`` on each of ``wanted`` in one round trip: adopt or renew. ``keep``: add to
        the adopted queues; otherwise (a full refresh) the queues it refused are no longer adopted."""
        if not wanted:
            return
        replies = self.scripts.run_pipelined("adopt", [
            ([keys.sub_state(mq.tag, self.sub), keys.queue_next(mq.tag)], [self.client_id, self.token, ADOPT_TTL_MS])
            for mq in wanted
        ], via)
        adopted: dict[str, tuple[MessageQueue, int]] = dict(self.adopted) if keep else {}
        for mq, res in zip(wanted, replies, strict=True):
            if int(res[0]):
                adopted[keys.queue_log(mq.tag)] = (mq, int(res[1]))
        self.adopted = adopted
        self._changed()

    def switched(self, left: MessageQueue, to: MessageQueue, adopted_at: int | None) -> None:
        """The caller's run on ``left`` ended and ``to`` runs next with this watch's token: ``to``'s
        run ends its adoption. ``adopted_at``: the committed offset ``left`` was handed to this
        watch at, in the same step that ended its run (``finish.lua`` 'adopt'), so no send to it
        falls between the two; None when it was not (no longer the caller's: the next full
        refresh finds out again)."""
        self.adopted.pop(keys.queue_log(to.tag), None)
        if adopted_at is not None:
            self.adopted[keys.queue_log(left.tag)] = (left, adopted_at)
        self._changed()

    def took_back(self, mq: MessageQueue, adopted_at: int) -> None:
        """``mq`` was handed to this watch at ``adopted_at`` (``switch.lua`` ended its run) although
        the caller does not go on to the queue that switch began, which stays adopted too: both
        are ended by ``release``."""
        self.adopted[keys.queue_log(mq.tag)] = (mq, adopted_at)
        self._changed()

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
        items = list(self.adopted.values())
        self.adopted = {}
        self._changed()
        calls = [([keys.sub_state(mq.tag, self.sub), keys.queue_next(mq.tag)],
                  [self.client_id, self.token, "done", new_token(), self.pending_ttl_ms, self.lock_ms])
                 for mq, _ in items]
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
        out, went_idle = [], []
        for (mq, _), res in zip(items, replies, strict=True):
            verb = text(res[0])
            if verb in ("REQUEUE", "HANDOVER", "DISPATCH"):
                out.append(FollowUp(mq, text(res[1]), text(res[2])))
            elif verb == "IDLE":
                went_idle.append(mq.key)
        if went_idle:
            # Another lingering request of this client may watch them now (nudge.idle_entry). Only
            # a hint: its error must not lose the follow-ups above (the next refresh finds them).
            try:
                RawPipeline(via or self.redis).execute_command(*idle_entry(self.client_id, went_idle)).execute()
            except _RETRIED as exc:
                log.debug("no idle nudge for %s: %s", went_idle, exc)
        return out

"""The vocabulary of a consume run: what a run's loop, its reads and its end say to each other.

``ConsumeRequest`` and its key-ordered and concurrent variants, the ``ConsumerEngine`` that runs
them and the Celery task that dispatches their ``Outcome`` all speak these types; they live here,
below all of them, so that none of those modules has to import another one back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from mqorder.consumer.idle_watch import FollowUp
from mqorder.model import ConsumeOrderlyStatus, MessageQueue

SUCCESS = ConsumeOrderlyStatus.SUCCESS
SUSPEND = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
COMMIT = ConsumeOrderlyStatus.COMMIT
ROLLBACK = ConsumeOrderlyStatus.ROLLBACK

#: RocketMQ re-submits after the time budget 10 ms later, and after a failed lock 100 ms later.
BUDGET_REQUEUE_S = 0.01
#: A run whose new epoch no replica acknowledged in time (``lock_wait_replicas``) ends and is
#: dispatched again this much later, as RocketMQ retries a failed lock (its 100 ms, here 1 s: the
#: replicas are lagging or gone, and each attempt already waited ``lock_wait_timeout_ms``).
REPLICA_WAIT_REQUEUE_S = 1.0

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
    #: The lingering read found messages on another adopted queue (``PullKind.SWITCH``): end the run
    #: and hand this queue to the watch in the same step (``finish.lua`` 'adopt').
    SWITCH = "adopt"


@dataclass(frozen=True, slots=True)
class LoopEnd:
    """How a run's consume loop ended, and after how long (s) a re-queued run goes on."""

    stop: Stop
    countdown: float = 0.0


#: The end of a run that switches to another queue: made once (frozen), as a lingering read offers
#: a switch behind every read at a trickle and most of those runs end so.
SWITCH_END = LoopEnd(Stop.SWITCH)


class PullKind(StrEnum):
    """What a fenced commit-and-pull, or a lingering read, came back with (``Pull.kind``)."""

    #: ``Pull.count`` new messages are in the run's ProcessQueue (0: none).
    MESSAGES = "messages"
    #: The run no longer holds its queue (stop, fenced).
    LOST = "lost"
    #: The commit ended the run on a drained queue (``commit.lua`` IDLE).
    ENDED = "ended"
    #: The lingering read found messages on another idle queue of this client
    #: (``ConsumeRequest.switch_to``): end this run, run that one.
    SWITCH = "switch"
    #: A lingering read ended with nothing for this run (its slice ran out, or a nudge): the
    #: linger may go on.
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class Pull:
    """What a fenced commit-and-pull, or a lingering read, brought back: one ``kind``, and for
    ``MESSAGES`` how many."""

    kind: PullKind = PullKind.MESSAGES
    count: int = 0


LOST = Pull(PullKind.LOST)
ENDED = Pull(PullKind.ENDED)
NOTHING = Pull()
SWITCH = Pull(PullKind.SWITCH)
WAIT = Pull(PullKind.WAIT)


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


@dataclass(slots=True)
class Outcome:
    """What the caller must do after a run: ``verb``, the client to dispatch to, token, countdown (s).

    Not frozen (nothing changes one after it is made; ``dataclasses.replace`` makes another): at a
    trickle two are made per message (the run that switches, and the end of the run it left), and
    a frozen dataclass's ``__init__`` sets each of its eight fields through ``object.__setattr__``
    (about 1.9 µs a call here, against 0.7-0.9 µs; with ``Slice`` and ``ReadPlan`` unfrozen too, a
    trickling message cost the engine 6 % fewer instructions, callgrind).
    """

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
    #: The subscription of ``queue`` when it is not the task's own (a switch to another group's).
    sub: str | None = None

    @property
    def needs_dispatch(self) -> bool:
        return self.verb in (Verb.REQUEUE, Verb.HANDOVER, Verb.DISPATCH)


@dataclass(slots=True)
class Slice:
    """The replies of a lingering read that rode on a commit (``XREAD``, then the queue's state,
    then ``switch.lua``'s reply when the read offered a switch, else None). Not frozen, as
    ``Outcome``: one is made per trickling message."""

    reply: Any
    state: list[Any]
    switched: Any = None

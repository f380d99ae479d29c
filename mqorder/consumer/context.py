"""What a listener may read and set during one call: ``ConsumeOrderlyContext`` and
``ConsumeConcurrentlyContext`` (RocketMQ's), on one base that carries the fencing epoch."""

from __future__ import annotations

import logging
from collections.abc import Callable

from mqorder.consumer.async_loop import offload
from mqorder.model import MessageQueue

log = logging.getLogger(__name__)

#: The bounds RocketMQ puts on a suspend time a listener set on its context
#: (``ConsumeMessageOrderlyService.submitConsumeRequestLater``): below, a hot retry loop that
#: reaches the DLQ at once; above, a queue stalled for as long as the listener wrote.
MIN_SUSPEND_MS, MAX_SUSPEND_MS = 10, 30_000


def suspend_ms_of(value: object, default_ms: int, who: str = "the listener") -> int:
    """The suspend a listener's context asks for, as RocketMQ takes it: ``-1`` (RocketMQ's "the
    consumer's default") or anything but a number is ``default_ms``; a number is clamped to
    ``[MIN_SUSPEND_MS, MAX_SUSPEND_MS]``. ``None`` once raised out of the run after the reconsume
    count was saved, leaving the queue to the sweep. Anything but a number is logged (naming
    ``who``), as a bad ``ack_index`` is: "abc" was taken for the default without a word."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        log.warning("%s set suspend_current_queue_time_millis to %r, not a number of milliseconds; suspending "
                    "%d ms (the default)", who, value, default_ms)
        return default_ms
    if value == -1:
        return default_ms
    return int(min(max(value, MIN_SUSPEND_MS), MAX_SUSPEND_MS))


class CallContext:
    """What every listener call gets: its queue, the fencing epoch, who runs it, and ``still_owner()``.

    ``epoch`` is the lock epoch this call runs under. ``still_owner()`` asks Redis (one cheap
    script) whether the epoch is still current: a listener writing to another system can pass the
    epoch along, or check before an irreversible write, so a holder that was paused past its lease
    fences its own side effects too.

    The answer is Redis's at the moment it ran the check, somewhere between the call and its
    return; it cannot say anything about later. A process paused right after Redis answered (the
    reply waiting in its socket) or right after the call returned acts on a True that may be stale
    by then: the keys-sigstop-lease chaos run caught one asked 1 ms before a SIGSTOP and read
    10 s later, after another client had taken the queue. ``still_owner()`` narrows the window;
    only the epoch, checked by the other system in the same step as the write, closes it, as the
    fenced commit does in Redis.
    """

    __slots__ = (
        "message_queue",
        "suspend_current_queue_time_millis",
        "epoch",
        "client_id",
        "group",
        "run_id",
        "failure",
        "_still_owner",
    )

    def __init__(
        self,
        message_queue: MessageQueue,
        *,
        epoch: int,
        client_id: str,
        group: str,
        still_owner: Callable[[], bool],
        suspend_current_queue_time_millis: int,
        run_id: str = "",
    ) -> None:
        self.message_queue = message_queue
        self.suspend_current_queue_time_millis = suspend_current_queue_time_millis
        self.epoch = epoch
        self.client_id = client_id
        self.group = group
        #: Unique per ConsumeRequest run (a redelivery after a failover comes from another run).
        self.run_id = run_id
        #: ``"<ExceptionType>: <message>"`` when the listener raised in this call, else "": the
        #: engine records the last one with the reconsume count (``mqorder status --key`` shows it).
        self.failure = ""
        self._still_owner = still_owner

    def still_owner(self) -> bool:
        return self._still_owner()

    async def still_owner_async(self) -> bool:
        """``still_owner()`` for an ``async def`` listener: the Redis round trip runs off the
        event loop (a worker thread; under gevent a greenlet of the hub), so the other calls of
        the process go on meanwhile. It runs on whichever loop awaits it: the worker's, or a unit
        test's own (``asyncio.run(listener(msgs, ctx))``)."""
        return bool(await offload(self._still_owner))


class ConsumeOrderlyContext(CallContext):
    """RocketMQ's ``ConsumeOrderlyContext`` (``auto_commit``, the suspend time) plus the epoch."""

    __slots__ = ("auto_commit",)

    def __init__(
        self,
        message_queue: MessageQueue,
        *,
        epoch: int,
        client_id: str,
        group: str,
        still_owner: Callable[[], bool],
        suspend_current_queue_time_millis: int,
        auto_commit: bool = True,
        run_id: str = "",
    ) -> None:
        # Made once per listener call on the hot path (batch 1: once per message): the fields are
        # set here rather than through ``super().__init__``, which costs a call with keywords.
        self.message_queue = message_queue
        self.suspend_current_queue_time_millis = suspend_current_queue_time_millis
        self.epoch = epoch
        self.client_id = client_id
        self.group = group
        self.run_id = run_id
        self.failure = ""  # CallContext.failure
        self._still_owner = still_owner
        self.auto_commit = auto_commit

    def __repr__(self) -> str:
        return (
            f"ConsumeOrderlyContext(mq={self.message_queue.key}, epoch={self.epoch}, "
            f"auto_commit={self.auto_commit}, suspend_ms={self.suspend_current_queue_time_millis})"
        )


class ConsumeConcurrentlyContext(CallContext):
    """RocketMQ's ``ConsumeConcurrentlyContext`` plus the fencing epoch.

    ``ack_index``: with ``CONSUME_SUCCESS``, the messages up to this index (inclusive) succeeded
    and the ones after it are sent back for retry (RocketMQ's partial acknowledgement); it starts
    at the last index, so a plain ``CONSUME_SUCCESS`` acknowledges the whole batch.
    ``delay_level_when_next_consume``: 0 lets the retry count choose (RocketMQ: level 3 +
    reconsume times), a level from 1 picks that delay, -1 sends the failed messages straight to
    the DLQ. ``suspend_current_queue_time_millis`` matters to broadcasting listeners only, which
    retry in place (their failed messages do not go to the group's retry topic, which every
    client of the group would read).
    """

    __slots__ = ("ack_index", "delay_level_when_next_consume")

    def __init__(
        self,
        message_queue: MessageQueue,
        *,
        epoch: int,
        client_id: str,
        group: str,
        still_owner: Callable[[], bool],
        ack_index: int,
        suspend_current_queue_time_millis: int,
        run_id: str = "",
    ) -> None:
        super().__init__(message_queue, epoch=epoch, client_id=client_id, group=group, still_owner=still_owner,
                         suspend_current_queue_time_millis=suspend_current_queue_time_millis, run_id=run_id)
        self.ack_index = ack_index
        self.delay_level_when_next_consume = 0

    def __repr__(self) -> str:
        return (
            f"ConsumeConcurrentlyContext(mq={self.message_queue.key}, epoch={self.epoch}, "
            f"ack_index={self.ack_index}, delay_level={self.delay_level_when_next_consume})"
        )

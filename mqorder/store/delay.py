"""Delay messages (RocketMQ's ``delay_time_level``): held beside their queue's log until due.

RocketMQ rewrites a delayed message into ``SCHEDULE_TOPIC_XXXX`` (one queue per level) and a timer
per level copies due messages back to their real topic. Here a delayed message waits in its target
queue's schedule (``delay_schedule.lua``: a ZSET by due time and a HASH of the messages, in the
queue's hash tag), where no consumer reads, and ``DelayMover.move_once`` (a duty of every
worker's ``ClientInstance``, or any loop of an application without workers) appends every due one to the log in one
atomic step per queue (``delay_move.lua``, through the one append path), in due order and, for
equal due times, in send order. Its offset is the one it gets when it becomes visible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.append import QueueAppender
from mqorder.store.broker_steps import BrokerSteps
from mqorder.store.brokers import Broker, BrokerRegistry, group_by_broker
from mqorder.store.failures import translated
from mqorder.store.indexed import run_indexed
from mqorder.store.replies import text

log = logging.getLogger(__name__)

#: Messages made visible per queue per script call (the mover calls again while some are due).
MOVE_CHUNK = 500


@dataclass
class MoveReport:
    moved: int = 0
    queues: int = 0


class DelayStore:
    def __init__(self, brokers: BrokerRegistry, appender: QueueAppender, *, timeout: float) -> None:
        self.brokers = brokers
        self.appender = appender
        self.timeout = timeout

    def schedule(self, mq: MessageQueue, header: bytes, body: bytes, delay_ms: int, *, guard: bool = True,
                 dedup_id: str | None = None, dedup_ms: int = 0) -> int:
        """Hold the message until now + ``delay_ms`` (Redis clock); returns its due time (ms).

        The queue is recorded for the mover *first*, so no delayed message is ever out of its sight.
        ``guard=False`` skips the capacity guard: a consumer sending a failed message back to its
        retry topic moves a message, it does not add one (like a DLQ move, never refused).
        ``dedup_id``: a second call with it within ``dedup_ms`` stores nothing and returns the
        first call's due time.
        """
        broker = self.brokers.get(mq.broker_name)
        tag = mq.tag
        kl = [keys.delay_schedule(tag), keys.delay_messages(tag), keys.delay_seq(tag)]
        args: list[object] = [delay_ms, header, body]
        if dedup_id is not None:
            kl.append(keys.delay_dedup(tag, dedup_id))
            args.append(dedup_ms)
        with translated(broker.name, broker.safe_url, self.timeout):
            if guard:
                self.appender.check_capacity(broker)
            reply = run_indexed(self.brokers, keys.delay_queues(), mq.key, broker, "delay_schedule", kl, args)
        return int(reply[0])

    def waiting(self, mq: MessageQueue) -> int:
        """Delayed messages of ``mq`` not visible yet."""
        return int(self.brokers.get(mq.broker_name).client.zcard(keys.delay_schedule(mq.tag)))


class DelayMover:
    """Makes due delayed messages visible; safe to run in several places at once (each message is
    moved by exactly one ``delay_move.lua`` call)."""

    def __init__(self, brokers: BrokerRegistry, appender: QueueAppender) -> None:
        self.brokers = brokers
        self.appender = appender
        #: Index entries already warned about (once per process, not on every pass).
        self._skipped: set[str] = set()

    def move_once(self) -> MoveReport:
        """One pass over every queue holding delayed messages. A stale entry of the index (a queue
        of a broker no longer configured, a malformed key) is skipped with one warning, and a broker
        that fails skips only its own queues (``BrokerSteps``): either once stopped every queue
        after it from moving, on every pass, for good."""
        report = MoveReport()
        queues = []
        known = set(self.brokers.names)
        for raw in self.brokers.meta.smembers(keys.delay_queues()):
            key = text(raw)
            try:
                mq = MessageQueue.from_key(key)
            except ValueError:
                self._skip(key, "it is not a queue key")
                continue
            if mq.broker_name not in known:
                self._skip(key, f"its broker {mq.broker_name!r} is not configured (MQORDER_BROKERS); its delayed "
                                "messages move once it is")
                continue
            queues.append(mq)
        steps = BrokerSteps("delay mover")
        for broker_name, mqs in group_by_broker(sorted(queues)).items():
            with steps.of(broker_name):
                self._move(self.brokers.get(broker_name), mqs, report)
        steps.settle()
        return report

    def _skip(self, key: str, why: str) -> None:
        if key not in self._skipped:
            self._skipped.add(key)
            log.warning("delay mover: skipping %r in %s: %s", key, keys.delay_queues(), why)

    def _move(self, broker: Broker, mqs: list[MessageQueue], report: MoveReport) -> None:
        todo = list(mqs)
        while todo:
            replies = broker.scripts.run_pipelined("delay_move", [self._call(mq) for mq in todo])
            again = []
            for mq, reply in zip(todo, replies, strict=True):
                moved = int(reply[0])
                report.moved += moved
                report.queues += 1 if moved else 0
                if moved == MOVE_CHUNK:
                    again.append(mq)
            todo = again

    def _call(self, mq: MessageQueue) -> tuple[list[str], list[object]]:
        tag = mq.tag
        state_keys, wake_args = self.appender.wake_tail(mq)
        kl = [keys.delay_schedule(tag), keys.delay_messages(tag), keys.queue_log(tag), keys.queue_next(tag),
              *state_keys]
        return kl, [MOVE_CHUNK, self.appender.pending_ttl_ms, self.appender.wake_prefix(mq), *wake_args]

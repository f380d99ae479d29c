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

from dataclasses import dataclass

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.failures import translated
from mqorder.store.indexed import run_indexed
from mqorder.store.replies import text

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

    def schedule(self, mq: MessageQueue, header: bytes, body: bytes, delay_ms: int, *, guard: bool = True) -> int:
        """Hold the message until now + ``delay_ms`` (Redis clock); returns its due time (ms).

        The queue is recorded for the mover *first*, so no delayed message is ever out of its sight.
        ``guard=False`` skips the capacity guard: a consumer sending a failed message back to its
        retry topic moves a message, it does not add one (like a DLQ move, never refused).
        """
        broker = self.brokers.get(mq.broker_name)
        tag = mq.tag
        with translated(broker.name, broker.safe_url, self.timeout):
            if guard:
                self.appender.check_capacity(broker)
            reply = run_indexed(self.brokers, keys.delay_queues(), mq.key, broker, "delay_schedule",
                                [keys.delay_schedule(tag), keys.delay_messages(tag), keys.delay_seq(tag)],
                                [delay_ms, header, body])
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

    def move_once(self) -> MoveReport:
        report = MoveReport()
        queues = sorted(MessageQueue.from_key(text(k)) for k in self.brokers.meta.smembers(keys.delay_queues()))
        for broker_name, mqs in group_by_broker(queues).items():
            broker = self.brokers.get(broker_name)
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
        return report

    def _call(self, mq: MessageQueue) -> tuple[list[str], list[object]]:
        tag = mq.tag
        state_keys, wake_args = self.appender.wake_tail(mq)
        kl = [keys.delay_schedule(tag), keys.delay_messages(tag), keys.queue_log(tag), keys.queue_next(tag),
              *state_keys]
        return kl, [MOVE_CHUNK, self.appender.pending_ttl_ms, self.appender.wake_prefix(mq), *wake_args]

"""``RetrySender``: RocketMQ's ``sendMessageBack`` for concurrent listeners.

A message a concurrent listener did not acknowledge is not retried in place (that would hold its
offset, and with it the committed offset of its whole queue, for minutes): it is stored again in
the group's retry topic ``%RETRY%<group>`` with a delay, and its original offset finishes. When
the delay is over the mover (``mqorder.store.delay``) makes it visible there, the group's workers
consume the retry topic like any other, and ``restore`` gives the listener the message as it was
sent (its topic, id, keys, tags, properties) with ``reconsume_times`` one higher.

The delay follows RocketMQ's broker: level ``3 + reconsume_times`` of ``messageDelayLevel``
(10s, 30s, 1m, 2m ... 2h with the default levels) unless the listener set
``ctx.delay_level_when_next_consume``; the caller sends a message that already came back
``max_reconsume_times`` times to the DLQ instead.

Why a delayed store and not a countdown in Celery: the message must survive the worker that
failed it, and the retry topic's queues are fenced, rebalanced and committed like every other,
so a retried message is never lost between the send-back and the original's commit: the send-back
happens first, and a crash in between only redelivers the original as well (at least once).
"""

from __future__ import annotations

import json
import zlib

from mqorder.codec import encode_header
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.delay import DelayStore
from mqorder.store.topics import TopicManager

#: Properties of a message in a retry topic (RocketMQ's names).
RETRY_TOPIC = "RETRY_TOPIC"
RECONSUME_TIME = "RECONSUME_TIME"
ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
#: Where the message was first consumed from (its original queue and offset), recorded at its first
#: send-back and kept through later ones: its dead letter names that queue, not the retry queue,
#: so ``mqorder dlq replay`` puts a copy back on its key's queue (RocketMQ keeps the real topic and
#: queue id of a retried message the same way).
RETRY_ORIGIN_BROKER = "RETRY_ORIGIN_BROKER"
RETRY_ORIGIN_QUEUE_ID = "RETRY_ORIGIN_QUEUE_ID"
RETRY_ORIGIN_OFFSET = "RETRY_ORIGIN_OFFSET"
#: The retry history a message carries (a replayed copy drops it: it starts again from its queue).
RETRY_PROPERTIES = frozenset({RETRY_TOPIC, RECONSUME_TIME, RETRY_ORIGIN_BROKER, RETRY_ORIGIN_QUEUE_ID,
                              RETRY_ORIGIN_OFFSET})
#: How long a send-back's id is remembered: longer than a run retries through a Redis outage,
#: the one way the same holder sends it twice (the DLQ writer's window, for the same reason).
SEND_BACK_DEDUP_MS = 15 * 60 * 1000
#: RocketMQ's broker adds this to the reconsume count to choose the delay level.
RETRY_LEVEL_BASE = 3


def retry_delay_ms(levels_ms: list[int], reconsume_times: int, level: int = 0) -> int:
    """The delay of a message sent back after ``reconsume_times`` earlier retries: ``level`` when
    the listener chose one (1-based, capped at the last level), else ``3 + reconsume_times``."""
    n = level if level > 0 else RETRY_LEVEL_BASE + reconsume_times
    return levels_ms[min(max(n, 1), len(levels_ms)) - 1]


class RetrySender:
    def __init__(self, topics: TopicManager, delays: DelayStore, *, levels_ms: list[int], queue_nums: int) -> None:
        self.topics = topics
        self.delays = delays
        self.levels_ms = levels_ms
        self.queue_nums = queue_nums
        self._queues: dict[str, list[MessageQueue]] = {}

    def queues(self, group: str) -> list[MessageQueue]:
        mqs = self._queues.get(group)
        if mqs is None:
            mqs = self._queues[group] = self.topics.ensure_retry_topic(group, self.queue_nums).message_queues
        return mqs

    def send_back(self, group: str, msg: MessageExt, level: int = 0, *, queue: MessageQueue | None = None,
                  epoch: int | None = None) -> int:
        """Store ``msg`` in ``%RETRY%<group>``, visible after its delay; returns the delay (ms).

        With the run's ``queue`` and ``epoch`` the send-back is stored once per message and holder
        epoch (as the DLQ writer's dead letters): the run commits the original's offset only after
        this returns, so a run retried after a lost reply sends it again, and that copy is dropped."""
        mqs = self.queues(group)
        # One message keeps one retry queue (and a key its queue), whatever retry it is on.
        seed = msg.key_hash if type(msg.key_hash) is int else zlib.crc32(msg.msg_id.encode("utf-8", "replace"))
        mq = mqs[seed % len(mqs)]
        delay_ms = retry_delay_ms(self.levels_ms, msg.reconsume_times, level)
        dedup = None if queue is None or epoch is None else f"{queue.key}|{msg.queue_offset}|{epoch}"
        self.delays.schedule(mq, self._header(msg), msg.body, delay_ms, guard=False, dedup_id=dedup,
                             dedup_ms=SEND_BACK_DEDUP_MS)
        return delay_ms

    def _header(self, msg: MessageExt) -> bytes:
        props = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in msg.properties.items()}
        props.setdefault(ORIGIN_MESSAGE_ID, msg.msg_id)
        if RETRY_ORIGIN_QUEUE_ID not in props:  # the first send-back: msg is still on its own queue
            props[RETRY_ORIGIN_BROKER] = msg.broker_name
            props[RETRY_ORIGIN_QUEUE_ID] = str(msg.queue_id)
            props[RETRY_ORIGIN_OFFSET] = str(msg.queue_offset)
        props[RETRY_TOPIC] = msg.topic
        props[RECONSUME_TIME] = str(msg.reconsume_times + 1)
        return encode_header(msg.msg_id, msg.keys, msg.tags, props, born_ms=msg.born_timestamp,
                             key_hash=msg.key_hash)


def restore(msgs: list[MessageExt]) -> None:
    """Messages read from a retry topic, as their listener expects them: the topic they were sent
    to (RocketMQ's ``resetRetryAndNamespace``) and how often they came back. Their queue and offset
    stay the retry queue's: that is where they are committed."""
    for m in msgs:
        p = m.properties
        original = p.get(RETRY_TOPIC)
        if isinstance(original, str):
            m.topic = original
        n = p.get(RECONSUME_TIME)
        if isinstance(n, str) and n.isdigit():
            m.reconsume_times = max(m.reconsume_times, int(n))


def origin_of(msg: MessageExt) -> tuple[str, str, int, int]:
    """(topic, broker, queue id, offset) a message was first consumed from: for one read from a
    retry topic, what its first send-back recorded; otherwise its own queue and offset."""
    p = msg.properties if isinstance(msg.properties, dict) else {}
    broker, qid, off = p.get(RETRY_ORIGIN_BROKER), p.get(RETRY_ORIGIN_QUEUE_ID), p.get(RETRY_ORIGIN_OFFSET)
    if (isinstance(p.get(RETRY_TOPIC), str) and isinstance(broker, str) and isinstance(qid, str) and qid.isdigit()
            and isinstance(off, str) and off.isdigit()):
        return p[RETRY_TOPIC], broker, int(qid), int(off)
    return msg.topic, msg.broker_name, msg.queue_id, msg.queue_offset

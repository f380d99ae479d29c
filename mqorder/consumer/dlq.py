"""``DeadLetterWriter``: RocketMQ's ``sendMessageBack`` to ``%DLQ%<group>`` after the last retry.

The dead letter keeps the original body, keys and tags and records where it came from and why
(``ORIGIN_*``, ``DLQ_REASON``, ``DLQ_EPOCH``), so an operator can inspect and replay it. It is
stored through the one append path (``QueueAppender``) like any message, so a DLQ subscriber is
woken the same way. The caller commits the original's offset only after this returns.
"""

from __future__ import annotations

import json
import logging

from mqorder import keys
from mqorder.codec import encode_header
from mqorder.consumer.retry import origin_of
from mqorder.errors import MessageError, TopicNotFoundError
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.append import QueueAppender
from mqorder.store.topics import TopicManager

log = logging.getLogger(__name__)

#: A reason longer than this is cut: it is for a human, and the header has a size limit.
MAX_REASON = 1000
#: How long a dead letter's id is remembered (``send``): longer than a run retries through a
#: Redis outage (``REDIS_RETRY_BUDGET_S``), the one way the same holder sends it twice.
DLQ_DEDUP_WINDOW_MS = 15 * 60 * 1000


class DeadLetterWriter:
    def __init__(self, appender: QueueAppender, topics: TopicManager, broker_name: str, client_id: str) -> None:
        self.appender = appender
        self.topics = topics
        self.broker_name = broker_name
        self.client_id = client_id
        self._ready: set[str] = set()

    def send(self, group: str, msg: MessageExt, reason: str, epoch: int, queue: MessageQueue | None = None) -> None:
        """Store ``msg``'s dead letter. ``queue``: the queue the run consumes ``msg`` from (default
        ``msg.message_queue``, which names the original topic for a message read from a retry
        topic: its queue id and offset are the retry queue's)."""
        topic = keys.dlq_topic(group)
        if topic not in self._ready:
            self.topics.ensure_dlq_topic(group)
            self._ready.add(topic)
        mq = MessageQueue(topic, self.broker_name, 0)
        body = msg.body if isinstance(msg.body, bytes) else b""
        # One dead letter per original message and holder epoch: the caller commits the
        # original's offset only after this returns, so a run that retries after a Redis error
        # (the append's reply lost, or the commit after it) sends it again under the same epoch,
        # and that copy is dropped here. A new holder (a new epoch) that redelivers the message
        # and dead-letters it again adds a second one, as at-least-once allows.
        # The queue consumed from, not msg.message_queue: after restore() that named the original
        # topic with the retry queue's id and offset, the id of another message of the original
        # queue, and with an equal epoch (lanes granted in one call share one) that message's dead
        # letter was dropped as a duplicate of this one: lost.
        dedup = f"dlq|{(queue or msg.message_queue).key}|{msg.queue_offset}|{epoch}"
        entry = [(self._header(msg, reason, epoch), body)]
        try:
            self.appender.append(mq, entry, ids=[dedup], dedup_window_ms=DLQ_DEDUP_WINDOW_MS)
        except TopicNotFoundError:
            # The DLQ topic was deleted (`mqorder topic delete %DLQ%<group>`) since this process
            # ensured it: its queue refuses writes. Create it again and send once more.
            self._ready.discard(topic)
            self.topics.ensure_dlq_topic(group)
            self._ready.add(topic)
            self.appender.append(mq, entry, ids=[dedup], dedup_window_ms=DLQ_DEDUP_WINDOW_MS)
        log.warning(
            "message %s of %s offset %d sent to %s after %d reconsume(s): %s",
            msg.msg_id or "(no id)", msg.message_queue.key, msg.queue_offset, topic, msg.reconsume_times, reason,
        )

    def _header(self, msg: MessageExt, reason: str, epoch: int) -> bytes:
        # The original may be the very message that failed to decode: copy only what is valid.
        props = {}
        if isinstance(msg.properties, dict):
            props = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in msg.properties.items()}
        topic, broker, queue_id, offset = origin_of(msg)
        props.update(
            {
                "ORIGIN_TOPIC": topic,
                "ORIGIN_BROKER": broker,
                "ORIGIN_QUEUE_ID": str(queue_id),
                "ORIGIN_QUEUE_OFFSET": str(offset),
                "ORIGIN_MSG_ID": str(msg.msg_id),
                "RECONSUME_TIMES": str(msg.reconsume_times),
                "DLQ_REASON": reason[:MAX_REASON],
                "DLQ_EPOCH": str(epoch),
                "DLQ_CLIENT": self.client_id,
            }
        )
        keys_ = msg.keys if isinstance(msg.keys, list) and all(isinstance(k, str) for k in msg.keys) else []
        tags = msg.tags if isinstance(msg.tags, str) else None
        dlq_id = f"DLQ-{msg.msg_id if isinstance(msg.msg_id, str) else ''}-{msg.queue_offset}"
        # The sharding key's hash stays with the dead letter, so a replayed copy keeps its key.
        hash_ = msg.key_hash if type(msg.key_hash) is int else None
        try:
            return encode_header(dlq_id, keys_, tags, props, key_hash=hash_)
        except MessageError:
            # Even a message whose metadata cannot be re-encoded must reach the DLQ: keep the body
            # and where it came from, drop the unencodable metadata.
            keep = {k: props[k] for k in props if k.startswith(("ORIGIN_", "DLQ_", "RECONSUME"))}
            keep["ORIGIN_METADATA_DROPPED"] = "1"
            keep["DLQ_REASON"] = keep["DLQ_REASON"].encode("utf-8", "replace").decode("utf-8")
            keep["ORIGIN_MSG_ID"] = keep["ORIGIN_MSG_ID"].encode("utf-8", "replace").decode("utf-8")
            return encode_header(dlq_id.encode("utf-8", "replace").decode("utf-8"), [], None, keep)

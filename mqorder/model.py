"""The data model, in RocketMQ's names: ``MessageQueue``, ``MessageExt``, ``SendResult``.

Bodies are always ``bytes``: mqorder never guesses an encoding and never pickles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mqorder import keys

#: The largest queue offset there can be: a stream entry id ``<offset>-1`` is 64 bits, and a larger
#: number reached Redis as "Invalid stream ID" (a pull, a CLI option) instead of being refused.
MAX_OFFSET = 2**63 - 1


@dataclass(frozen=True, order=True)
class MessageQueue:
    """One ordered queue of a topic on a named broker (RocketMQ's ``MessageQueue``).

    Frozen and ordered so it can key dicts, live in sets and be sorted deterministically by the
    allocation strategies, exactly like the Java class with its ``compareTo``.
    """

    #: ``_key`` and ``_tag``: the queue's spellings, made once per queue object (every key of a
    #: queue is built from its tag, and a worker's sweep and lease renewal spell those of all its
    #: queues every interval: an idle worker's main cost, issue 27). Slots, not dataclass fields:
    #: not compared, hashed, passed to the constructor, or shown by ``dataclasses.asdict``.
    __slots__ = ("topic", "broker_name", "queue_id", "_key", "_tag")

    topic: str
    broker_name: str
    queue_id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", keys.queue_key(self.topic, self.broker_name, self.queue_id))
        object.__setattr__(self, "_tag", keys.queue_tag(self.topic, self.broker_name, self.queue_id))

    def __reduce__(self) -> tuple[type[MessageQueue], tuple[str, str, int]]:
        """Pickled as its three fields (its spellings are made again): the same bytes whatever
        this class caches, so a pickle outlives a change of its slots."""
        return (MessageQueue, (self.topic, self.broker_name, self.queue_id))

    @property
    def tag(self) -> str:
        """The Redis Cluster hash tag of every key of this queue."""
        return self._tag  # type: ignore[attr-defined]  # a slot set in __post_init__

    @property
    def key(self) -> str:
        """``topic:broker:qid``, the queue's spelling in task arguments, assignment hashes and stats."""
        return self._key  # type: ignore[attr-defined]  # a slot set in __post_init__

    @classmethod
    def from_key(cls, key: str) -> MessageQueue:
        """The queue of a ``key``; ``ValueError`` if ``key`` is not one (``keys.parse_queue_key``)."""
        return cls(*keys.parse_queue_key(key))

    def __str__(self) -> str:
        return f"MessageQueue[topic={self.topic}, brokerName={self.broker_name}, queueId={self.queue_id}]"


@dataclass(slots=True)
class MessageExt:
    """A stored message as a listener sees it (RocketMQ's ``MessageExt``).

    ``decode_error`` is set (and ``body`` may be empty) when the stored entry could not be decoded;
    such a message is never handed to a listener: it goes to the DLQ with that reason.
    """

    msg_id: str
    topic: str
    broker_name: str
    queue_id: int
    queue_offset: int
    body: bytes
    keys: list[str]
    tags: str | None
    properties: dict[str, str]
    born_timestamp: int
    store_timestamp: int
    reconsume_times: int = 0
    decode_error: str | None = None
    #: Hash of the sharding key the message was sent with (``crc32(utf8(key))``, the number the
    #: default selector takes modulo the queue count), None when it was sent without one. Key-
    #: ordered listeners (``ordering="key"``) order and serialise messages per ``key_hash``.
    key_hash: int | None = None

    @property
    def message_queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker_name, self.queue_id)

    def __repr__(self) -> str:
        return (
            f"MessageExt(topic={self.topic!r}, queue_id={self.queue_id}, offset={self.queue_offset}, "
            f"msg_id={self.msg_id!r}, keys={self.keys!r}, tags={self.tags!r}, "
            f"reconsume_times={self.reconsume_times}, body={len(self.body)} bytes)"
        )


class SendStatus(enum.Enum):
    """How a send ended (RocketMQ's SendStatus); a send that did not store its message raises instead."""

    SEND_OK = "SEND_OK"


@dataclass(frozen=True, slots=True)
class SendResult:
    """What ``Producer.send``/``send_orderly`` return once the broker has stored the message."""

    send_status: SendStatus
    msg_id: str
    message_queue: MessageQueue
    queue_offset: int
    store_timestamp: int


class ConsumeOrderlyStatus(enum.Enum):
    """What an orderly listener returns (RocketMQ's ``ConsumeOrderlyStatus``)."""

    SUCCESS = "SUCCESS"
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"
    #: Only meaningful with ``ctx.auto_commit = False``.
    COMMIT = "COMMIT"
    #: Only meaningful with ``ctx.auto_commit = False``.
    ROLLBACK = "ROLLBACK"


class ConsumeConcurrentlyStatus(enum.Enum):
    """What a concurrent listener returns (RocketMQ's ``ConsumeConcurrentlyStatus``).

    ``CONSUME_SUCCESS`` with ``ctx.ack_index`` below the last index acknowledges only the first
    ``ack_index + 1`` messages; the rest are sent back for retry, like ``RECONSUME_LATER``.
    """

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class ConsumeFromWhere(enum.Enum):
    """Where a lane that never committed starts (RocketMQ's ``ConsumeFromWhere``)."""

    #: Its queues' first stored messages: the whole retained backlog (mqorder's default).
    FIRST_OFFSET = "first_offset"
    #: Its queues' ends when the lane first registers: only what is sent from then on.
    LAST_OFFSET = "last_offset"

    @classmethod
    def parse(cls, value: ConsumeFromWhere | str) -> ConsumeFromWhere:
        """``"last_offset"``, ``"LAST_OFFSET"``, RocketMQ's ``"CONSUME_FROM_LAST_OFFSET"``..."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            name = value.strip().lower().removeprefix("consume_from_")
            for member in cls:
                if member.value == name:
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"consume_from_where must be one of {choices} (or RocketMQ's CONSUME_FROM_FIRST_OFFSET / "
                         f"CONSUME_FROM_LAST_OFFSET), got {value!r}")


class MessageModel(enum.Enum):
    """CLUSTERING: a group's clients share its queues; BROADCASTING: every client consumes every queue,
    with its own offsets (RocketMQ's MessageModel)."""

    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"

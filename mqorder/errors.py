"""Every error mqorder raises on purpose.

Each message says what was wrong *and* what to do about it, because the people reading these are
operators at a terminal, not the author of the code.
"""

from __future__ import annotations


class MQOrderError(Exception):
    """Base class of every error raised by mqorder on purpose."""


class ConfigError(MQOrderError, ValueError):
    """A setting (``MQORDER_*`` variable or keyword argument) has a bad value."""


class EvictionPolicyError(ConfigError):
    """A Redis broker's ``maxmemory-policy`` may evict keys (``mqorder.store.capacity``)."""


class InvalidNameError(MQOrderError, ValueError):
    """A topic, group, broker or client name is not allowed (charset or length)."""


class TopicNotFoundError(MQOrderError, LookupError):
    """The topic has no route in Redis: it was never created (or was deleted)."""


class TopicNotWritableError(MQOrderError):
    """The topic's permission is read-only (``r``): sends are refused until it is ``rw`` again."""


class TopicExistsError(MQOrderError):
    """``create_topic`` was called with a queue layout different from the stored one."""


class MessageError(MQOrderError, ValueError):
    """A message is refused at send time (body type, size, keys, properties)."""


class MessageTooLargeError(MessageError):
    """The body (or body plus header) is bigger than ``max_message_size``."""


class BrokerUnavailableError(MQOrderError, ConnectionError):
    """A Redis broker could not be reached (after the configured retries)."""


class BrokerRefusedError(BrokerUnavailableError):
    """A Redis broker answered but refused to store (MISCONF, OOM, READONLY...): nothing was written."""


class ListenerError(MQOrderError):
    """A listener was registered wrongly (bad signature, duplicate group/topic pair...)."""


class BrokerFullError(BrokerRefusedError):
    """A broker's used memory passed ``MQORDER_MAX_MEMORY_RATIO`` of its ``maxmemory``: the send was
    refused before anything was stored (consumption and trimming go on, so it drains)."""


class ReplicasBehindError(BrokerUnavailableError):
    """A send asked to wait for replicas (``wait_replicas``) and fewer acknowledged it in time: it
    IS stored on the primary, but a failover now could lose it. Not retried on another broker
    (that would store it twice); a resend with the same dedup key is a dedup hit that waits again."""


class NotEnoughReplicasError(BrokerRefusedError):
    """A send asked to wait for more replicas than the primary has connected (``connected_slaves``):
    refused before anything was stored, rather than waiting out a timeout that cannot be met."""


class OffsetFencedError(MQOrderError):
    """A pull consumer's ``update_offset`` was refused: it no longer holds the queue at the epoch it
    was given (a rebalance moved it, or its lease lapsed and another consumer took it)."""


class OffsetIllegalError(MQOrderError, ValueError):
    """An offset a pull consumer gave is not allowed (backward, or past the end of the queue)."""


class BufferExhaustedError(MQOrderError):
    """``send_orderly_async`` waited ``max_block_ms`` for room in the producer's ``buffer_memory``
    (Kafka's ``BufferExhaustedException``): Redis takes the sends slower than they come, or is
    away. The message was not queued; nothing of it was sent."""


class ProducerClosedError(MQOrderError, RuntimeError):
    """``send_orderly_async`` after ``Producer.close()``: the background sender has stopped."""


class TransactionEndedError(MQOrderError):
    """A transaction's end (COMMIT or ROLLBACK) found it already ended the other way, by the
    check-back or an earlier end: nothing was changed. ``outcome`` says how it did end."""

    def __init__(self, message: str, outcome: str) -> None:
        super().__init__(message)
        self.outcome = outcome

"""Message queue selectors (RocketMQ's ``MessageQueueSelector``).

The default hashes the sharding key with ``crc32(utf8(key)) mod queue_count``, which is exactly
Spark SQL's ``pmod(crc32(key), n)``: a DataFrame partitioned on that expression lines up with the
queues the producer writes to.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

from mqorder.errors import MessageError
from mqorder.model import MessageQueue

#: ``selector(queues, sharding_key, body) -> MessageQueue`` (or an index into ``queues``).
Selector = Callable[[Sequence[MessageQueue], Any, bytes], "MessageQueue | int"]


def key_bytes(sharding_key: object) -> bytes:
    if isinstance(sharding_key, bool):
        raise MessageError("sharding_key must be a str, bytes or int, not bool")
    if isinstance(sharding_key, str):
        try:
            return sharding_key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MessageError(f"sharding_key is not valid UTF-8 text ({exc.reason})") from None
    if isinstance(sharding_key, bytes):
        return sharding_key
    if isinstance(sharding_key, int):
        # int.__repr__, not str(): an int subclass (an IntEnum member) spells its name there, and
        # the key 7 went to another queue as Shop.BERLIN than as 7.
        return int.__repr__(sharding_key).encode("ascii")
    raise MessageError(
        f"sharding_key must be a str, bytes or int, got {type(sharding_key).__name__}; "
        "pass the order/user id as a string"
    )


def queue_index(sharding_key: object, queue_count: int) -> int:
    """``crc32(utf8(key)) mod queue_count``, the same number Spark's ``pmod(crc32(key), n)`` gives."""
    return zlib.crc32(key_bytes(sharding_key)) % queue_count


def key_hash(sharding_key: object) -> int | None:
    """The hash stored with a message (header ``h``) so key-ordered listeners can tell its key
    apart from the other keys of its queue: ``crc32(utf8(key))``, the very number the default
    selector takes modulo the queue count (and Spark's ``crc32(key)``), so every append path
    computes it alike.

    None for a key this module cannot turn into bytes (a custom selector may take any object):
    such messages count as one key per queue, which is safe (serialised), only slower.
    """
    try:
        return zlib.crc32(key_bytes(sharding_key))
    except MessageError:
        return None


def select_by_hash(queues: Sequence[MessageQueue], sharding_key: object, body: bytes) -> MessageQueue:
    return queues[queue_index(sharding_key, len(queues))]


def resolve(selected: object, queues: Sequence[MessageQueue]) -> MessageQueue:
    """Accept what a user selector returned: one of ``queues`` or an index into them."""
    if isinstance(selected, MessageQueue):
        if selected not in queues:
            raise MessageError(f"selector returned {selected}, which is not a queue of this topic")
        return selected
    if isinstance(selected, int) and not isinstance(selected, bool):
        if not 0 <= selected < len(queues):
            raise MessageError(f"selector returned index {selected}; the topic has {len(queues)} queues")
        return queues[selected]
    raise MessageError(f"selector must return a MessageQueue or an int index, got {selected!r}")

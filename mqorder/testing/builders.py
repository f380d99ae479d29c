"""What a listener is called with, built for a unit test: messages and contexts, no Redis.

A listener is a plain function of ``(msgs, ctx)``, so the fastest test calls it. Building its
arguments by hand is the awkward part: ``MessageExt`` has eleven fields without defaults and each
context five keyword arguments. These builders fill them the way the engine does (the sharding
key's hash as the producer stores it, ``ack_index`` at the last message, the settings' default
suspend) and leave to the test what it cares about.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mqorder.client.selector import key_hash
from mqorder.consumer.context import ConsumeConcurrentlyContext, ConsumeOrderlyContext
from mqorder.errors import MessageError
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.brokers import DEFAULT_BROKER_NAME
from mqorder.tokens import new_token

#: The suspend time of a context built here, the ``suspend_current_queue_time_ms`` setting's default.
DEFAULT_SUSPEND_MS = 1000


def _body(body: bytes | str) -> bytes:
    if isinstance(body, str):
        return body.encode()
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    raise MessageError(f"body must be bytes or str, got {type(body).__name__}; json.dumps(...).encode() a dict")


def make_message(
    body: bytes | str = b"",
    *,
    topic: str = "t",
    queue_id: int = 0,
    queue_offset: int = 0,
    sharding_key: str | bytes | int | None = None,
    keys: str | Sequence[str] = (),
    tags: str | None = None,
    properties: dict[str, str] | None = None,
    reconsume_times: int = 0,
    msg_id: str | None = None,
    broker_name: str = DEFAULT_BROKER_NAME,
) -> MessageExt:
    """A stored message as a listener receives it. ``sharding_key`` sets ``key_hash`` as
    ``send_orderly`` stores it (key-mode listeners and ``mqorder status --key`` read that);
    ``keys`` is the message's key text (``msg.keys``); ``str`` bodies are UTF-8 encoded."""
    now = int(time.time() * 1000)
    return MessageExt(
        msg_id=msg_id or new_token(),
        topic=topic,
        broker_name=broker_name,
        queue_id=queue_id,
        queue_offset=queue_offset,
        body=_body(body),
        keys=[keys] if isinstance(keys, str) else list(keys),
        tags=tags,
        properties=dict(properties or {}),
        born_timestamp=now,
        store_timestamp=now,
        reconsume_times=reconsume_times,
        key_hash=None if sharding_key is None else key_hash(sharding_key),
    )


def _queue(msgs: Sequence[MessageExt], topic: str | None, queue_id: int | None) -> MessageQueue:
    first = msgs[0] if msgs else None
    return MessageQueue(
        topic if topic is not None else (first.topic if first else "t"),
        first.broker_name if first else DEFAULT_BROKER_NAME,
        queue_id if queue_id is not None else (first.queue_id if first else 0),
    )


def make_orderly_context(
    msgs: Sequence[MessageExt] = (),
    *,
    group: str = "g",
    topic: str | None = None,
    queue_id: int | None = None,
    epoch: int = 1,
    client_id: str = "test-client",
    still_owner: bool | Callable[[], bool] = True,
    suspend_current_queue_time_millis: int = DEFAULT_SUSPEND_MS,
) -> ConsumeOrderlyContext:
    """The context of an orderly (or key-ordered) call on the queue of ``msgs`` (or ``topic`` /
    ``queue_id``). ``still_owner``: what ``ctx.still_owner()`` and ``still_owner_async()`` answer,
    a bool or a function (``False`` tests a listener's fenced path)."""
    return ConsumeOrderlyContext(
        _queue(msgs, topic, queue_id), epoch=epoch, client_id=client_id, group=group,
        still_owner=_answer(still_owner), suspend_current_queue_time_millis=suspend_current_queue_time_millis,
    )


def make_concurrent_context(
    msgs: Sequence[MessageExt] = (),
    *,
    group: str = "g",
    topic: str | None = None,
    queue_id: int | None = None,
    epoch: int = 1,
    client_id: str = "test-client",
    still_owner: bool | Callable[[], bool] = True,
    suspend_current_queue_time_millis: int = DEFAULT_SUSPEND_MS,
) -> ConsumeConcurrentlyContext:
    """The context of a concurrent call on ``msgs``: ``ack_index`` at the last message, as the
    engine sets it, so a test reads back what the listener acknowledged."""
    return ConsumeConcurrentlyContext(
        _queue(msgs, topic, queue_id), epoch=epoch, client_id=client_id, group=group,
        still_owner=_answer(still_owner), ack_index=len(msgs) - 1,
        suspend_current_queue_time_millis=suspend_current_queue_time_millis,
    )


def _answer(still_owner: bool | Callable[[], bool]) -> Callable[[], bool]:
    if callable(still_owner):
        return still_owner
    if not isinstance(still_owner, bool):
        raise TypeError(f"still_owner must be a bool or a function returning one, got {still_owner!r}")
    return lambda: still_owner

"""``@orderly_listener``: RocketMQ's ``MessageListenerOrderly``, registered per (group, topic).

Registration only records the function in this process; the workers subscribe every registered
(group, topic) pair in Redis when they start, and rebalance hands out the topic's queues.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mqorder.consumer.hooks import ConsumeMessageHook
from mqorder.errors import ListenerError
from mqorder.model import ConsumeOrderlyStatus, MessageModel
from mqorder.names import check_name, check_topic

ListenerFunc = Callable[[list[Any], Any], "ConsumeOrderlyStatus | None"]


@dataclass
class ListenerSpec:
    func: ListenerFunc
    topic: str
    group: str
    message_model: MessageModel = MessageModel.CLUSTERING
    #: ``None`` means "from settings" for each of these.
    consume_message_batch_max_size: int | None = None
    pull_batch_size: int | None = None
    max_reconsume_times: int | None = None
    suspend_current_queue_time_millis: int | None = None
    hooks: list[ConsumeMessageHook] = field(default_factory=list)
    #: Record every handled message in the ledger (``None``: ``MQORDER_LEDGER``).
    ledger: bool | None = None
    #: ``"queue"`` (RocketMQ's orderly consumption: one call at a time per queue) or ``"key"``
    #: (one call at a time per sharding key, keys of one queue in parallel: ``key_request``).
    ordering: str = "queue"
    #: Key mode only (``None``: ``MQORDER_KEY_CONCURRENCY`` / ``MQORDER_CONSUME_CONCURRENTLY_MAX_SPAN``).
    key_concurrency: int | None = None
    consume_concurrently_max_span: int | None = None

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"


_REGISTRY: dict[tuple[str, str], ListenerSpec] = {}


def _positive(name: str, v: object, minimum: int = 1) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ListenerError(f"{name} must be an int >= {minimum}, got {v!r}")


def orderly_listener(
    *,
    topic: str,
    group: str,
    message_model: MessageModel | str = MessageModel.CLUSTERING,
    consume_message_batch_max_size: int | None = None,
    pull_batch_size: int | None = None,
    max_reconsume_times: int | None = None,
    suspend_current_queue_time_millis: int | None = None,
    hooks: list[ConsumeMessageHook] | None = None,
    ledger: bool | None = None,
    ordering: str = "queue",
    key_concurrency: int | None = None,
    consume_concurrently_max_span: int | None = None,
) -> Callable[[ListenerFunc], ListenerFunc]:
    """Register ``func(msgs, ctx) -> ConsumeOrderlyStatus`` as the orderly listener of a group.

    Returning ``None`` or raising counts as ``SUSPEND_CURRENT_QUEUE_A_MOMENT`` (as in RocketMQ).

    ``ordering="queue"`` (the default) is RocketMQ's orderly consumption: one call at a time per
    queue, in offset order. ``ordering="key"`` orders per sharding key instead: messages of
    different keys of one queue are handled in parallel (up to ``key_concurrency``), one call at
    a time per key and in offset order per key; a suspend holds back only its key
    (``mqorder.consumer.key_request``). In key mode a batch (``consume_message_batch_max_size``)
    holds messages of one key only.
    """
    check_topic(topic)
    check_name("group", group)
    if isinstance(message_model, str):
        try:
            message_model = MessageModel(message_model.upper())
        except ValueError:
            raise ListenerError(
                f"message_model must be CLUSTERING or BROADCASTING, got {message_model!r}"
            ) from None
    _positive("consume_message_batch_max_size", consume_message_batch_max_size)
    _positive("pull_batch_size", pull_batch_size)
    _positive("max_reconsume_times", max_reconsume_times, -1)
    _positive("suspend_current_queue_time_millis", suspend_current_queue_time_millis, 10)
    if ordering not in ("queue", "key"):
        raise ListenerError(f"ordering must be 'queue' (one call at a time per queue) or 'key' "
                            f"(one call at a time per sharding key), got {ordering!r}")
    _positive("key_concurrency", key_concurrency)
    _positive("consume_concurrently_max_span", consume_concurrently_max_span)
    if ledger is not None and not isinstance(ledger, bool):
        raise ListenerError(f"ledger must be True, False or None (from MQORDER_LEDGER), got {ledger!r}")
    for h in hooks or []:
        if not isinstance(h, ConsumeMessageHook):
            raise ListenerError(f"hooks must be ConsumeMessageHook instances, got {h!r}")

    def register(func: ListenerFunc) -> ListenerFunc:
        if not callable(func):
            raise ListenerError(f"@orderly_listener must decorate a function, got {func!r}")
        try:
            inspect.signature(func).bind(object(), object())
        except TypeError:
            raise ListenerError(
                f"listener {func!r} must accept two arguments: (msgs, ctx)"
            ) from None
        spec = ListenerSpec(
            func=func,
            topic=topic,
            group=group,
            message_model=message_model,
            consume_message_batch_max_size=consume_message_batch_max_size,
            pull_batch_size=pull_batch_size,
            max_reconsume_times=max_reconsume_times,
            suspend_current_queue_time_millis=suspend_current_queue_time_millis,
            hooks=list(hooks or []),
            ledger=ledger,
            ordering=ordering,
            key_concurrency=key_concurrency,
            consume_concurrently_max_span=consume_concurrently_max_span,
        )
        old = _REGISTRY.get((group, topic))
        if old is not None and old.name != spec.name:
            raise ListenerError(
                f"group {group!r} already has a listener for topic {topic!r} ({old.name}); "
                "one group consumes a topic with one listener: use another group name"
            )
        _REGISTRY[(group, topic)] = spec
        return func

    return register


def registered_listeners() -> list[ListenerSpec]:
    return list(_REGISTRY.values())


def get_listener(group: str, topic: str) -> ListenerSpec | None:
    return _REGISTRY.get((group, topic))


def unregister_listener(group: str, topic: str) -> None:
    _REGISTRY.pop((group, topic), None)

"""``@orderly_listener`` and ``@concurrent_listener``: RocketMQ's ``MessageListenerOrderly`` and
``MessageListenerConcurrently``, registered per (group, topic).

Registration only records the function in this process; the workers subscribe every registered
(group, topic) pair in Redis when they start, and rebalance hands out the topic's queues. A group
with concurrent listeners also consumes its retry topic ``%RETRY%<group>`` (where failed messages
come back, delayed): registering the first one registers that subscription too, as RocketMQ's
client subscribes ``%RETRY%<group>`` for every concurrently consuming group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mqorder import keys
from mqorder.consumer.hooks import ConsumeMessageHook
from mqorder.errors import ListenerError
from mqorder.model import ConsumeFromWhere, MessageModel
from mqorder.names import check_name, check_topic

ListenerFunc = Callable[[list[Any], Any], Any]

#: How long a run that lost its queue (a refused commit, a rebalance, the end of its time budget
#: while handing over) waits for its ``async def`` calls in flight before cancelling them.
DEFAULT_CANCEL_GRACE_MS = 2000


def is_async_listener(func: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(func):
        return True
    call = getattr(func, "__call__", None)  # noqa: B004 - an instance with an async __call__
    return call is not None and not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


class Ordering(StrEnum):
    """The ways a listener consumes a queue; each runs as its own kind of ConsumeRequest
    (``mqorder.consumer.engine.REQUEST_CLASSES``)."""

    #: RocketMQ's orderly consumption: one call at a time per queue, in offset order.
    QUEUE = "queue"
    #: One call at a time per sharding key, keys of one queue in parallel (``key_request``).
    KEY = "key"
    #: RocketMQ's concurrent consumption (``@concurrent_listener``): no order, retries through
    #: ``%RETRY%<group>`` (``concurrent_request``).
    CONCURRENT = "concurrent"


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
    #: How the queue is consumed (``Ordering``; a plain string such as ``"key"`` is taken too).
    ordering: Ordering = Ordering.QUEUE
    #: Key and concurrent modes only: calls of one queue at once (``None``:
    #: ``MQORDER_KEY_CONCURRENCY`` / ``MQORDER_CONSUME_CONCURRENCY``) and the widest in-flight span
    #: (``None``: ``MQORDER_CONSUME_CONCURRENTLY_MAX_SPAN``).
    key_concurrency: int | None = None
    consume_concurrently_max_span: int | None = None
    #: The group's retry topic subscription (``%RETRY%<group>``): its messages are handed to the
    #: concurrent listener of the topic each was first sent to (``retry_spec``).
    is_retry: bool = False
    #: ``async def`` listeners: how long a run that lost its queue lets calls in flight finish
    #: before cancelling them (``None``: ``DEFAULT_CANCEL_GRACE_MS``).
    cancel_grace_ms: int | None = None
    #: Where the group starts on a topic it never consumed (``start_position``): its first stored
    #: messages (the default) or only what is sent once it first registers.
    consume_from_where: ConsumeFromWhere = ConsumeFromWhere.FIRST_OFFSET
    #: Set from ``func``: an ``async def`` listener runs on the process's loop (``async_loop``).
    is_async: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.is_async = is_async_listener(self.func)
        try:
            self.ordering = Ordering(self.ordering)
        except ValueError:
            raise ListenerError(f"ordering must be one of {', '.join(repr(o.value) for o in Ordering)}, "
                                f"got {self.ordering!r}") from None

    @property
    def name(self) -> str:
        f = self.func
        qual = getattr(f, "__qualname__", None) or type(f).__qualname__  # an object with __call__
        return f"{getattr(f, '__module__', None) or type(f).__module__}.{qual}"


_REGISTRY: dict[tuple[str, str], ListenerSpec] = {}


#: The largest value a listener may give each setting: the same bounds as the worker-wide settings
#: (``mqorder.settings.Settings``; a test keeps the two equal). Above the span's, key mode's offset
#: map could outgrow what ``key_commit.lua`` stores, and every commit of the queue was refused.
MAXIMA = {
    "pull_batch_size": 1024,
    "consume_message_batch_max_size": 1024,
    "key_concurrency": 1024,
    "consume_concurrency": 1024,
    "consume_concurrently_max_span": 100_000,
    "suspend_current_queue_time_millis": 30_000,  # the settings' suspend_current_queue_time_ms
}


#: Bounds of the listener options with no worker-wide setting: a grace of an hour at most (as the
#: settings' durations), where 10**12 ms (31 years) was taken, and never cancelled a hung call.
LISTENER_MAXIMA = {"cancel_grace_ms": 3_600_000}


def _positive(name: str, v: object, minimum: int = 1) -> None:
    if v is None:
        return
    most = MAXIMA.get(name, LISTENER_MAXIMA.get(name))
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum or (most is not None and v > most):
        bounds = f">= {minimum}" if most is None else f"from {minimum} to {most}"
        raise ListenerError(f"{name} must be an int {bounds}, got {v!r}")


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
    ordering: Ordering | str = Ordering.QUEUE,
    key_concurrency: int | None = None,
    consume_concurrently_max_span: int | None = None,
    cancel_grace_ms: int | None = None,
    consume_from_where: ConsumeFromWhere | str = ConsumeFromWhere.FIRST_OFFSET,
) -> Callable[[ListenerFunc], ListenerFunc]:
    """Register ``func(msgs, ctx) -> ConsumeOrderlyStatus`` as the orderly listener of a group.

    ``func`` may be ``async def`` (in either ordering): its calls then run on the worker process's
    event loop (``mqorder.consumer.async_loop``), up to ``key_concurrency`` per queue in key mode,
    one per queue in queue mode, with the same guarantees; a run that loses its queue cancels
    its calls still in flight after ``cancel_grace_ms`` (2000). See docs/ASYNC.md.

    Returning ``None`` or raising counts as ``SUSPEND_CURRENT_QUEUE_A_MOMENT`` (as in RocketMQ).

    ``ordering="queue"`` (the default) is RocketMQ's orderly consumption: one call at a time per
    queue, in offset order. ``ordering="key"`` orders per sharding key instead: messages of
    different keys of one queue are handled in parallel (up to ``key_concurrency``), one call at
    a time per key and in offset order per key; a suspend holds back only its key
    (``mqorder.consumer.key_request``). In key mode a batch (``consume_message_batch_max_size``)
    holds messages of one key only.

    ``consume_from_where``: where the group starts on a topic it never consumed: its queues' first
    stored messages (``"first_offset"``, the default: the whole retained backlog) or their ends when
    its first worker registers (``"last_offset"``, RocketMQ's ``CONSUME_FROM_LAST_OFFSET``). A group
    that committed anything on the topic resumes where it stopped either way.
    """
    check_topic(topic)
    check_name("group", group)
    message_model = _message_model(message_model)
    from_where = _from_where(consume_from_where)
    _positive("consume_message_batch_max_size", consume_message_batch_max_size)
    _positive("pull_batch_size", pull_batch_size)
    _positive("max_reconsume_times", max_reconsume_times, -1)
    _positive("suspend_current_queue_time_millis", suspend_current_queue_time_millis, 10)
    if isinstance(ordering, str):
        ordering = ordering.lower()  # any case, as message_model takes "CLUSTERING"
    if ordering not in (Ordering.QUEUE, Ordering.KEY):
        raise ListenerError(f"ordering must be 'queue' (one call at a time per queue) or 'key' "
                            f"(one call at a time per sharding key), got {ordering!r}")
    _positive("key_concurrency", key_concurrency)
    _positive("consume_concurrently_max_span", consume_concurrently_max_span)
    _positive("cancel_grace_ms", cancel_grace_ms, 0)
    if ordering == Ordering.QUEUE:
        for name, value in (("key_concurrency", key_concurrency),
                            ("consume_concurrently_max_span", consume_concurrently_max_span)):
            if value is not None:  # accepted and ignored, a user believed keys ran in parallel
                raise ListenerError(f"{name} applies to ordering='key' (one call at a time per sharding key); "
                                    "with ordering='queue' one call at a time runs per queue: drop it, or pass "
                                    "ordering='key'")
    hook_list = _checked_hooks(ledger, hooks)

    def register(func: ListenerFunc) -> ListenerFunc:
        _check_func(func, "orderly_listener")
        _check_grace(func, cancel_grace_ms)
        spec = ListenerSpec(
            func=func,
            topic=topic,
            group=group,
            message_model=message_model,
            consume_message_batch_max_size=consume_message_batch_max_size,
            pull_batch_size=pull_batch_size,
            max_reconsume_times=max_reconsume_times,
            suspend_current_queue_time_millis=suspend_current_queue_time_millis,
            hooks=hook_list,
            ledger=ledger,
            ordering=Ordering(ordering),
            key_concurrency=key_concurrency,
            consume_concurrently_max_span=consume_concurrently_max_span,
            cancel_grace_ms=cancel_grace_ms,
            consume_from_where=from_where,
        )
        _register(spec)
        return func

    return register


def _check_grace(func: object, cancel_grace_ms: int | None) -> None:
    """``cancel_grace_ms`` cancels an ``async def`` listener's calls; a plain function's cannot be
    cancelled, and the option was ignored without a word."""
    if cancel_grace_ms is not None and not is_async_listener(func):
        raise ListenerError(f"cancel_grace_ms applies to 'async def' listeners (their calls in flight are cancelled "
                            f"when the run loses its queue); {func!r} is a plain function: drop the option")


def _check_func(func: object, decorator: str) -> None:
    if not callable(func):
        raise ListenerError(f"@{decorator} must decorate a function, got {func!r}")
    if inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func):
        raise ListenerError(f"listener {func!r} is a generator; a listener returns its status once: write it as "
                            "'def' or 'async def' returning a ConsumeOrderlyStatus / ConsumeConcurrentlyStatus")
    try:
        inspect.signature(func).bind(object(), object())
    except TypeError:
        raise ListenerError(f"listener {func!r} must accept two arguments: (msgs, ctx)") from None


def _may_replace(old: ListenerSpec, new: ListenerSpec) -> bool:
    """Whether ``new`` may take ``old``'s place: the same callable, or the same name from its module
    imported again (a reload: new code). Two callables of one factory share their name and their
    code (or their class) but not their state: a second listener for the group and topic, which
    replaced the first without a word."""
    if old.func is new.func:
        return True
    if old.name != new.name:
        return False
    a, b = getattr(old.func, "__code__", None), getattr(new.func, "__code__", None)
    if a is not None or b is not None:
        return a is not b
    return type(old.func) is not type(new.func)


#: The refusals' advice for the usual way to meet them in tests: a listener defined in a test function
#: is a new function at every call (a parametrized test, two tests with one group).
_IN_TESTS = (
    " (in tests, register inside `with mqorder.testing.isolated_listeners():` or call "
    "`mqorder.testing.clear_listeners()` between tests)"
)


def _register(spec: ListenerSpec) -> None:
    group, topic = spec.group, spec.topic
    old = _REGISTRY.get((group, topic))
    if old is not None and not _may_replace(old, spec):
        raise ListenerError(
            f"group {group!r} already has a listener for topic {topic!r} ({old.name}); "
            f"one group consumes a topic with one listener: use another group name{_IN_TESTS}"
        )
    concurrent = spec.ordering is Ordering.CONCURRENT
    for other in _REGISTRY.values():
        if other.group == group and not other.is_retry and (other.ordering is Ordering.CONCURRENT) != concurrent \
                and other.topic != topic:
            raise ListenerError(
                f"group {group!r} already consumes topic {other.topic!r} "
                f"{'concurrently' if other.ordering is Ordering.CONCURRENT else 'in order'}; a group consumes either in "
                f"order or concurrently (RocketMQ: one message listener per consumer group): use another group name"
                f"{_IN_TESTS}"
            )
    _REGISTRY[(group, topic)] = spec
    if concurrent and spec.message_model is MessageModel.CLUSTERING:
        retry = keys.retry_topic(group)
        if (group, retry) not in _REGISTRY:
            _REGISTRY[(group, retry)] = ListenerSpec(
                func=_retry_placeholder, topic=retry, group=group, ordering=Ordering.CONCURRENT, is_retry=True,
                consume_message_batch_max_size=spec.consume_message_batch_max_size,
                pull_batch_size=spec.pull_batch_size, max_reconsume_times=spec.max_reconsume_times,
                key_concurrency=spec.key_concurrency,
                consume_concurrently_max_span=spec.consume_concurrently_max_span, ledger=spec.ledger,
            )


def _retry_placeholder(msgs: list[Any], ctx: Any) -> None:
    """The retry subscription's own function: never called, each retried message goes to the
    listener of its original topic (``ConcurrentConsumeRequest``)."""
    raise ListenerError("a retry topic's messages are handled by the listener of their original topic")


def concurrent_listener(
    *,
    topic: str,
    group: str,
    message_model: MessageModel | str = MessageModel.CLUSTERING,
    consume_message_batch_max_size: int | None = None,
    pull_batch_size: int | None = None,
    max_reconsume_times: int | None = None,
    consume_concurrency: int | None = None,
    consume_concurrently_max_span: int | None = None,
    suspend_current_queue_time_millis: int | None = None,
    hooks: list[ConsumeMessageHook] | None = None,
    ledger: bool | None = None,
    cancel_grace_ms: int | None = None,
    consume_from_where: ConsumeFromWhere | str = ConsumeFromWhere.FIRST_OFFSET,
) -> Callable[[ListenerFunc], ListenerFunc]:
    """Register ``func(msgs, ctx) -> ConsumeConcurrentlyStatus`` as a concurrent listener
    (RocketMQ's ``MessageListenerConcurrently``): no order, messages of one queue in parallel.

    Each call gets up to ``consume_message_batch_max_size`` messages (1); up to
    ``consume_concurrency`` calls of one queue run at once (``MQORDER_CONSUME_CONCURRENCY``, 16),
    on lane threads (greenlets under ``-P gevent``) of the run that holds the queue.

    ``CONSUME_SUCCESS`` acknowledges the batch up to ``ctx.ack_index``; ``RECONSUME_LATER``,
    ``None`` or an exception acknowledges nothing. Messages not acknowledged are sent back to
    ``%RETRY%<group>`` with RocketMQ's delay levels (level 3 + reconsume times: 10s, 30s, 1m, 2m
    ...; ``ctx.delay_level_when_next_consume`` picks another) and come back to this listener;
    one that already came back ``max_reconsume_times`` times (16) goes to ``%DLQ%<group>`` instead.
    The committed offset is the lowest one still in flight (RocketMQ's ``removeMessage``), so a
    crash never skips an unfinished message (what finished above it is remembered, so little is
    redelivered); pulling pauses while the in-flight span is ``consume_concurrently_max_span``
    (2000) wide. ``BROADCASTING`` listeners retry failed messages in place after
    ``suspend_current_queue_time_millis`` instead (the retry topic is shared by the group).

    ``func`` may be ``async def``: its calls run on the worker process's event loop instead of
    lane threads (docs/ASYNC.md), cancelled ``cancel_grace_ms`` after the run lost its queue.

    ``consume_from_where``: as for ``orderly_listener``.
    """
    check_topic(topic)
    check_name("group", group)
    model = _message_model(message_model)
    from_where = _from_where(consume_from_where)
    _positive("consume_message_batch_max_size", consume_message_batch_max_size)
    _positive("pull_batch_size", pull_batch_size)
    _positive("max_reconsume_times", max_reconsume_times, -1)
    _positive("consume_concurrency", consume_concurrency)
    _positive("consume_concurrently_max_span", consume_concurrently_max_span)
    _positive("suspend_current_queue_time_millis", suspend_current_queue_time_millis, 10)
    _positive("cancel_grace_ms", cancel_grace_ms, 0)
    if suspend_current_queue_time_millis is not None and model is MessageModel.CLUSTERING:
        # Accepted and ignored, as key options under queue order were: a failed message of a
        # clustering group comes back through %RETRY%<group> after its delay level.
        raise ListenerError("suspend_current_queue_time_millis applies to message_model='BROADCASTING' (failed "
                            "messages retried in place); with CLUSTERING a failed message comes back through "
                            "%RETRY%<group> after its delay level (ctx.delay_level_when_next_consume): drop it")
    hook_list = _checked_hooks(ledger, hooks)

    def register(func: ListenerFunc) -> ListenerFunc:
        _check_func(func, "concurrent_listener")
        _check_grace(func, cancel_grace_ms)
        _register(ListenerSpec(
            func=func, topic=topic, group=group, message_model=model,
            consume_message_batch_max_size=consume_message_batch_max_size, pull_batch_size=pull_batch_size,
            max_reconsume_times=max_reconsume_times,
            suspend_current_queue_time_millis=suspend_current_queue_time_millis, hooks=hook_list,
            ledger=ledger, ordering=Ordering.CONCURRENT, key_concurrency=consume_concurrency,
            consume_concurrently_max_span=consume_concurrently_max_span, cancel_grace_ms=cancel_grace_ms,
            consume_from_where=from_where,
        ))
        return func

    return register


def _from_where(value: ConsumeFromWhere | str) -> ConsumeFromWhere:
    try:
        return ConsumeFromWhere.parse(value)
    except ValueError as exc:
        raise ListenerError(str(exc)) from None


def _message_model(message_model: MessageModel | str) -> MessageModel:
    if isinstance(message_model, MessageModel):
        return message_model
    try:
        return MessageModel(str(message_model).upper())
    except ValueError:
        raise ListenerError(
            f"message_model must be CLUSTERING or BROADCASTING, got {message_model!r}"
        ) from None


def _checked_hooks(ledger: object, hooks: object) -> list[ConsumeMessageHook]:
    """``hooks`` as a list, checked (``ledger`` too). Listed once: a generator checked and then
    listed again was used up by the check, and the listener ran with no hooks."""
    if ledger is not None and not isinstance(ledger, bool):
        raise ListenerError(f"ledger must be True, False or None (from MQORDER_LEDGER), got {ledger!r}")
    if hooks is None:
        return []
    if isinstance(hooks, (ConsumeMessageHook, str, bytes)) or not isinstance(hooks, Iterable):
        raise ListenerError(f"hooks must be a list of ConsumeMessageHook instances, got {hooks!r}")
    out = list(hooks)
    for h in out:
        if not isinstance(h, ConsumeMessageHook):
            raise ListenerError(f"hooks must be ConsumeMessageHook instances, got {h!r}")
    return out


def registered_listeners() -> list[ListenerSpec]:
    return list(_REGISTRY.values())


def get_listener(group: str, topic: str) -> ListenerSpec | None:
    return _REGISTRY.get((group, topic))


def unregister_listener(group: str, topic: str) -> None:
    _REGISTRY.pop((group, topic), None)
    retry = keys.retry_topic(group)
    if (group, retry) in _REGISTRY and not any(
        s.group == group and s.ordering is Ordering.CONCURRENT and not s.is_retry for s in _REGISTRY.values()
    ):
        del _REGISTRY[(group, retry)]

"""One listener call: hooks before, the listener, hooks after, and the status it really returned.

RocketMQ counts a listener that throws or returns null as a failed call (``SUSPEND_CURRENT_QUEUE_A_
MOMENT`` for an orderly listener, ``RECONSUME_LATER`` for a concurrent one). Every kind of run
calls its listener here (an ``async def`` one through ``call_listener_async``, on the process's
loop), so that rule, the hooks and the timing are written once.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mqorder.consumer.async_loop import process_loop
from mqorder.consumer.escapes import cancelled_by_run, counts_as_failure
from mqorder.consumer.hooks import (
    ConsumeMessageContext,
    ConsumeMessageHook,
    run_after,
    run_after_async,
    run_before,
    run_before_async,
)
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, MessageExt, MessageQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StatusRule:
    """What a kind of listener must return, and what anything else counts as."""

    status_type: type[Enum]
    #: What an exception, ``None`` or a value of another type counts as.
    fallback: Enum
    #: The statuses the hooks see as a success.
    successes: frozenset[Enum]
    #: What happens next when the listener raised (for the log line).
    on_raise: str
    #: Whether ``None`` is logged (an orderly listener must say what it did; RocketMQ's concurrent
    #: listeners return null for "later" often enough that it is no news).
    warn_none: bool


ORDERLY = StatusRule(
    ConsumeOrderlyStatus, ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT,
    frozenset({ConsumeOrderlyStatus.SUCCESS, ConsumeOrderlyStatus.COMMIT}), "suspending the queue", True,
)
CONCURRENT = StatusRule(
    ConsumeConcurrentlyStatus, ConsumeConcurrentlyStatus.RECONSUME_LATER,
    frozenset({ConsumeConcurrentlyStatus.CONSUME_SUCCESS}), "its messages will be retried", False,
)


def call_listener(
    rule: StatusRule, spec: ListenerSpec, hooks: list[ConsumeMessageHook], mq: MessageQueue,
    msgs: list[MessageExt], ctx: Any, epoch: int, client_id: str, run_id: str, timed: bool,
) -> tuple[Any, float, float]:
    """Call ``spec``'s listener on ``msgs``; returns its status (``rule.fallback`` for anything but
    a ``rule.status_type``), its run time in ms, and its wall-clock start in s when ``timed`` (the
    ledger records it; 0.0 otherwise, which saves a clock read per call)."""
    hook_ctx = None
    if hooks:
        hook_ctx = ConsumeMessageContext(spec.group, mq, msgs, epoch, client_id, run_id)
        run_before(hooks, hook_ctx)
    wall0 = time.time() if timed else 0.0
    t0 = time.perf_counter()
    status: Any
    try:
        status = spec.func(msgs, ctx)
    except BaseException as exc:
        if not counts_as_failure(exc):
            raise
        note_failure(ctx, exc)
        log.exception("listener %s raised on %s offsets %d..%d; %s",
                      spec.name, mq.key, msgs[0].queue_offset, msgs[-1].queue_offset, rule.on_raise)
        status = rule.fallback
    if status is not None and not isinstance(status, rule.status_type) and inspect.isawaitable(status):
        status = _awaited_on_loop(rule, spec, mq, msgs, status, ctx)
    rt = (time.perf_counter() - t0) * 1000
    status = checked_status(rule, spec, mq, status)
    if hook_ctx is not None:
        _hook_result(rule, hook_ctx, status, rt)
        run_after(hooks, hook_ctx)
    return status, rt, wall0


async def call_listener_async(
    rule: StatusRule, spec: ListenerSpec, hooks: list[ConsumeMessageHook], mq: MessageQueue,
    msgs: list[MessageExt], ctx: Any, epoch: int, client_id: str, run_id: str, timed: bool,
) -> tuple[Any, float, float]:
    """``call_listener`` for an ``async def`` listener, on the process's loop: the same hooks
    (awaited when they are ``async def``), the same status rule, the same timing. A cancellation
    (the run lost its queue) is not a listener failure: it propagates, and the run settles nothing
    of the call."""
    hook_ctx = None
    if hooks:
        hook_ctx = ConsumeMessageContext(spec.group, mq, msgs, epoch, client_id, run_id)
        await run_before_async(hooks, hook_ctx)
    wall0 = time.time() if timed else 0.0
    t0 = time.perf_counter()
    status: Any
    try:
        status = await spec.func(msgs, ctx)
    except Exception as exc:  # noqa: BLE001 - logged with its traceback by listener_raised
        status = listener_raised(rule, spec, mq, msgs, ctx, exc)
    except asyncio.CancelledError as exc:
        if cancelled_by_run():
            raise
        status = listener_raised(rule, spec, mq, msgs, ctx, exc)
    except BaseException as exc:
        if not counts_as_failure(exc):
            raise
        status = listener_raised(rule, spec, mq, msgs, ctx, exc)
    rt = (time.perf_counter() - t0) * 1000
    status = checked_status(rule, spec, mq, status)
    if hook_ctx is not None:
        _hook_result(rule, hook_ctx, status, rt)
        await run_after_async(hooks, hook_ctx)
    return status, rt, wall0


def listener_raised(rule: StatusRule, spec: ListenerSpec, mq: MessageQueue, msgs: list[MessageExt], ctx: Any,
                    exc: BaseException) -> Any:
    """What a listener call that raised ``exc`` counts as (``rule.fallback``), the failure kept and
    logged with its traceback. Call it inside the ``except`` block (``log.exception``): a key-mode
    lane calls an async listener without hooks in its own coroutine
    (``KeyConsumeRequest._lane_call_async``), not through ``call_listener_async``."""
    note_failure(ctx, exc)
    log.exception("listener %s raised on %s offsets %d..%d; %s",
                  spec.name, mq.key, msgs[0].queue_offset, msgs[-1].queue_offset, rule.on_raise)
    return rule.fallback


def _awaited_on_loop(rule: StatusRule, spec: ListenerSpec, mq: MessageQueue, msgs: list[MessageExt],
                     aw: Any, ctx: Any = None) -> Any:
    """A plain function that returned an awaitable (``functools.partial`` of an ``async def``, a
    decorator that hides one): awaited on the process's loop, so it is handled, not dropped."""
    async def wait() -> Any:
        return await aw

    try:
        return process_loop().run_blocking(wait())
    except BaseException as exc:
        # A CancelledError here is the awaitable's own (the run cancels no call of a plain listener).
        if not (isinstance(exc, asyncio.CancelledError) or counts_as_failure(exc)):
            raise
        note_failure(ctx, exc)
        log.exception("listener %s raised on %s offsets %d..%d; %s",
                      spec.name, mq.key, msgs[0].queue_offset, msgs[-1].queue_offset, rule.on_raise)
        return rule.fallback


#: A recorded failure is cut to this many characters (it travels in the commit's arguments).
FAILURE_CHARS = 500


def note_failure(ctx: Any, exc: BaseException) -> None:
    """Keep what the listener raised on the call's context (``CallContext.failure``), for the
    engine to record with the reconsume count."""
    if hasattr(ctx, "failure"):
        ctx.failure = f"{type(exc).__name__}: {exc}"[:FAILURE_CHARS]


def checked_status(rule: StatusRule, spec: ListenerSpec, mq: MessageQueue, status: Any) -> Any:
    """What the listener returned, or ``rule.fallback`` for ``None`` or a value of another type."""
    if status is None:
        if rule.warn_none:
            log.warning("listener %s returned None for %s; treating it as %s", spec.name, mq.key, rule.fallback.name)
        return rule.fallback
    if not isinstance(status, rule.status_type):
        if inspect.iscoroutine(status):
            # An async def listener's "return other()" (a plain function's coroutine is awaited):
            # closed here, so no "never awaited" warning points somewhere else.
            status.close()
            log.warning("listener %s returned a coroutine (%s), not a %s: an `await` is missing before it (return "
                        "await ...); treating it as %s", spec.name, getattr(status, "__qualname__", status),
                        rule.status_type.__name__, rule.fallback.name)
            return rule.fallback
        log.warning("listener %s returned %r, not a %s; treating it as %s",
                    spec.name, status, rule.status_type.__name__, rule.fallback.name)
        return rule.fallback
    return status


def _hook_result(rule: StatusRule, hook_ctx: ConsumeMessageContext, status: Any, rt: float) -> None:
    hook_ctx.status = status.value
    hook_ctx.success = status in rule.successes
    hook_ctx.rt_ms = rt

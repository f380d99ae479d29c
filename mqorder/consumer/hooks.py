"""Consume hooks: RocketMQ's ``ConsumeMessageHook`` in dramatiq's paired before/after shape.

A ledger, a tracer or a metrics exporter hangs here without touching the engine. Hooks run in the
consuming process around every listener call; an exception in a hook is logged, never allowed to
change the consume result.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from mqorder.consumer.async_loop import process_loop
from mqorder.consumer.escapes import cancelled_by_run, counts_as_failure
from mqorder.model import MessageExt, MessageQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefusedContext:
    """A fenced commit or lease touch was refused: the run lost its queue (or its token).

    Emitted where the engine decides it, so an audit (the chaos checker, a tracer) proves fencing
    from this record instead of parsing a log line. ``reason``: ``FENCED`` (the epoch is stale:
    somebody else owns the queue now, ``current_epoch``/``current_owner``), ``SUPERSEDED`` (the run's
    dispatch token was replaced), ``BACKWARD`` (the committed offset is already past ``offset``),
    ``AHEAD`` (the run read past the queue's end: Redis failed over to a replica that missed the
    last appends).
    """

    consumer_group: str
    sub: str
    message_queue: MessageQueue
    client_id: str
    run_id: str
    epoch: int
    reason: str
    current_epoch: int
    current_owner: str
    #: The offset the run tried to commit.
    offset: int
    #: ``time.time()`` when the refusal was seen.
    at: float
    #: The last offset the run had committed (-1: not told): the next owner reads from there, so
    #: what the run handed to listeners at or above it is delivered again (``mqorder.metrics``).
    committed: int = -1


@dataclass
class ConsumeMessageContext:
    """What a ``ConsumeMessageHook`` sees of one listener call (RocketMQ's ConsumeMessageContext):
    the group, queue, messages and fencing epoch, so tracing and metrics need no access to the engine."""

    consumer_group: str
    message_queue: MessageQueue
    msg_list: list[MessageExt]
    epoch: int
    client_id: str
    #: Unique per ConsumeRequest run: tells one run's calls from the next one's.
    run_id: str = ""
    #: Set before ``consume_message_after``: the status name, and whether it counts as success.
    status: str = ""
    success: bool = False
    rt_ms: float = 0.0
    props: dict[str, object] = field(default_factory=dict)


class ConsumeMessageHook:
    """Subclass and override either method; both default to doing nothing. Either may be
    ``async def`` (awaited on the process's loop around an async listener, run there and waited
    for around a plain one)."""

    def hook_name(self) -> str:
        return type(self).__name__

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        pass

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        pass

    def consume_refused(self, context: RefusedContext) -> None:
        """The run's fenced commit was refused; it stops, the new owner redelivers."""


_GLOBAL_HOOKS: list[ConsumeMessageHook] = []


def register_consume_message_hook(hook: ConsumeMessageHook) -> None:
    """Register a hook for every listener of this process (``registerConsumeMessageHook``)."""
    if not isinstance(hook, ConsumeMessageHook):
        raise TypeError(f"hook must be a ConsumeMessageHook, got {type(hook).__name__}")
    _GLOBAL_HOOKS.append(hook)


def unregister_consume_message_hook(hook: ConsumeMessageHook) -> None:
    if hook in _GLOBAL_HOOKS:
        _GLOBAL_HOOKS.remove(hook)


def global_hooks() -> list[ConsumeMessageHook]:
    return _GLOBAL_HOOKS


def _run(hooks: list[ConsumeMessageHook], method: str, ctx: object, when: str) -> None:
    """Call ``method`` of every hook; a failing hook is logged and never changes the consume result.
    An ``async def`` hook method is run on the process's loop and waited for (around a plain
    listener; around an ``async def`` listener the engine awaits it instead, ``_run_async``)."""
    for h in hooks:
        try:
            res = getattr(h, method)(ctx)
            if inspect.isawaitable(res):
                process_loop().run_blocking(_awaited(res))
        except BaseException as exc:
            # An async hook's CancelledError is its own (nothing cancels a hook of a plain
            # listener): once it escaped and ended the key-mode lane thread the call ran on.
            if not (isinstance(exc, asyncio.CancelledError) or counts_as_failure(exc)):
                raise
            log.exception("consume hook %s failed %s", h.hook_name(), when)


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw


async def _run_async(hooks: list[ConsumeMessageHook], method: str, ctx: object, when: str) -> None:
    for h in hooks:
        try:
            res = getattr(h, method)(ctx)
            if inspect.isawaitable(res):
                await res
        except asyncio.CancelledError:
            # The run's cancel of the call goes on up; a hook's own (it awaited a future someone
            # else cancelled) is a failing hook: it once ended the call as if the run had
            # cancelled it, and a key's next message ran before the one it left unfinished.
            if cancelled_by_run():
                raise
            log.exception("consume hook %s failed %s", h.hook_name(), when)
        except BaseException as exc:
            if not counts_as_failure(exc):
                raise
            log.exception("consume hook %s failed %s", h.hook_name(), when)


async def run_before_async(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    await _run_async(hooks, "consume_message_before", ctx, "before consume")


async def run_after_async(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    await _run_async(hooks, "consume_message_after", ctx, "after consume")


def run_before(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    _run(hooks, "consume_message_before", ctx, "before consume")


def run_after(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    _run(hooks, "consume_message_after", ctx, "after consume")


def run_refused(hooks: list[ConsumeMessageHook], ctx: RefusedContext) -> None:
    _run(hooks, "consume_refused", ctx, "on a refused commit")

"""Consume hooks: RocketMQ's ``ConsumeMessageHook`` in dramatiq's paired before/after shape.

A ledger, a tracer or a metrics exporter hangs here without touching the engine. Hooks run in the
consuming process around every listener call; an exception in a hook is logged, never allowed to
change the consume result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mqorder.model import MessageExt, MessageQueue

log = logging.getLogger(__name__)


@dataclass
class ConsumeMessageContext:
    consumer_group: str
    message_queue: MessageQueue
    msg_list: list[MessageExt]
    epoch: int
    client_id: str
    #: Set before ``consume_message_after``: the status name, and whether it counts as success.
    status: str = ""
    success: bool = False
    rt_ms: float = 0.0
    props: dict[str, object] = field(default_factory=dict)


class ConsumeMessageHook:
    """Subclass and override either method; both default to doing nothing."""

    def hook_name(self) -> str:
        return type(self).__name__

    def consume_message_before(self, context: ConsumeMessageContext) -> None:  # noqa: B027
        pass

    def consume_message_after(self, context: ConsumeMessageContext) -> None:  # noqa: B027
        pass


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


def run_before(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    for h in hooks:
        try:
            h.consume_message_before(ctx)
        except Exception:  # noqa: BLE001
            log.exception("consume hook %s failed before consume", h.hook_name())


def run_after(hooks: list[ConsumeMessageHook], ctx: ConsumeMessageContext) -> None:
    for h in hooks:
        try:
            h.consume_message_after(ctx)
        except Exception:  # noqa: BLE001
            log.exception("consume hook %s failed after consume", h.hook_name())

"""One listener call: hooks before, the listener, hooks after, and the status it really returned.

RocketMQ counts a listener that throws or returns null as a failed call (``SUSPEND_CURRENT_QUEUE_A_
MOMENT`` for an orderly listener, ``RECONSUME_LATER`` for a concurrent one). Every kind of run
calls its listener here, so that rule, the hooks and the timing are written once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook, run_after, run_before
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
    except Exception:
        log.exception("listener %s raised on %s offsets %d..%d; %s",
                      spec.name, mq.key, msgs[0].queue_offset, msgs[-1].queue_offset, rule.on_raise)
        status = rule.fallback
    rt = (time.perf_counter() - t0) * 1000
    if status is None:
        if rule.warn_none:
            log.warning("listener %s returned None for %s; treating it as %s", spec.name, mq.key, rule.fallback.name)
        status = rule.fallback
    elif not isinstance(status, rule.status_type):
        log.warning("listener %s returned %r, not a %s; treating it as %s",
                    spec.name, status, rule.status_type.__name__, rule.fallback.name)
        status = rule.fallback
    if hook_ctx is not None:
        hook_ctx.status = status.value
        hook_ctx.success = status in rule.successes
        hook_ctx.rt_ms = rt
        run_after(hooks, hook_ctx)
    return status, rt, wall0

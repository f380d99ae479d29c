"""What the consuming side measures, through the engine's own seams only.

* ``MetricsHook`` is a ``ConsumeMessageHook`` (RocketMQ's ``ConsumeMessageHook``):
  ``consume_message_after`` carries the status and ``rt_ms`` of every listener call, and
  ``consume_refused`` every refused fenced commit. It writes only to this process's metric files:
  no Redis call is added to the consume path.
* ``LingerWatch`` wraps a ``ConsumerEngine.may_linger`` (the capacity check a drained request makes
  before and while it lingers) to count the pool slots lingering right now.

Both run in whatever process consumes: a prefork child, or the main process of a threads or solo
worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook, RefusedContext
from mqorder.model import ConsumeOrderlyStatus

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    from mqorder.consumer.engine import ConsumerEngine

#: Only this status goes through RocketMQ's ``checkReconsumeTimes`` (and so, maybe, to the DLQ);
#: ROLLBACK is rolled back and retried without it.
_SUSPEND = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT.value


class LingerWatch:
    """Counts this process's ConsumeRequests that are lingering on a drained queue.

    A run lingers from the moment its capacity check says yes until a message arrives (the next
    listener call), the check says no, or the run ends. Threads of one process (the threads pool)
    linger independently, so the state is per thread and the gauge holds this process's total,
    *set* (not incremented) so a reused pid never inherits a dead process's count.
    """

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._local = threading.local()
        self._lock = threading.Lock()
        self._count = 0

    def mark(self, lingering: bool) -> None:
        if getattr(self._local, "on", False) == lingering:
            return
        self._local.on = lingering
        with self._lock:
            self._count += 1 if lingering else -1
            self.gauge.set(self._count)

    def watch(self, engine: ConsumerEngine) -> None:
        """Route ``engine``'s capacity check through this watch (once per engine)."""
        if not isinstance(engine.may_linger, _Watched):
            engine.may_linger = _Watched(engine.may_linger, self)


class _Watched:
    """``may_linger`` as before, with its answer noted by a ``LingerWatch``."""

    def __init__(self, inner: Callable[[], bool], watch: LingerWatch) -> None:
        self.inner = inner
        self.watch = watch

    def __call__(self) -> bool:
        yes = self.inner()
        self.watch.mark(yes)
        return yes


class MetricsHook(ConsumeMessageHook):
    """Consumed / suspended / DLQ totals, the call-time histogram and refused commits.

    A suspended batch sends to the DLQ the prefix of messages already reconsumed
    ``max_reconsume_times`` (``ConsumeRequest._suspend``); the hook counts the same prefix, with the
    same limit (the listener's, else the settings'), from the reconsume counts the call saw. (If
    the run is fenced at that very moment, the DLQ write is skipped and the new owner redelivers:
    the message is counted again there.) Results follow the hook's ``success`` flag, so ROLLBACK
    counts as suspended even where ``auto_commit`` makes the engine treat it as SUCCESS.
    Messages that cannot even be decoded go to the DLQ without a listener call: the exporter's
    ``mqorder_dlq_messages`` counts those too.
    """

    def __init__(
        self, consumed: Counter, duration: Histogram, refused: Counter, linger: LingerWatch,
        max_reconsume: Callable[[str, str], int],
    ) -> None:
        self.consumed = consumed
        self.duration = duration
        self.refused = refused
        self.linger = linger
        self.max_reconsume = max_reconsume

    def hook_name(self) -> str:
        return "mqorder-metrics"

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        self.linger.mark(False)  # messages arrived: whatever lingered is consuming now

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        group, topic = context.consumer_group, context.message_queue.topic
        n = len(context.msg_list)
        self.duration.labels(group, topic).observe(context.rt_ms / 1000.0)
        if context.success:
            self.consumed.labels(group, topic, "ok").inc(n)
            return
        dead = 0
        if context.status == _SUSPEND:
            limit = self.max_reconsume(group, topic)
            if limit != -1:
                while dead < n and context.msg_list[dead].reconsume_times >= limit:
                    dead += 1
        if dead:
            self.consumed.labels(group, topic, "dlq").inc(dead)
        if n > dead:
            self.consumed.labels(group, topic, "suspended").inc(n - dead)

    def consume_refused(self, context: RefusedContext) -> None:
        self.refused.labels(context.consumer_group, context.message_queue.topic, context.reason).inc()

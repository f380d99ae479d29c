"""What the consuming side measures, through the engine's own seams only.

* ``MetricsHook`` is a ``ConsumeMessageHook`` (RocketMQ's ``ConsumeMessageHook``):
  ``consume_message_before`` sees each message's born time (the end-to-end latency),
  ``consume_message_after`` carries the status and ``rt_ms`` of every listener call (and, in key
  mode, which keys are suspended now), and ``consume_refused`` every refused fenced commit (and
  so what the next owner redelivers). It writes only to this process's metric files: no Redis
  call is added to the consume path.
* ``LingerWatch`` wraps a ``ConsumerEngine.may_linger`` (the capacity check a drained request makes
  before and while it lingers) to count the pool slots lingering right now.

Both run in whatever process consumes: a prefork child, or the main process of a threads or solo
worker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook, RefusedContext
from mqorder.model import ConsumeOrderlyStatus

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    from mqorder.consumer.engine import ConsumerEngine

#: Offsets a run handed out that are remembered per queue, to count what a refused commit leaves
#: to be redelivered. A run commits at least every pulled batch (key mode: ``uncommitted_bound``,
#: a few hundred), so what is uncommitted at a refusal is always among the last ones handed out.
HANDED_KEPT = 4096
#: A suspended key not seen again for this long is forgotten by ``KeyWatch`` (its queue went to
#: another worker while its run was re-queued): well above any suspend time (30 s at most).
SUSPENDED_TTL_S = 120.0

#: Only this status goes through RocketMQ's ``checkReconsumeTimes`` (and so, maybe, to the DLQ);
#: ROLLBACK is rolled back and retried without it.
_SUSPEND = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT.value
_ROLLBACK = ConsumeOrderlyStatus.ROLLBACK.value


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


@dataclass
class _Handed:
    """What one run handed to listeners on one queue (the last ``HANDED_KEPT`` offsets)."""

    run_id: str
    offsets: deque[int] = field(default_factory=lambda: deque(maxlen=HANDED_KEPT))


class KeyWatch:
    """The keys of key-ordered listeners suspended in this process now, per (group, topic).

    A key is suspended when its call failed and not all of its messages went to the DLQ; it stops
    being so when a call of it succeeds or dead-letters all it had, when its queue's run in this
    process ends (``queue_left``; the next run is a new task, perhaps in another pool process,
    which counts the key again if it fails again), or after ``SUSPENDED_TTL_S`` without news. The
    gauge is *set* to this process's count (multiprocess ``livesum``), as ``LingerWatch`` does.
    """

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._lock = threading.Lock()
        #: (group, topic) -> {(queue key, key hash): monotonic time of the last failure}
        self._keys: dict[tuple[str, str], dict[tuple[str, int], float]] = {}

    def note(self, group: str, topic: str, queue: str, key: int, suspended: bool) -> None:
        with self._lock:
            keys = self._keys.setdefault((group, topic), {})
            if suspended:
                keys[(queue, key)] = time.monotonic()
            elif keys.pop((queue, key), None) is None:
                return
            self._publish(group, topic, keys)

    def queue_left(self, group: str, topic: str, queue: str) -> None:
        """The run of ``queue`` ended and the queue left this process (handed over, fenced, idle)."""
        with self._lock:
            keys = self._keys.get((group, topic))
            if not keys:
                return
            for k in [k for k in keys if k[0] == queue]:
                del keys[k]
            self._publish(group, topic, keys)

    def _publish(self, group: str, topic: str, keys: dict[tuple[str, int], float]) -> None:
        cutoff = time.monotonic() - SUSPENDED_TTL_S
        for k in [k for k, at in keys.items() if at < cutoff]:
            del keys[k]
        self.gauge.labels(group, topic).set(len(keys))


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

    Latency is observed at every call of a message, retries included, from its born time (the
    producer's clock; a negative skew counts as 0): a message that keeps failing is observed again
    at each retry with a larger latency, so a stuck key shows in the high quantiles while it lasts. Redeliveries: the offsets each
    run handed out are remembered per queue (``_Handed``); when that run's commit is refused, those
    at or above the offset it had last committed are what the next owner hands out again.
    """

    def __init__(
        self, consumed: Counter, duration: Histogram, refused: Counter, linger: LingerWatch,
        max_reconsume: Callable[[str, str], int], latency: Histogram | None = None,
        redeliveries: Counter | None = None, keys: KeyWatch | None = None,
        key_mode: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.consumed = consumed
        self.duration = duration
        self.refused = refused
        self.linger = linger
        self.max_reconsume = max_reconsume
        self.latency = latency
        self.redeliveries = redeliveries
        self.keys = keys
        self.key_mode = key_mode
        self._handed: dict[tuple[str, str], _Handed] = {}
        self._handed_lock = threading.Lock()

    def hook_name(self) -> str:
        return "mqorder-metrics"

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        self.linger.mark(False)  # messages arrived: whatever lingered is consuming now
        msgs = context.msg_list
        if self.latency is not None:
            now_ms = time.time() * 1000
            observe = self.latency.labels(context.consumer_group, context.message_queue.topic).observe
            for m in msgs:
                observe(max(0.0, now_ms - m.born_timestamp) / 1000.0)
        if self.redeliveries is not None and msgs:
            where = (context.consumer_group, context.message_queue.key)
            with self._handed_lock:
                handed = self._handed.get(where)
                if handed is None or handed.run_id != context.run_id:
                    handed = self._handed[where] = _Handed(context.run_id)
                handed.offsets.extend(m.queue_offset for m in msgs)

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        group, topic = context.consumer_group, context.message_queue.topic
        n = len(context.msg_list)
        self.duration.labels(group, topic).observe(context.rt_ms / 1000.0)
        if context.success:
            self.consumed.labels(group, topic, "ok").inc(n)
            self._note_key(context, suspended=False)
            return
        dead = 0
        # Key mode sends ROLLBACK through the reconsume count and the DLQ too (queue mode rolls
        # back with neither): counted as suspended, its dead letters kept the key "suspended".
        if context.status == _SUSPEND or (context.status == _ROLLBACK and self.key_mode is not None
                                          and self.key_mode(group, topic)):
            limit = self.max_reconsume(group, topic)
            if limit != -1:
                while dead < n and context.msg_list[dead].reconsume_times >= limit:
                    dead += 1
        if dead:
            self.consumed.labels(group, topic, "dlq").inc(dead)
        if n > dead:
            self.consumed.labels(group, topic, "suspended").inc(n - dead)
        self._note_key(context, suspended=n > dead)

    def _note_key(self, context: ConsumeMessageContext, suspended: bool) -> None:
        """Key mode: the call's key is suspended now, or no longer."""
        group, topic = context.consumer_group, context.message_queue.topic
        if self.keys is None or self.key_mode is None or not context.msg_list or not self.key_mode(group, topic):
            return
        h = context.msg_list[0].key_hash
        self.keys.note(group, topic, context.message_queue.key, -1 if h is None else h, suspended)

    def consume_refused(self, context: RefusedContext) -> None:
        group, topic = context.consumer_group, context.message_queue.topic
        self.refused.labels(group, topic, context.reason).inc()
        if self.redeliveries is None:
            return
        with self._handed_lock:
            handed = self._handed.pop((group, context.message_queue.key), None)
        committed = context.committed
        if handed is None or handed.run_id != context.run_id or committed < 0:
            return
        again = len({o for o in handed.offsets if o >= committed})
        if again:
            self.redeliveries.labels(group, topic).inc(again)

    def run_ended(self, group: str, topic: str, queue: str, verb: str) -> None:
        """A run of ``queue`` ended with ``verb`` (``mqorder.metrics.worker.after_run``)."""
        if verb in _DUPLICATE:  # a duplicate task: the queue's real run may still be on
            return
        # A run that requeues itself (a suspended key waiting out its suspend: the stuck-key case
        # this gauge is for) keeps its keys: clearing them here made the gauge read 0 nearly all
        # the time. Its next run may be in another pool process, which notes the key again: for up
        # to SUSPENDED_TTL_S a key may count in two processes, rather than in none (docs/METRICS.md).
        if self.keys is not None and verb != "REQUEUE":
            self.keys.queue_left(group, topic, queue)
        with self._handed_lock:
            self._handed.pop((group, queue), None)


#: Run endings of a duplicate task, which leave the queue's real run (elsewhere) as it was.
_DUPLICATE = frozenset({"STALE", "BUSY"})

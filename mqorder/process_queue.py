"""``ProcessQueue``: the client-side snapshot of one message queue (RocketMQ's ``ProcessQueue``).

Java keeps two ``TreeMap``s keyed by queue offset; here:

* ``msg_tree`` (offset -> message) with ``_order``, its offsets ascending, holds pulled messages
  not yet handed to the listener;
* ``consuming`` (``consumingMsgOrderlyTreeMap``) holds messages handed out but not yet committed.

``take_messages`` moves the lowest offsets from the first to the second; ``commit`` forgets the
consuming ones and returns the next offset to persist; ``rollback`` and
``make_message_to_consume_again`` put them back so they are handed out again *first*, which is
what keeps a retried message ahead of every later offset (invariant 1).

Why plain dicts and a list rather than sorted maps: at consume batch 1 this class runs once per
message, and a pure-Python sorted map cost a tree insert, a tree pop and a tree clear per message
(about a third of the engine's client CPU at batch 1, cProfile). Offsets arrive almost always in
order (a pull reads the stream forward), so ``_order`` is appended to, and re-sorted only when a
message is put back (timsort merges the two sorted runs in linear time); nothing needs the
consuming map sorted: ``commit`` takes its highest offset with ``max``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from mqorder.model import MessageExt

#: RocketMQ's ``REBALANCE_LOCK_MAX_LIVE_TIME``: the client stops trusting its lock after 30 s
#: without a successful lock or fenced commit.
DEFAULT_LOCK_EXPIRE_MS = 30_000


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


class ProcessQueue:
    def __init__(self, lock_expire_ms: int = DEFAULT_LOCK_EXPIRE_MS) -> None:
        self.msg_tree: dict[int, MessageExt] = {}
        #: ``msg_tree``'s offsets, ascending: the hand-out order.
        self._order: list[int] = []
        self.consuming: dict[int, MessageExt] = {}
        self.tree_lock = threading.RLock()
        self.msg_count = 0
        self.msg_size = 0
        self._consuming_size = 0
        self.queue_offset_max = -1
        self.dropped = False
        self.lock_expire_ms = lock_expire_ms
        self.last_lock_timestamp = _now_ms()

    # -- lock bookkeeping (the truth is in Redis; this is the client's view) --------------------

    def mark_locked(self) -> None:
        """A fenced call just confirmed the lock: trust it for another ``lock_expire_ms``."""
        self.last_lock_timestamp = _now_ms()

    def is_lock_expired(self) -> bool:
        return _now_ms() - self.last_lock_timestamp > self.lock_expire_ms

    # -- filling ---------------------------------------------------------------------------------

    def put_messages(self, msgs: Iterable[MessageExt]) -> None:
        """Add pulled messages; an offset already held (pending or consuming) is ignored.

        The ConsumeRequest that pulled them consumes them itself, so unlike RocketMQ's
        ``putMessage`` this never asks for a dispatch: Redis decides who runs (``begin.lua``).
        """
        with self.tree_lock:
            tree, consuming = self.msg_tree, self.consuming
            new: dict[int, MessageExt] = {}
            for m in msgs:
                o = m.queue_offset
                if o not in new and o not in tree and o not in consuming:
                    new[o] = m
            if new:
                tree.update(new)
                self._add_order(new)
                self.msg_count += len(new)
                self.msg_size += sum(len(m.body) for m in new.values())
                top = max(new)
                if top > self.queue_offset_max:
                    self.queue_offset_max = top

    def _add_order(self, offsets: Iterable[int]) -> None:
        """Add new offsets (none already in ``_order``) to the hand-out order, keeping it ascending."""
        added = sorted(offsets)  # a pull's offsets come ascending: linear
        order = self._order
        if order and added and added[0] < order[-1]:
            order.extend(added)
            order.sort()  # two sorted runs: timsort merges them in linear time
        else:
            order.extend(added)

    # -- consuming -------------------------------------------------------------------------------

    def take_messages(self, batch_size: int) -> list[MessageExt]:
        """Hand out up to ``batch_size`` messages with the lowest offsets."""
        with self.tree_lock:
            tree, order = self.msg_tree, self._order
            if not order:
                return []
            if batch_size >= len(order):
                # The common case at consume batch >= what is left of the pull: move everything.
                out = [tree[o] for o in order]
                self.consuming.update(tree)
                tree.clear()
                order.clear()
            elif batch_size == 1:
                o = order.pop(0)
                m = tree.pop(o)
                self.consuming[o] = m
                out = [m]
            else:
                head = order[:batch_size]
                del order[:batch_size]
                out = [tree.pop(o) for o in head]
                self.consuming.update(zip(head, out, strict=True))
            self._consuming_size += sum(len(m.body) for m in out)
            return out

    def commit(self) -> int:
        """Forget the consuming messages; return the next offset to persist, or -1 if none."""
        with self.tree_lock:
            consuming = self.consuming
            if not consuming:
                return -1
            offset = max(consuming)
            self.msg_count -= len(consuming)
            self.msg_size -= self._consuming_size
            self._consuming_size = 0
            consuming.clear()
            return offset + 1

    def rollback(self) -> None:
        """Put every consuming message back (``ROLLBACK``, or a stop before commit)."""
        with self.tree_lock:
            self.msg_tree.update(self.consuming)
            self._order.extend(self.consuming)
            self._order.sort()
            self.consuming.clear()
            self._consuming_size = 0

    def make_message_to_consume_again(self, msgs: Iterable[MessageExt]) -> None:
        """Put ``msgs`` back so they are handed out again before any later offset."""
        with self.tree_lock:
            tree = self.msg_tree
            back = []
            for m in msgs:
                o = m.queue_offset
                if self.consuming.pop(o, None) is not None:
                    self._consuming_size -= len(m.body)
                if o not in tree:
                    back.append(o)
                tree[o] = m
            if back:
                self._order.extend(back)
                self._order.sort()

    def offsets(self) -> list[int]:
        """Offsets pulled and not yet handed out, ascending (the order ``take_messages`` follows)."""
        with self.tree_lock:
            return list(self._order)

    def clear(self) -> None:
        with self.tree_lock:
            self.msg_tree.clear()
            self._order.clear()
            self.consuming.clear()
            self.msg_count = 0
            self.msg_size = 0
            self._consuming_size = 0
            self.queue_offset_max = -1

    # -- flow control and views ------------------------------------------------------------------

    def is_full(self, threshold_count: int, threshold_size: int | None = None) -> bool:
        """Flow control: RocketMQ stops pulling at ``pullThresholdForQueue`` messages."""
        if self.msg_count >= threshold_count:
            return True
        return threshold_size is not None and self.msg_size >= threshold_size

"""``ProcessQueue``: the client-side snapshot of one message queue (RocketMQ's ``ProcessQueue``).

Two sorted maps keyed by queue offset, as in Java's ``TreeMap`` pair:

* ``msg_tree`` holds pulled messages not yet handed to the listener;
* ``consuming`` (``consumingMsgOrderlyTreeMap``) holds messages handed out but not yet committed.

``take_messages`` moves the lowest offsets from the first to the second; ``commit`` forgets the
consuming ones and returns the next offset to persist; ``rollback`` and
``make_message_to_consume_again`` put them back so they are handed out again *first*, which is
what keeps a retried message ahead of every later offset (invariant 1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from sortedcontainers import SortedDict

from mqorder.model import MessageExt

#: RocketMQ's ``REBALANCE_LOCK_MAX_LIVE_TIME``: the client stops trusting its lock after 30 s
#: without a successful lock or fenced commit.
DEFAULT_LOCK_EXPIRE_MS = 30_000


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


class ProcessQueue:
    def __init__(self, lock_expire_ms: int = DEFAULT_LOCK_EXPIRE_MS) -> None:
        self.msg_tree: SortedDict = SortedDict()
        self.consuming: SortedDict = SortedDict()
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
                # One bulk insert per pulled batch (sortedcontainers sorts it in C), not one
                # tree insert per message: this is on the hot path of every pull.
                tree.update(new)
                self.msg_count += len(new)
                self.msg_size += sum(len(m.body) for m in new.values())
                top = max(new)
                if top > self.queue_offset_max:
                    self.queue_offset_max = top

    # -- consuming -------------------------------------------------------------------------------

    def take_messages(self, batch_size: int) -> list[MessageExt]:
        """Hand out up to ``batch_size`` messages with the lowest offsets."""
        with self.tree_lock:
            tree, consuming = self.msg_tree, self.consuming
            if not tree:
                return []
            if batch_size >= len(tree):
                # The common case (consume batch >= what is left of the pull): move everything
                # in bulk instead of popping the tree one offset at a time.
                out = list(tree.values())
                consuming.update(tree)
                tree.clear()
            else:
                out = []
                for _ in range(batch_size):
                    offset, msg = tree.popitem(0)
                    consuming[offset] = msg
                    out.append(msg)
            self._consuming_size += sum(len(m.body) for m in out)
            return out

    def commit(self) -> int:
        """Forget the consuming messages; return the next offset to persist, or -1 if none."""
        with self.tree_lock:
            if not self.consuming:
                return -1
            offset = self.consuming.keys()[-1]
            self.msg_count -= len(self.consuming)
            self.msg_size -= self._consuming_size
            self._consuming_size = 0
            self.consuming.clear()
            return offset + 1

    def rollback(self) -> None:
        """Put every consuming message back (``ROLLBACK``, or a stop before commit)."""
        with self.tree_lock:
            self.msg_tree.update(self.consuming)
            self.consuming.clear()
            self._consuming_size = 0

    def make_message_to_consume_again(self, msgs: Iterable[MessageExt]) -> None:
        """Put ``msgs`` back so they are handed out again before any later offset."""
        with self.tree_lock:
            for m in msgs:
                if self.consuming.pop(m.queue_offset, None) is not None:
                    self._consuming_size -= len(m.body)
                self.msg_tree[m.queue_offset] = m

    def clear(self) -> None:
        with self.tree_lock:
            self.msg_tree.clear()
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

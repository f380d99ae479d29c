"""``ConcurrentLanes``: the pulled messages of one queue of a concurrent listener, in no order.

The concurrent counterpart of ``KeyLanes`` with the same interface, so ``KeyConsumeRequest``'s
dispatcher drives both: here any ready message may go out beside any other. ``take`` hands out up
to ``batch_max`` of the lowest ready offsets (lowest first keeps the committed offset, the lowest
unfinished one, moving), all of one topic: a retry topic holds messages of several original
topics, and one call goes to one listener. A batch is known by its first offset while it runs.

A batch that failed in place (broadcasting listeners, which have no retry topic) is held back for
its suspend time and then becomes ready again; the others keep flowing.
"""

from __future__ import annotations

import heapq

from mqorder.model import MessageExt


class ConcurrentLanes:
    def __init__(self, batch_max: int) -> None:
        self.batch_max = max(1, batch_max)
        self._ready: list[tuple[int, MessageExt]] = []  # (offset, message)
        #: Batches in flight, by first offset.
        self.busy: set[int] = set()
        #: Batches held back after an in-place failure: first offset -> until (monotonic s).
        self.blocked: dict[int, float] = {}
        self._held: dict[int, list[MessageExt]] = {}
        self._unblock: list[tuple[float, int]] = []
        #: Messages pulled and not handed out (held ones included).
        self.buffered = 0

    def put(self, msg: MessageExt) -> None:
        heapq.heappush(self._ready, (msg.queue_offset, msg))
        self.buffered += 1

    def take(self, batch_max: int) -> tuple[int, list[MessageExt]] | None:
        ready = self._ready
        if not ready:
            return None
        first = heapq.heappop(ready)[1]
        msgs = [first]
        topic = first.topic
        while ready and len(msgs) < batch_max and ready[0][1].topic == topic:
            msgs.append(heapq.heappop(ready)[1])
        self.buffered -= len(msgs)
        key = first.queue_offset
        self.busy.add(key)
        return key, msgs

    def done(self, key: int) -> None:
        self.busy.discard(key)

    def release(self, key: int) -> None:
        self.busy.discard(key)

    def retry(self, key: int, msgs: list[MessageExt], until: float) -> None:
        self.busy.discard(key)
        if not msgs:
            return
        self._held[key] = list(msgs)
        self.buffered += len(msgs)
        self.blocked[key] = until
        heapq.heappush(self._unblock, (until, key))

    def unblock(self, now: float) -> None:
        q = self._unblock
        while q and q[0][0] <= now:
            until, key = heapq.heappop(q)
            if self.blocked.get(key) != until:
                continue
            del self.blocked[key]
            for m in self._held.pop(key):
                heapq.heappush(self._ready, (m.queue_offset, m))

    def next_unblock(self) -> float | None:
        q = self._unblock
        while q and self.blocked.get(q[0][1]) != q[0][0]:
            heapq.heappop(q)
        return q[0][0] if q else None

    def ready_count(self) -> int:
        """Batches that could be handed out now (what decides whether to pull more)."""
        return -(-len(self._ready) // self.batch_max)

    def clear(self) -> None:
        self._ready.clear()
        self.busy.clear()
        self.blocked.clear()
        self._held.clear()
        self._unblock.clear()
        self.buffered = 0

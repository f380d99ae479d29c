"""``KeyLanes``: the pulled messages of one queue, split into one lane per sharding key.

The key-ordered counterpart of ``ProcessQueue`` (``ordering="key"``). Each lane holds its key's
messages in offset order; a lane is *busy* while a call of its key runs, and *blocked* until a
time after its key suspended. ``take`` hands out the head of a lane that is neither, so

* never two calls of one key at once (a busy lane hands out nothing),
* a key's later message never before its earlier unfinished one (only a lane's head goes out, and
  a suspended batch goes back to the head of its lane: ``make_message_to_consume_again``),
* a suspended key holds back only itself: the other lanes stay ready.

Among ready lanes the one with the lowest head offset goes first, so the committed offset (the
lowest unfinished one) keeps moving. Used by one thread only (the run's dispatcher); the calls
themselves run elsewhere and report back to that thread.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol

from mqorder.model import MessageExt

#: The lane of messages sent without a sharding key (``key_hash`` None): one key per queue.
NO_KEY = -1


def lane_key(msg: MessageExt) -> int:
    h = msg.key_hash
    return NO_KEY if h is None else h


class Lanes(Protocol):
    """What ``KeyConsumeRequest``'s dispatcher needs of its lanes: ``KeyLanes`` (one call at a
    time per key) or ``ConcurrentLanes`` (any message beside any other)."""

    busy: set[int]
    blocked: dict[int, float]
    buffered: int

    def put(self, msg: MessageExt) -> None: ...
    def take(self, batch_max: int) -> tuple[int, list[MessageExt]] | None: ...
    def done(self, key: int) -> None: ...
    def release(self, key: int) -> None: ...
    def retry(self, key: int, msgs: list[MessageExt], until: float) -> None: ...
    def unblock(self, now: float) -> None: ...
    def next_unblock(self) -> float | None: ...
    def ready_count(self) -> int: ...
    def clear(self) -> None: ...


class KeyLanes:
    def __init__(self) -> None:
        self.lanes: dict[int, deque[MessageExt]] = {}
        self.busy: set[int] = set()
        self.blocked: dict[int, float] = {}
        self._ready: list[tuple[int, int]] = []  # (head offset, key), validated when popped
        self._unblock: list[tuple[float, int]] = []  # (until, key)
        #: Messages in lanes, not handed out.
        self.buffered = 0
        #: Keys busy or blocked that have a lane (messages waiting): kept as lanes change, so
        #: ``ready_count`` (asked at every turn of the dispatcher) costs nothing per key in flight.
        self._held = 0

    def put(self, msg: MessageExt) -> None:
        """Add a pulled message (pulls come in offset order, so it goes to its lane's tail)."""
        h = msg.key_hash  # (``lane_key``, inline: once per pulled message)
        key = NO_KEY if h is None else h
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = deque()
        lane.append(msg)
        self.buffered += 1
        if len(lane) == 1:
            if key in self.busy or key in self.blocked:
                self._held += 1
            else:
                self._maybe_ready(key)

    def _maybe_ready(self, key: int) -> None:
        lane = self.lanes.get(key)
        if lane and key not in self.busy and key not in self.blocked:
            heapq.heappush(self._ready, (lane[0].queue_offset, key))

    def take(self, batch_max: int) -> tuple[int, list[MessageExt]] | None:
        """The head (up to ``batch_max`` messages) of the ready lane with the lowest head offset,
        now busy; None when no lane is ready."""
        ready = self._ready
        while ready:
            off, key = heapq.heappop(ready)
            lane = self.lanes.get(key)
            if not lane or key in self.busy or key in self.blocked or lane[0].queue_offset != off:
                continue  # a stale entry: the lane was taken, emptied or blocked since
            n = min(batch_max, len(lane))
            msgs = [lane.popleft() for _ in range(n)]
            if not lane:
                del self.lanes[key]
            else:
                self._held += 1
            self.buffered -= n
            self.busy.add(key)
            return key, msgs
        return None

    def done(self, key: int) -> None:
        """The call of ``key`` ended and its messages finished: its lane may go on."""
        self.release(key)
        self._maybe_ready(key)

    def release(self, key: int) -> None:
        """``key`` is no longer busy (its call ended), without handing its lane out again."""
        if key in self.busy:
            self.busy.discard(key)
            if key in self.lanes and key not in self.blocked:
                self._held -= 1

    def retry(self, key: int, msgs: list[MessageExt], until: float) -> None:
        """The call of ``key`` suspended: its messages go back to the head of the lane, which is
        blocked until ``until`` (monotonic seconds)."""
        back = list(msgs)
        lanes = self.lanes
        was_held = key in lanes and (key in self.busy or key in self.blocked)
        self.busy.discard(key)
        if back:
            lane = lanes.get(key)
            if lane is None:
                lane = lanes[key] = deque()
            lane.extendleft(reversed(back))
            self.buffered += len(back)
        self.blocked[key] = until
        self._held += (key in lanes) - was_held
        heapq.heappush(self._unblock, (until, key))

    def unblock(self, now: float) -> None:
        """Lanes whose suspend time is over become ready again."""
        q = self._unblock
        while q and q[0][0] <= now:
            until, key = heapq.heappop(q)
            if self.blocked.get(key) == until:
                del self.blocked[key]
                if key in self.lanes and key not in self.busy:
                    self._held -= 1
                self._maybe_ready(key)

    def next_unblock(self) -> float | None:
        """When the earliest blocked lane becomes ready (monotonic seconds), None if none is."""
        q = self._unblock
        while q and self.blocked.get(q[0][1]) != q[0][0]:
            heapq.heappop(q)
        return q[0][0] if q else None

    def held_heads(self) -> list[tuple[int, float]]:
        """(head offset, until) of every blocked lane with messages: what a commit keeps for the
        next run (``KeyConsumeRequest._held``)."""
        lanes = self.lanes
        return [(lane[0].queue_offset, until) for key, until in self.blocked.items() if (lane := lanes.get(key))]

    def ready_count(self) -> int:
        """Lanes that could be handed out now (messages waiting, neither busy nor blocked): what
        decides whether to pull more. Counting messages instead would let one blocked key with a
        long lane stop the pulls of its whole queue."""
        return len(self.lanes) - self._held

    def clear(self) -> None:
        self.lanes.clear()
        self.busy.clear()
        self.blocked.clear()
        self._ready.clear()
        self._unblock.clear()
        self.buffered = 0
        self._held = 0

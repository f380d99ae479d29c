"""``LaneCalls``: where a key-ordered or concurrent run's listener calls go, and how they come back.

The seam between the run's dispatcher and the listener: a plain listener's call goes to a lane
worker (a thread, a greenlet under gevent: ``lane_workers``), an ``async def`` listener's to the
process's event loop (``async_loop``) as a task. Either way the call ends by putting one
``LaneResult`` in the run's ``results`` queue, which the dispatcher settles, commits and fences
exactly the same way: the engine's commit/fence logic is not copied for async listeners.

Where a run is the only one of its process using the loop (a prefork child, solo), it claims the
loop (``ProcessLoop.claim``) and drives it in its own thread while it waits for results
(``next_result``): a call's task is made at once and its result is read without a wake-up of
another thread. The run gives the loop back when it has no call in flight and would block on
something else (a lingering read, a suspended key's wait), when another run starts using the loop,
and when it ends; otherwise the loop's own thread runs it, as before. While it drives the loop, a
key-ordered run settles each success in the step of the loop that ends the call and submits the
next ready lane's call from there (``next_result``'s ``fast``): the dispatcher comes back once per
commit (``pull_n`` finished messages), for a starved place, or after its timeout, not once per
result.

What only the loop can do is cancel: a run that lost its queue cancels its async calls still in
flight after the listener's grace (``cancel_after_grace``); their results come back marked
cancelled, and the run settles nothing of a lost queue anyway (the new owner redelivers).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mqorder.consumer import native
from mqorder.consumer.async_loop import AsyncCall, ProcessLoop
from mqorder.consumer.lane_workers import LANE_POOL, LaneResult, LaneWorkers

log = logging.getLogger(__name__)


class LaneCalls:
    """The calls of one run: lane workers borrowed on first plain call, async calls by lane key."""

    def __init__(self, size: int, put: Callable[[LaneResult | list[LaneResult]], None], grace_s: float,
                 max_in_flight: int | None = None) -> None:
        self.size = size
        #: The process cap of the run's settings (``async_max_in_flight``).
        self.max_in_flight = max_in_flight
        self._put = put
        self.grace_s = grace_s
        self._pool: LaneWorkers | None = None
        self._loop: ProcessLoop | None = None
        self._hand: Callable[[Callable[..., Any], Any], None] | None = None
        #: Async calls in flight, by lane key (one call per key at a time).
        self.calls: dict[int, AsyncCall] = {}
        self._lost_at: float | None = None
        self._cancelled = False
        #: Async results of this turn of the loop, handed over together (loop thread only).
        self._done: list[LaneResult] = []
        #: This run drives the loop itself (``ProcessLoop.claim``).
        self.inline = False
        #: While the run drives the loop waiting for a result (``next_result``'s ``fast``): settles
        #: a result right where it ends, in the run's own thread, True when it did (``deliver``).
        self._fast: Callable[[LaneResult], bool] | None = None
        #: The dispatcher's context when the run began: each async call runs in a copy of it.
        self._context = contextvars.copy_context()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """A plain listener's call, on a lane worker (borrowed from ``LANE_POOL`` on first use)."""
        if self._pool is None:
            self._pool = LANE_POOL.borrow(self.size)
        self._pool.submit(fn, *args)

    def submit_async(self, name: str, key: int, make: Callable[[], Coroutine[Any, Any, None]],
                     skipped: LaneResult) -> None:
        """An async listener's call (``make()`` reports its result with ``deliver``), on the loop;
        ``skipped`` is reported instead if it is cancelled before it started."""
        loop = self._loop
        if loop is None:
            loop = self._loop = ProcessLoop.get(self.max_in_flight)
            self._hand = native.to_caller()  # in the dispatcher's thread: its hub under gevent
            loop.enter_run()
        if not self.inline and not self.calls:
            self.inline = loop.claim()
        # Each call's task runs in a fresh copy of the run's context as it began: a ContextVar one
        # call sets is never seen by another. (A call submitted as another ends, ``next_result``'s
        # ``fast``, would otherwise copy the ending call's context.)
        context = self._context.copy()
        if self.inline:
            self.calls[key] = loop.submit_inline(name, make, lambda: self.deliver(skipped), context)
        else:
            self.calls[key] = loop.submit(name, make, lambda: self.deliver(skipped), context)

    def next_result(self, results: queue.SimpleQueue[Any], timeout: float | None,
                    fast: Callable[[LaneResult], bool] | None = None) -> Any:
        """The next item of ``results`` within ``timeout`` (None: as long as it takes), or None.
        A run that drives the loop runs it meanwhile, here in its own thread; ``fast`` then gets
        each result as its call ends, on this thread, and keeps it (True) or leaves it to
        ``results`` (False). A run whose ``fast`` settled everything comes back on ``wake`` or
        after ``timeout``, not once per result: a stop and a restart of the loop (about 20 µs on
        this machine) and a turn of the dispatcher per call were most of an async call's cost."""
        if self.inline:
            if not results.empty():
                return results.get_nowait()  # this thread is the queue's one reader
            loop = self._loop
            assert loop is not None
            if not loop.release_asked:
                self._fast = fast
                try:
                    loop.drive(timeout)
                finally:
                    self._fast = None
                return None if results.empty() else results.get_nowait()
            self.release()  # another run wants the loop: its own thread runs it from now on
        try:
            return results.get(timeout=timeout)
        except queue.Empty:
            return None

    def put_plain(self, res: LaneResult) -> None:
        """A plain call's result, from its lane worker. A run driving the loop waits in ``drive``,
        which only the loop's own work stops: it is woken, or it would wait for an async result
        that may never come (a retry run serving an async and a plain listener, once its async
        calls had ended, waited for ever for its plain ones). (A wake-up that comes after the
        run stopped driving only makes a later ``drive`` return early.)"""
        self._put(res)
        if self.inline:
            loop = self._loop
            if loop is not None:
                loop.loop.call_soon_threadsafe(loop.loop.stop)

    def release(self) -> None:
        """Stop driving the loop (the run blocks on something else next, or ends); its own
        thread runs it again, and runs the calls still in flight."""
        if self.inline:
            self.inline = False
            assert self._loop is not None
            self._loop.release()

    def deliver(self, res: LaneResult) -> None:
        """Called on the loop's thread: the results of the calls that end in one turn of the loop
        go to the dispatcher together, at the end of the turn (one wake-up of its thread, not one
        per call: that hand-over was the largest cost of an async call). While the run drives the
        loop, its ``fast`` settles the result here first (``next_result``)."""
        fast = self._fast
        if fast is not None and fast(res):
            return
        done = self._done
        done.append(res)
        if len(done) == 1:
            assert self._loop is not None
            self._loop.loop.call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._done = self._done, []
        assert self._hand is not None
        self._hand(self._put, batch)
        if self.inline:
            # Only the run's own thread runs the loop now (``drive``): back to the dispatcher.
            assert self._loop is not None
            self._loop.loop.stop()

    def wake(self) -> None:
        """Bring the run driving the loop back to its dispatcher at the end of this turn of the loop
        (a ``fast`` settle found work only the dispatcher does: a commit, a pull)."""
        if self.inline:
            assert self._loop is not None
            self._loop.loop.stop()

    def ended(self, key: int) -> None:
        self.calls.pop(key, None)

    def wait_for_lost(self) -> float | None:
        """The run lost its queue and waits for its calls: how long to wait for the next result
        before looking again (None: as long as it takes). Async calls get ``grace_s`` from the
        first time this is asked, then are cancelled; plain calls cannot be, and are waited for."""
        if not self.calls or self._cancelled:
            return None
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at = now
        left = self._lost_at + self.grace_s - now
        if left > 0:
            return left
        self.cancel_all(f"its run lost the queue {self.grace_s:.1f} s ago")
        return None

    def cancel_all(self, why: str) -> None:
        if self.calls and not self._cancelled:
            log.warning("cancelling %d async listener call(s) in flight: %s; nothing they did is committed",
                        len(self.calls), why)
        self._cancelled = True
        for call in self.calls.values():
            call.cancel()

    def close(self) -> None:
        self.release()
        if self._loop is not None:
            self._loop.leave_run()
            self._loop = None
        if self._pool is not None:
            LANE_POOL.give_back(self._pool)
            self._pool = None

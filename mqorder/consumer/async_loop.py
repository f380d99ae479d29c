"""The process's asyncio loop: where every ``async def`` listener call of a worker process runs.

Why one loop per process in its own thread: a Celery pool gives mqorder a thread (prefork child,
threads pool, solo) or a greenlet (gevent) per ConsumeRequest run, never an event loop, and Celery
cannot run a coroutine as a task. So the run's dispatcher stays where it is, doing the fenced
Redis work exactly as for a plain listener, and only the listener call moves: it is submitted to
this loop (``submit``), and its result comes back to the dispatcher the way a lane thread's does.
Thousands of calls in flight then cost a coroutine each, not a thread each.

* **Where it runs.** A native OS thread of the process, started on first use (after the fork: a
  prefork child starts its own; ``ProcessLoop.get`` is per pid). Under ``-P gevent`` it is still
  a native thread with the platform selector (``native``); the dispatchers stay greenlets of the
  hub's thread and results reach them through the hub's thread-safe callback.
* **A task per call.** Each call is a task of its own (``_run_call``), with its own copy of the
  submitting thread's context: a ``ContextVar`` a listener sets (a request id, structlog's bound
  values) never leaks into another message's call. (Running the next call of a run in the task
  of the call that just ended saved about a tenth of an async key-mode call's CPU, but leaked
  exactly that, across keys; it was taken out.)
* **Bounds.** Each run keeps at most ``key_concurrency`` calls in flight (queue mode: one);
  the process caps all of them together at ``max_in_flight`` (the ``async_max_in_flight``
  setting, ``MQORDER_ASYNC_MAX_IN_FLIGHT``, default 10,000): a call past the cap waits for a slot on the loop before its listener starts.
* **A blocked loop is seen.** A watchdog thread posts a ping every ``PING_S`` and measures how late
  the loop ran it (``lag``, exported as ``mqorder_event_loop_lag_seconds``). While a ping is
  late it samples the task running on the loop every ``SAMPLE_S``; the same task at every sample,
  ``BLOCKED_S`` after the loop was last seen free, means one step of one call holds the loop
  (``time.sleep``, CPU work, a blocking client): the watchdog names that listener in a warning,
  once per episode, instead of every key of the process silently slowing down. (A loop merely busy with many short steps shows as lag only.)
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mqorder.consumer import native
from mqorder.consumer.escapes import mark_own_thread
from mqorder.errors import ConfigError

log = logging.getLogger(__name__)

#: Calls of all runs of one process in flight at once until a run passes the ``async_max_in_flight``
#: setting (``ProcessLoop.get``): the setting's default.
DEFAULT_MAX_IN_FLIGHT = 10_000
#: The watchdog's period while the loop answers; while a ping is late it samples every
#: ``SAMPLE_S``. ``BLOCKED_S``: how long one step may hold the loop before it is named.
PING_S = 0.1
SAMPLE_S = 0.025
BLOCKED_S = 0.25
#: ``lag()`` reports the worst lateness over this many seconds.
LAG_WINDOW_S = 1.0
#: A run may claim the loop (``ProcessLoop.claim``) only when no other thread gave it work for
#: this long (a queue-mode async run of a threads pool beside it).
FOREIGN_QUIET_S = 1.0


#: Called with the loop's lag (s, the worst over ``LAG_WINDOW_S``) after each ping, from the
#: watchdog's thread, in every process (the worker's metrics register a gauge's ``set`` here in
#: the main process; forked children inherit it).
LAG_OBSERVERS: list[Callable[[float], None]] = []


class AsyncCall:
    """One listener call submitted to the loop: the dispatcher may ``cancel`` it (thread-safe).

    ``make`` creates the call's coroutine when a slot of the process cap is free; a coroutine
    never started cannot report anything, so a call cancelled before it started calls
    ``on_skipped`` instead (the run still gets exactly one result per call)."""

    __slots__ = ("_loop", "name", "make", "on_skipped", "task", "started", "cancel_asked", "context")

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, make: Callable[[], Coroutine[Any, Any, None]],
                 on_skipped: Callable[[], None], context: contextvars.Context | None = None) -> None:
        self._loop = loop
        self.name = name
        self.make = make
        self.on_skipped = on_skipped
        self.task: asyncio.Task[None] | None = None
        self.started = False
        self.cancel_asked = False
        #: The context the call's task runs in: given, or a copy of the submitting thread's now
        #: (``create_task`` without one would copy the context of the callback that starts it,
        #: the first submitter's of a burst: another run's ContextVars).
        self.context = contextvars.copy_context() if context is None else context

    def cancel(self) -> None:
        self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self.cancel_asked = True
        if self.task is not None and self.started:
            self.task.cancel()


class HubExecutor(ThreadPoolExecutor):
    """The loop's default executor under gevent: ``run_in_executor`` work runs as a greenlet of
    the hub's thread (where gevent's sockets and resolver work) and its result comes back to the
    loop thread-safely. Blocking work there holds the hub as any greenlet does; CPU-heavy work
    belongs in a process pool under gevent, as it would anyway. A ``ThreadPoolExecutor`` by type
    only (asyncio takes no other as default), none of whose threads is ever started."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        gevent = native.gevent_module()
        self._spawn = gevent.spawn
        self._run_in_hub = gevent.get_hub().loop.run_callback_threadsafe

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Called on the loop's thread (``run_in_executor``); an asyncio future is taken as is."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        loop = self._loop

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        def job() -> None:
            try:
                v = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed back to the awaiting coroutine
                loop.call_soon_threadsafe(settle, False, exc)
            else:
                loop.call_soon_threadsafe(settle, True, v)

        self._run_in_hub(self._spawn, job)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to stop: the greenlets belong to the hub."""


class ProcessLoop:
    """The loop of this process (``get``), its thread, the in-flight cap and the lag watchdog."""

    _instance: ProcessLoop | None = None
    _lock = threading.Lock()

    def __init__(self, max_in_flight: int | None = None) -> None:
        self.pid = os.getpid()
        self.max_in_flight = max_in_flight or DEFAULT_MAX_IN_FLIGHT
        self.loop = asyncio.SelectorEventLoop(native.new_selector())
        if native.gevent_patched():
            # The standard executor's threads would be greenlets of the loop's thread, whose hub
            # never runs: every run_in_executor (a client's getaddrinfo too) would hang. Made
            # here, in the thread of the hub that will run the work.
            self.loop.set_default_executor(HubExecutor(self.loop))
        #: Free places under the process cap, and the calls waiting for one (loop thread only;
        #: a counter and futures rather than ``asyncio.Semaphore``, whose ``acquire`` is one more
        #: coroutine per call).
        self._free = self.max_in_flight
        #: The cap ``_free`` was last counted against (written on the loop's thread only).
        self._applied_cap = self.max_in_flight
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._gevent = native.gevent_patched()
        #: The thread that drives the loop instead of its own (``claim``), None: the loop's thread.
        self._owner: int | None = None
        self._claim_lock = threading.Lock()
        self._handing = False
        self._parked = threading.Event()
        self._resume = threading.Event()
        self._release_asked = False
        self._foreign_at = 0.0
        #: Runs submitting calls now (``enter_run``).
        self._runs = 0
        #: The loop's own thread (set when it starts).
        self.thread_id = 0
        #: Tasks of ``run_blocking``, held until they end (``_keep``).
        self._background: set[asyncio.Task[None]] = set()
        #: Calls submitted from other threads, started on the loop by ``_start_pending``.
        self._pending: deque[AsyncCall] = deque()
        self._start_scheduled = False
        #: Calls submitted and not ended (written on the loop's thread only).
        self.in_flight = 0
        self._lags: list[tuple[float, float]] = []  # (monotonic when answered, lateness s)
        self._ping_sent = 0.0
        self._ping_answered = True
        #: When the loop was last seen between steps (it ran a pong, or a sample found no task
        #: running): a step running later began after it.
        self._free_at = time.monotonic()
        self._warned_task: asyncio.Task[Any] | None = None
        self._suspect: asyncio.Task[Any] | None = None
        self._suspect_since = 0.0
        self._suspect_seen = 0
        #: Called with each measured lateness (s) from the watchdog's thread (``LAG_OBSERVERS`` too).
        self.lag_observers: list[Callable[[float], None]] = []
        self.blocked_episodes = 0
        native.start_thread(self._run)
        native.start_thread(self._watch)
        self._wait_started()

    @classmethod
    def get(cls, max_in_flight: int | None = None) -> ProcessLoop:
        """This process's loop, started on first use (a forked child starts its own).
        ``max_in_flight``: the cap of the caller's settings (``async_max_in_flight``), applied
        when it differs from the loop's (hooks and contexts pass none: they run inside calls)."""
        inst = cls._instance
        if inst is None or inst.pid != os.getpid():
            with cls._lock:
                inst = cls._instance
                if inst is None or inst.pid != os.getpid():
                    inst = cls._instance = ProcessLoop(max_in_flight)
        if max_in_flight is not None and max_in_flight != inst.max_in_flight:
            inst.set_cap(max_in_flight)
        return inst

    def set_cap(self, max_in_flight: int) -> None:
        """Change the process cap (applied on the loop: places freed or taken at once)."""
        if max_in_flight < 1:
            raise ConfigError(f"async_max_in_flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight

        def apply() -> None:
            # Against the cap last applied, on the loop's thread: two threads changing the cap at
            # once (each reading the old one) cannot count the same change twice.
            cap = self.max_in_flight
            self._free += cap - self._applied_cap
            self._applied_cap = cap
            while self._free > 0 and self._slot_waiters:
                w = self._slot_waiters.popleft()
                if not w.done():
                    self._free -= 1
                    w.set_result(None)

        self.loop.call_soon_threadsafe(apply)

    def _wait_started(self) -> None:
        deadline = time.monotonic() + 10
        while not self.loop.is_running():
            if time.monotonic() > deadline:  # pragma: no cover - a thread that cannot start
                raise RuntimeError("the async listeners' event loop thread did not start within 10 s")
            native.sleep(0.001)

    def _run(self) -> None:
        mark_own_thread()
        self.thread_id = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        while True:
            self.loop.run_forever()
            if self.loop.is_closed():  # pragma: no cover - closed for good
                return
            if not self._handing:  # pragma: no cover - a listener stopped the loop: run on
                continue
            # Stopped for a hand-over (``claim``): the claiming run drives the loop until it gives
            # it back (``release``); this thread waits, using no CPU.
            self._parked.set()
            self._resume.wait()
            self._resume.clear()

    # -- inline runs: the run's own thread drives the loop -----------------------------------------

    def claim(self) -> bool:
        """Let the calling run's thread drive the loop itself while it waits for its calls
        (``drive``), instead of this process's loop thread: no thread crossing per call (a
        self-pipe write to submit, a wake-up of the run's thread per result), which on a busy
        2-core machine cost more than the calls. Granted only when no other run of the process
        uses the loop (a prefork child, solo: one run at a time) and never under gevent, whose
        runs are greenlets of one thread. True when granted; the caller must ``release``."""
        if self._gevent or self._owner is not None or self._runs > 1:
            return False
        if time.monotonic() - self._foreign_at < FOREIGN_QUIET_S:
            return False
        # Nothing of anyone else's on the loop: the claimant has no calls of its own yet, so a
        # call in flight or pending is another run's (a queue-mode run never enters as a run),
        # which would then move only while this run's thread drives the loop.
        if self.in_flight or self._pending or self._background:
            return False
        with self._claim_lock:
            if self._owner is not None or self._runs > 1:  # (a run entered since the check above)
                return False
            self._handing = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._parked.wait()
            self._parked.clear()
            self._release_asked = False
            self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        """Give the loop back to its own thread (the caller claimed it and is not driving it)."""
        if self._owner != threading.get_ident():
            return
        self._owner = None
        self._handing = False
        self._resume.set()

    @property
    def release_asked(self) -> bool:
        """Another thread gave the loop work while a run drives it: the run should give it back."""
        return self._release_asked

    def drive(self, timeout: float | None) -> None:
        """Run the loop in the claiming thread until something calls ``loop.stop()`` (a result of
        the run's calls: ``LaneCalls``) or ``timeout`` seconds pass."""
        loop = self.loop
        timer = loop.call_later(timeout, loop.stop) if timeout is not None else None
        try:
            loop.run_forever()
        finally:
            if timer is not None:
                timer.cancel()

    def enter_run(self) -> None:
        """A run starts submitting calls to the loop (``leave_run`` when it ends): while more
        than one does, none may ``claim`` the loop, and a run that holds it is asked to give it
        back."""
        with self._claim_lock:
            self._runs += 1
            if self._owner is not None and self._runs > 1:
                self._release_asked = True

    def leave_run(self) -> None:
        with self._claim_lock:
            self._runs -= 1

    def _note_foreign(self) -> None:
        """Work for the loop from a thread that does not drive it while another run does."""
        if self._owner is not None and self._owner != threading.get_ident():
            self._foreign_at = time.monotonic()
            self._release_asked = True

    # -- calls -----------------------------------------------------------------------------------

    def submit(self, name: str, make: Callable[[], Coroutine[Any, Any, None]],
               on_skipped: Callable[[], None], context: contextvars.Context | None = None) -> AsyncCall:
        """Run ``make()`` (a listener call that reports its own result) on the loop, within the
        process cap. ``name``: the listener's, for the blocked-loop warning. ``context``: the
        context its task runs in (one context per call: ``LaneCalls`` gives a fresh copy)."""
        call = AsyncCall(self.loop, name, make, on_skipped, context)
        if self._owner is not None:
            self._note_foreign()
        self._pending.append(call)
        if not self._start_scheduled:
            # One wake-up of the loop (a write to its self-pipe) per burst of submissions, not
            # one per call: a run hands out up to key_concurrency calls in one go.
            self._start_scheduled = True
            self.loop.call_soon_threadsafe(self._start_pending)
        return call

    def submit_inline(self, name: str, make: Callable[[], Coroutine[Any, Any, None]],
                      on_skipped: Callable[[], None], context: contextvars.Context | None = None) -> AsyncCall:
        """``submit`` from the thread that claimed the loop: the call's task is made at once
        (it starts at the next ``drive``), no wake-up of another thread."""
        call = AsyncCall(self.loop, name, make, on_skipped, context)
        self._start(call)
        return call

    def _start_pending(self) -> None:
        # Cleared before draining: a call appended after the last pop finds it clear and
        # schedules another drain (at worst one drain too many, never a call left behind).
        self._start_scheduled = False
        pending = self._pending
        while pending:
            self._start(pending.popleft())

    def _start(self, call: AsyncCall) -> None:
        task = self.loop.create_task(self._run_call(call), context=call.context)
        call.task = task
        self.in_flight += 1

    async def _run_call(self, call: AsyncCall) -> None:
        # The bookkeeping of the end is done here, not in a done callback (one more loop
        # callback per call): every task made by ``_start`` runs this body, since a call is
        # cancelled only once started (``AsyncCall._cancel``).
        try:
            call.started = True
            if call.cancel_asked:
                call.on_skipped()
                return
            if self._free > 0:
                self._free -= 1
            else:
                waiter: asyncio.Future[None] = self.loop.create_future()
                self._slot_waiters.append(waiter)
                try:
                    await waiter  # a slot handed over by ``_free_slot``
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._free_slot()  # handed a slot as it was cancelled: pass it on
                    call.on_skipped()  # cancelled while waiting for a slot: the listener never ran
                    raise
            try:
                await call.make()
            finally:
                self._free_slot()
        finally:
            self.in_flight -= 1

    def _free_slot(self) -> None:
        """A call ended: its place goes to the first call still waiting, or back to the pool."""
        waiters = self._slot_waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self._free += 1

    def run_blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result in the calling thread (or greenlet):
        an ``async def`` hook around a plain listener. Never call it on the loop's own thread."""
        if self._owner is not None and self._owner == threading.get_ident():
            # The caller drives the loop itself (``claim``): waiting for the loop's thread would
            # wait forever; run the loop here until the coroutine is done.
            return self.loop.run_until_complete(coro)
        if self._owner is not None:
            self._note_foreign()
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        hand = native.to_caller()

        async def run() -> None:
            try:
                hand(box.put, (True, await coro))
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller, raised there
                hand(box.put, (False, exc))

        self.loop.call_soon_threadsafe(self._keep, run())
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def _keep(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task held in ``_background`` until it ends: the loop keeps only a weak
        reference to a task, and one that waits on a stream's reply may be referred to by nothing
        else, so a garbage collection could destroy it mid-wait (the bench's async counter lost
        its flush task that way)."""
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def offload(fn: Callable[[], Any]) -> Any:
        """Run a blocking ``fn`` (a Redis round trip) off the loop and await its result:
        ``ctx.still_owner_async``; see the module's :func:`offload`."""
        return await offload(fn)

    @staticmethod
    def _call_name(task: asyncio.Task[Any]) -> str:
        """The listener name of a call's task (read at a warning only, so not kept per call):
        the ``call`` local of its ``_run_call`` frame."""
        frame = getattr(task.get_coro(), "cr_frame", None)
        call = frame.f_locals.get("call") if frame is not None else None
        return call.name if isinstance(call, AsyncCall) else task.get_name()

    # -- the watchdog ----------------------------------------------------------------------------

    def _pong(self, sent: float) -> None:
        now = time.monotonic()
        self._free_at = now
        self._ping_answered = True
        self._note_lag(now, max(0.0, now - sent))

    def _note_lag(self, now: float, lag: float) -> None:
        lags = self._lags
        lags.append((now, lag))
        while lags and lags[0][0] < now - LAG_WINDOW_S:
            lags.pop(0)
        for obs in self.lag_observers:
            try:
                obs(lag)
            except Exception:
                log.exception("event loop lag observer failed")
        if LAG_OBSERVERS:
            worst = max(lg for _, lg in lags)
            for obs in LAG_OBSERVERS:
                try:
                    obs(worst)
                except Exception:
                    log.exception("event loop lag observer failed")

    def lag(self) -> float:
        """The worst lateness (s) of the loop over the last ``LAG_WINDOW_S``, an unanswered ping
        included."""
        now = time.monotonic()
        worst = max((lag for at, lag in list(self._lags) if at >= now - LAG_WINDOW_S), default=0.0)
        if not self._ping_answered:
            worst = max(worst, now - self._ping_sent)
        return worst

    def _watch(self) -> None:
        wait = PING_S
        while True:
            native.sleep(wait)
            now = time.monotonic()
            wait = SAMPLE_S  # while the ping is late; a new ping waits PING_S
            if self._ping_answered:
                wait = PING_S
                self._ping_sent, self._ping_answered = now, False
                self._suspect, self._warned_task = None, None
                try:
                    self.loop.call_soon_threadsafe(self._pong, now)
                except RuntimeError:  # pragma: no cover - the loop was closed
                    return
                continue
            self._sample(now)

    def _sample(self, now: float) -> None:
        """The ping is late. A loop busy with many short steps (thousands of calls) is late too,
        and that is only lag; a loop whose *same* task is running at every sample (every
        ``SAMPLE_S`` from the first late one) is held by that one step, which began after the
        loop was last seen free (nothing runs beside a step): held for ``BLOCKED_S`` since then, it
        is named (read from this thread: a dict lookup, safe under the GIL), once per episode.
        (Counted from the first late sample, a step had to hold the loop some 0.4 s, not 0.25,
        to be named: the ping is sent up to ``PING_S`` after the step began, and sampled
        ``PING_S`` later.)"""
        task = asyncio.current_task(self.loop) if self.loop.is_running() else None
        if task is None:
            self._suspect, self._free_at = None, now
            return
        if task is not self._suspect:
            # The first task seen running since the loop was last seen free: its step began
            # after that. Another task than the last sample's: it began after that sample.
            first = self._suspect is None
            self._suspect, self._suspect_since, self._suspect_seen = task, self._free_at if first else now, 0
        self._suspect_seen += 1
        held = now - self._suspect_since
        # (Three samples at least, 50 ms of it seen: two short steps of one task caught by two
        # samples of a merely busy loop are not a block.)
        if held < BLOCKED_S or self._suspect_seen < 3 or task is self._warned_task:
            return
        self._warned_task = task
        self.blocked_episodes += 1
        name = self._call_name(task)
        log.warning(
            "async listener %s is blocking the event loop of process %d (one step of its call has held the loop for "
            "%.2f s; no other async call of this process ran meanwhile): it calls something blocking (time.sleep, "
            "CPU work, a sync client) inside async def; await an async equivalent or use loop.run_in_executor",
            name, self.pid, held,
        )
        for obs in self.lag_observers:
            try:
                obs(now - self._ping_sent)
            except Exception:
                log.exception("event loop lag observer failed")


def process_loop() -> ProcessLoop:
    return ProcessLoop.get()


async def offload(fn: Callable[[], Any]) -> Any:
    """Run a blocking ``fn`` off the loop that awaits it, in that loop's default executor.

    The *running* loop, not the process's: inside a worker the two are the same (its calls run on
    the process loop, whose executor under gevent is the hub's ``HubExecutor``), but a unit test
    that runs a listener under its own loop (``asyncio.run(handler(msgs, ctx))``) awaits here from
    that loop. Scheduling on the process loop then failed with "attached to a different loop", and
    started the process loop's threads in the test besides."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)

"""A worker's "is anyone waiting for a pool slot?" signal, readable from prefork children.

A drained ConsumeRequest may linger on its queue (``consume_linger_ms``) only while no other
request waits for a slot of its worker. The threads pool can read Celery's own bookkeeping
(``state.reserved_requests`` and ``state.active_requests``) directly; a prefork child cannot: that
bookkeeping lives in the worker's main process. So the main process publishes it here:

* ``CapacitySignal`` is a 16-byte anonymous *shared* mapping, created when this module is
  imported, which happens in the worker's main process before the pool forks (``install()`` ->
  bootsteps -> runtime -> here), so every child, including ones forked later to replace others,
  maps the same page;
* ``CapacityPublisher``, a thread of the main process started by the worker bootstep, writes
  ``(now, waiting)`` every ``PUBLISH_INTERVAL_S``, and while requests wait (for a slot, and for
  ``YIELD_AFTER_S`` already: ``WaitingRequests``) it nudges the lingering reads
  (``mqorder.consumer.nudge``) so they end then rather than at their slice end;
* a child lingers only while the stamp is fresh and ``waiting`` is 0. A missing, stopped or stuck
  publisher leaves a stale stamp, which reads as "do not linger": failure falls back to the
  no-linger behaviour, never to a slot kept from a waiting request;
* a child *starts* lingering only while ``spare`` says another slot would stay free for the next
  request (or the pool has one slot only), or while no other child of the worker lingers (the
  children note theirs on the page: ``note_lingerer``). Without that rule every slot of a small
  pool could end up lingering (stock prefork -c 2: one request woken for a queue the other's
  watch had not adopted yet runs, drains and lingers too); then any one new request waits, every
  lingering child is nudged and gives its slot and its adopted queues back at once, and the
  queues that got messages meanwhile each need a new request: a cascade of wake-ups and tasks
  that lasts until it settles, seen as bursts of ~20 wake-ups in the latency bench. One lingering
  request's ``IdleQueueWatch`` covers every idle queue of the worker anyway. And without the
  second half, a worker whose slots are all busy with woken requests (after an idle spell, every
  queue's first message wakes it) never gets a lingering request back until, by chance, one ends
  while the other slot is idle: 1-2 s of wake-ups at 1,000 msg/s.
"""

from __future__ import annotations

import logging
import mmap
import struct
import threading
import time
import weakref
from collections.abc import Callable, Container, Iterable

log = logging.getLogger(__name__)

#: How often the main process publishes its waiting count while requests come and go.
PUBLISH_INTERVAL_S = 0.005
#: How often once nothing has changed for ``ACTIVE_WINDOW_S``: well within ``STALE_AFTER_S``, so
#: readers still see a live publisher. Polling at 200 Hz on an idle worker cost its main process
#: about a third of its idle CPU; a received task (``poke``) ends the slower wait at once.
IDLE_PUBLISH_INTERVAL_S = 0.04
#: How long after the last change the publisher keeps the fast interval.
ACTIVE_WINDOW_S = 1.0
#: How often while the worker holds no request at all: no child runs, so nobody reads the stamp
#: (only a child running a request does), and the next request's receipt pokes the publisher,
#: which publishes before that child can look. 25 Hz of publishing for no reader was most of an
#: idle worker's main-process CPU after the sweep (issue 27). Any wait works here; this one only
#: keeps the thread from sleeping unboundedly.
HELD_NONE_INTERVAL_S = 1.0
#: A stamp older than this reads as "no publisher": do not linger.
STALE_AFTER_S = 0.1

#: monotonic stamp (CLOCK_MONOTONIC, shared by all processes), waiting, spare (0/1)
_LAYOUT = struct.Struct("=dqq")
#: The lingering child's record (written by children, after the main process's): pid, stamp.
_LINGERER = struct.Struct("=qd")
_LINGERER_AT = 64
#: A lingering child notes itself at every lingering read (slices are at most 100 ms long); a note
#: older than this is of a child that stopped lingering without saying so (killed).
LINGERER_STALE_S = 0.5


class CapacitySignal:
    """The shared page: one writer (the main process), any number of readers (pool children)."""

    def __init__(self) -> None:
        # fileno -1: anonymous memory, MAP_SHARED by default on Linux, so it survives fork shared.
        self._mem = mmap.mmap(-1, mmap.PAGESIZE)
        self.clear()

    def publish(self, waiting: int, spare: bool = True) -> None:
        self._write(_LAYOUT.pack(time.monotonic(), waiting, 1 if spare else 0))

    def clear(self) -> None:
        """Mark the signal as not published (readers then never linger)."""
        self._write(bytes(_LAYOUT.size))

    def _write(self, record: bytes, at: int = 0) -> None:
        # One copy of the whole record. Not struct.pack_into on the page: it zero-fills the
        # record before it packs the fields, so a child reading at that moment saw a page never
        # published ("do not linger"), and its lingering request gave up its slot and its
        # adopted queues (bursts of wake-ups at stock prefork -c 2, a few a minute).
        self._mem[at: at + len(record)] = record

    def _read(self, at: int, size: int) -> bytes:
        """A record as one write left it: read until two reads in a row agree (a read racing a
        writer's copy can mix two records)."""
        last = self._mem[at: at + size]
        for _ in range(3):
            again = self._mem[at: at + size]
            if again == last:
                break
            last = again
        return last

    def read(self) -> tuple[float, int, int]:
        return _LAYOUT.unpack(self._read(0, _LAYOUT.size))

    def note_lingerer(self, pid: int, lingering: bool) -> None:
        """A child says it lingers (again: at every lingering read), or that it stopped."""
        if lingering:
            self._write(_LINGERER.pack(pid, time.monotonic()), _LINGERER_AT)
        elif self.lingerer() == pid:
            self._write(bytes(_LINGERER.size), _LINGERER_AT)

    def lingerer(self) -> int:
        """The pid of the child that lingers in this worker (0: none, or its note is stale)."""
        pid, stamp = _LINGERER.unpack(self._read(_LINGERER_AT, _LINGERER.size))
        return pid if pid and 0.0 <= time.monotonic() - stamp < LINGERER_STALE_S else 0

    def may_linger(self) -> bool:
        """A lingering request may go on: nobody waits for a slot (and the publisher is alive)."""
        stamp, waiting, _spare = self.read()
        return waiting == 0 and 0.0 <= time.monotonic() - stamp < STALE_AFTER_S

    def others_wait(self) -> bool:
        """A request waits for a slot (a run with a backlog yields after ``consume_yield_after_ms``).
        A stale or never published stamp says nobody waits: unlike lingering, a busy run must not
        give its slot up on a signal nobody keeps."""
        stamp, waiting, _spare = self.read()
        return waiting > 0 and 0.0 <= time.monotonic() - stamp < STALE_AFTER_S

    def may_start_linger(self, pid: int = 0) -> bool:
        """A drained request (in process ``pid``) may begin to linger: as ``may_linger``, and a
        slot would stay free, or no other child lingers."""
        stamp, waiting, spare = self.read()
        if waiting != 0 or not 0.0 <= time.monotonic() - stamp < STALE_AFTER_S:
            return False
        return spare == 1 or self.lingerer() in (0, pid)


#: The signal of this worker: created at import, in the main process, before the pool forks.
SIGNAL = CapacitySignal()


#: How long a request received while every pool slot is busy must have waited before a lingering
#: request gives its slot up for it. Without any patience a worker could lock itself into a task per
#: message: at 1,000 msg/s after an idle spell (stock prefork -c 2, 16 queues), every run that
#: drained saw one short request waiting (the next wake-up's, about to get the other slot), so
#: none lingered, so every message on a queue no watch had adopted woke another request: ~150
#: tasks a second, 2.7-2.9 round trips and 1,100-1,500 µs of worker CPU per message, p99 145 ms,
#: for seconds at a time (``bench.trickle_cost`` windows after an idle spell, 2026-11-27).
YIELD_AFTER_S = 0.025


class WaitingRequests:
    """Requests this worker received that no pool slot can take unless a running one ends, counting
    only those that have waited ``after``.

    ``reserved_requests`` holds every request received and not finished (running ones included),
    so ``reserved - slots`` is what exceeds the pool, and no more are counted. Counting only those,
    rather than every request not yet started, matters in prefork: a request on its way to a free
    child is briefly "not started", and making every lingering child give up its queue for it
    would send each of those queues back through a wake-up and a new task.

    With patience (``YIELD_AFTER_S``): a short run on another slot usually ends well within it,
    and its slot takes the request; the lingering request keeps its slot and its watch, which
    adopts the worker's idle queues, and the wake-ups stop.

    Each request not started yet is remembered from the first call that saw it waiting. ``young``
    says that some wait and have not waited ``after`` yet: the publisher then keeps its fast
    interval, so the count turns as soon as they have. The slot is given back ``after`` later than
    without patience: a lingering read is nudged then."""

    def __init__(self, slots: int, after: float = YIELD_AFTER_S) -> None:
        self.slots = slots
        self.after = after
        self._first_seen: dict[object, float] = {}
        self.young = False

    def __call__(self) -> int:
        from celery.worker import state

        if state.should_stop is not None or state.should_terminate is not None:
            self._first_seen, self.young = {}, False
            return 1 << 30  # shutting down: nobody should linger
        return self.count(state.reserved_requests, state.active_requests)

    def count(self, reserved: Iterable[object], active: Container[object]) -> int:
        """Of ``reserved`` (received, not finished), those not ``active`` (not started) that have
        waited ``after``, at most as many as exceed the pool's slots."""
        held = _snapshot(reserved)
        over = len(held) - self.slots
        if over <= 0:
            self._first_seen, self.young = {}, False
            return 0
        now = time.monotonic()
        before = self._first_seen
        seen: dict[object, float] = {}
        for r in held:
            if r not in active:
                # The task id, not the object's address: a finished request's address is reused.
                key = getattr(r, "id", None) or id(r)
                seen[key] = before.get(key, now)
        self._first_seen = seen
        aged = sum(1 for t in seen.values() if now - t >= self.after)
        self.young = aged < len(seen)
        return min(over, aged)


def _snapshot(items: Iterable[object]) -> list[object]:
    """A copy of ``items`` taken while other threads change it. Celery's request sets are
    ``WeakSet``s, whose iteration is Python code another thread can run in the middle of ("Set
    changed size during iteration": the main thread reserves and finishes requests, and in the
    threads pool the pool's threads accept them): their references are copied in one C-level step
    instead, and those still alive are kept."""
    if isinstance(items, weakref.WeakSet):
        return [r for r in (ref() for ref in list(items.data)) if r is not None]  # type: ignore[attr-defined]
    return list(items)


def celery_held() -> int:
    """Requests this worker received and has not finished (running ones included): while there
    are none, no prefork child runs a request, so none reads the signal."""
    from celery.worker import state

    return len(state.reserved_requests)


def celery_spare(slots: int) -> bool:
    """Whether a request that begins to linger now leaves a slot free for the next one: fewer
    requests received (running ones included) than slots, or a one-slot pool (where lingering is
    worth its nudge: no other slot could take the queue's next request sooner)."""
    from celery.worker import state

    return slots == 1 or len(state.reserved_requests) < slots


class CapacityPublisher:
    """The main-process thread that keeps ``SIGNAL`` current while the worker runs."""

    def __init__(self, waiting: Callable[[], int], signal: CapacitySignal | None = SIGNAL,
                 interval: float = PUBLISH_INTERVAL_S, nudge: Callable[[], None] | None = None,
                 spare: Callable[[], bool] | None = None, held: Callable[[], int] | None = None) -> None:
        #: None: only nudge (the threads pool reads Celery's bookkeeping itself, no shared page).
        self.signal = signal
        self.waiting = waiting
        #: Whether a request may begin to linger (``celery_spare``); None: always.
        self.spare = spare
        #: Called while requests wait for a slot: ends the lingering reads of this client
        #: (``mqorder.consumer.nudge.LingerNudge``), which otherwise notice only at their slice end.
        self.nudge = nudge
        #: Requests the worker holds (received and not finished, running ones included:
        #: ``celery_held``); at 0 the publisher waits ``HELD_NONE_INTERVAL_S`` or a ``poke``.
        #: None: always the idle interval.
        self.held = held
        self.interval = interval
        self.idle_interval = max(interval, IDLE_PUBLISH_INTERVAL_S)
        self._stop = threading.Event()
        #: Set by ``poke`` (a request was received) or ``stop``: publish now.
        self._wake = threading.Event()
        #: monotonic time until which the stamp is kept fresh though no request is held (``poke``).
        self._hold_until = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mqorder-capacity", daemon=True)
        self._thread.start()

    def poke(self, hold_s: float = 0.0) -> None:
        """Publish now: the worker received a request (Celery's ``task_received``), which may be
        one a lingering child must give its slot back for.

        ``hold_s``: keep the stamp fresh (the idle interval, not the long wait of a worker holding
        no request) for that long. A request with a countdown (a suspended or re-queued
        ConsumeRequest) is received now but held by Celery's timer, not as a reserved request, and
        its ETA sends no signal: without the hold, the child that runs it would read a stale stamp
        ("no publisher") and neither linger nor wait in place."""
        if hold_s > 0:
            self._hold_until = max(self._hold_until, time.monotonic() + hold_s)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self.signal is not None:
            self.signal.clear()

    def _loop(self) -> None:
        last: tuple[int, bool] | None = None
        changed_at = time.monotonic()
        while not self._stop.is_set():
            self._wake.clear()
            try:
                waiting = self.waiting()
                spare = self.spare() if self.spare is not None else True
                if self.signal is not None:
                    self.signal.publish(waiting, spare)
                if waiting and self.nudge is not None:
                    self.nudge()
            except Exception:
                log.exception("mqorder: capacity publisher failed; prefork children will not linger")
                if self.signal is not None:
                    self.signal.clear()
                return
            now = time.monotonic()
            if (waiting, spare) != last:
                last, changed_at = (waiting, spare), now
            # Requests that wait but not for long enough yet (``WaitingRequests.young``): look
            # again at the fast interval, so the count turns as soon as they have.
            young = bool(getattr(self.waiting, "young", False))
            if waiting or young or now - changed_at < ACTIVE_WINDOW_S:
                wait = self.interval
            elif self.held is not None and self.held() == 0 and now >= self._hold_until:
                wait = max(self.idle_interval, HELD_NONE_INTERVAL_S)  # no reader until a poke
            else:
                wait = self.idle_interval
            self._wake.wait(wait)
        if self.signal is not None:
            self.signal.clear()

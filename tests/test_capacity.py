"""The capacity signal that lets prefork children linger: shared across fork, safe when stale."""

from __future__ import annotations

import multiprocessing
import time

from mqorder.celery import capacity
from mqorder.celery.capacity import STALE_AFTER_S, CapacityPublisher, CapacitySignal


def _child_reads(sig: CapacitySignal, conn) -> None:
    # Wait until the parent publishes after the fork: proves the page is shared, not copied.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sig.read()[1] != 7:
        time.sleep(0.005)
    conn.send((sig.read()[1], sig.may_linger()))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not sig.may_linger():
        time.sleep(0.005)
    conn.send(sig.may_linger())


def test_a_forked_child_sees_what_the_parent_publishes_after_the_fork() -> None:
    sig = CapacitySignal()
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_child_reads, args=(sig, child_end))
    proc.start()
    try:
        time.sleep(0.05)
        sig.publish(7)  # 7 requests wait for a slot
        waiting, may = parent_end.recv()
        assert (waiting, may) == (7, False)
        pub = CapacityPublisher(lambda: 0, sig, interval=0.005)
        pub.start()
        try:
            assert parent_end.recv() is True  # the child now may linger
        finally:
            pub.stop()
    finally:
        proc.join(5)
    assert proc.exitcode == 0


def test_stale_or_cleared_or_busy_signal_means_do_not_linger() -> None:
    sig = CapacitySignal()
    assert not sig.may_linger()  # never published
    sig.publish(0)
    assert sig.may_linger()
    sig.publish(2)
    assert not sig.may_linger()  # requests wait for a slot
    sig.publish(0)
    time.sleep(STALE_AFTER_S + 0.05)
    assert not sig.may_linger()  # the publisher stopped or is stuck
    sig.publish(0)
    sig.clear()
    assert not sig.may_linger()


def test_publisher_stops_and_clears_and_a_failing_probe_clears_too() -> None:
    sig = CapacitySignal()
    pub = CapacityPublisher(lambda: 0, sig, interval=0.005)
    pub.start()
    time.sleep(0.03)
    assert sig.may_linger()
    pub.stop()
    assert not sig.may_linger()

    def broken() -> int:
        raise RuntimeError("probe failed")

    bad = CapacityPublisher(broken, sig, interval=0.005)
    bad.start()
    time.sleep(0.03)
    assert not sig.may_linger()
    bad.stop()


def _counted_signal() -> tuple[CapacitySignal, list[float]]:
    """The real signal, and the times of its publishes (counted, so a loaded machine's scheduling
    hiccup cannot decide a test the way sampling the stamp's age can)."""
    sig = CapacitySignal()
    times: list[float] = []
    publish = sig.publish

    def counted(waiting: int, spare: bool = True) -> None:
        times.append(time.monotonic())
        publish(waiting, spare)

    sig.publish = counted  # type: ignore[method-assign]
    return sig, times


def test_a_publisher_of_a_worker_holding_no_request_waits_for_a_poke_and_publishes_at_once() -> None:
    """Holding no request, no child reads the stamp: the publisher stops refreshing it (issue 27's
    idle cost) until a received request pokes it, which publishes before the child can look."""
    sig, publishes = _counted_signal()
    held = [0]
    pub = CapacityPublisher(lambda: 0, sig, interval=0.005, held=lambda: held[0])
    pub.start()
    try:
        time.sleep(capacity.ACTIVE_WINDOW_S + STALE_AFTER_S + 0.2)  # past the fast window, then stale
        assert not sig.may_linger()  # nothing published for a reader that does not exist
        # Right after one of the long wait's own publishes, the next is HELD_NONE_INTERVAL_S away:
        # a poke must publish well before it. (A fixed 50 ms for the thread to wake was too short
        # on a loaded CI machine; measured from that publish, the check stays exact.)
        first = sig.read()[0]
        deadline = time.monotonic() + 3 * capacity.HELD_NONE_INTERVAL_S
        while sig.read()[0] == first and time.monotonic() < deadline:
            time.sleep(0.001)
        published = sig.read()[0]
        assert published != first, "the long wait publishes now and then"
        time.sleep(STALE_AFTER_S + 0.05)
        assert not sig.may_linger()
        held[0] = 1  # a request was received: Celery's task_received pokes the publisher
        pub.poke()
        deadline = published + capacity.HELD_NONE_INTERVAL_S / 2
        while not sig.may_linger() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sig.may_linger()  # published at once, not at the end of the long wait
        # Holding a request, it keeps publishing: past its fast window, at the idle interval (40 ms).
        # Counted in publishes over half a second, not by sampling the stamp's age, so a loaded
        # machine's scheduling hiccup does not decide it (sampled, it failed once in CI): ~12
        # publishes where the long wait of a worker holding nothing (1 s) makes at most one.
        time.sleep(capacity.ACTIVE_WINDOW_S)
        start = time.monotonic()
        time.sleep(0.5)
        later = [t for t in publishes if t >= start]
        assert len(later) >= 5, f"{len(later)} publishes in 0.5 s while holding a request"
    finally:
        pub.stop()


def test_a_request_received_with_a_countdown_keeps_the_stamp_fresh_until_after_its_eta() -> None:
    """A ConsumeRequest re-queued with a countdown is received now (the poke) but held by Celery's
    timer, not as a reserved request, and its ETA sends no signal: the publisher keeps publishing at
    its idle interval through the countdown, so the child that runs it reads a live publisher
    (review of d36844a: it read "no publisher" for 0.7 s). Counted in publishes, not by sampling the
    stamp's age, so a loaded machine's scheduling hiccup does not decide it."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from mqorder.celery import runtime

    sig, published = _counted_signal()
    pub = CapacityPublisher(lambda: 0, sig, interval=0.005, held=lambda: 0)  # held by the timer only
    pub.start()
    runtime._publisher, before = pub, runtime._publisher
    try:
        time.sleep(capacity.ACTIVE_WINDOW_S + STALE_AFTER_S + 0.2)
        assert not sig.may_linger()  # holding nothing: the stamp went stale
        eta = datetime.now(UTC) + timedelta(seconds=0.5)
        poked = time.monotonic()
        runtime._poke_publisher(request=SimpleNamespace(eta=eta))  # Celery's task_received
        time.sleep(0.5 + capacity.ACTIVE_WINDOW_S)
        held = [t for t in published if t >= poked]
        # At the idle interval (40 ms) through 1.5 s: ~37 publishes; the long wait of a worker
        # holding nothing (1 s) would make 2. Far apart, whatever the machine's load.
        assert len(held) >= 10, f"{len(held)} publishes during the countdown and after it"
        time.sleep(capacity.ACTIVE_WINDOW_S + STALE_AFTER_S + 0.3)
        assert not sig.may_linger()  # then back to the long wait of a worker holding nothing
    finally:
        runtime._publisher = before
        pub.stop()


def test_a_request_may_begin_to_linger_only_while_a_slot_would_stay_free() -> None:
    """``spare`` gates beginning to linger (while another child lingers); going on lingering needs
    only that nobody waits."""
    sig = CapacitySignal()
    assert not sig.may_start_linger()  # never published
    sig.publish(0, spare=True)
    assert sig.may_linger() and sig.may_start_linger()
    sig.note_lingerer(101, True)  # another child lingers
    sig.publish(0, spare=False)  # every slot busy, nobody waiting: lingerers go on, none begins
    assert sig.may_linger() and not sig.may_start_linger(pid=202)
    sig.publish(1, spare=True)
    assert not sig.may_linger() and not sig.may_start_linger(pid=202)
    pub = CapacityPublisher(lambda: 0, sig, interval=0.005, spare=lambda: False)
    pub.start()
    time.sleep(0.03)
    sig.note_lingerer(101, True)
    assert sig.may_linger() and not sig.may_start_linger(pid=202)
    pub.stop()
    assert not sig.may_start_linger(pid=202)


def _read_hard(sig: CapacitySignal, seconds: float, conn) -> None:
    deadline = time.monotonic() + seconds
    torn = reads = 0
    while time.monotonic() < deadline:
        stamp, waiting, spare = sig.read()
        reads += 1
        if stamp == 0.0 or waiting != 0 or spare != 1:
            torn += 1
    conn.send((reads, torn))


def test_a_reader_in_another_process_never_sees_a_half_written_signal() -> None:
    """The main process rewrites the page every 5 ms while children read it. A write that passes
    through an all-zero page (``struct.pack_into`` zero-fills before it packs) let a child read
    "never published" now and then, and the lingering request it served give up its slot and its
    adopted queues: seen as bursts of wake-ups at stock prefork -c 2."""
    sig = CapacitySignal()
    sig.publish(0, spare=True)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_read_hard, args=(sig, 1.5, child_end))
    proc.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            sig.publish(0, spare=True)
        reads, torn = parent_end.recv()
    finally:
        proc.join(5)
    assert reads > 1000
    assert torn == 0, f"{torn} of {reads} reads saw a half-written signal"


def test_a_child_may_begin_to_linger_while_no_other_child_lingers_even_without_a_spare_slot() -> None:
    sig = CapacitySignal()
    sig.publish(0, spare=False)  # every slot busy, nobody waiting
    assert sig.lingerer() == 0 and sig.may_start_linger(pid=101)  # nobody lingers: 101 may begin
    sig.note_lingerer(101, True)
    assert sig.lingerer() == 101 and sig.may_start_linger(pid=101)
    assert not sig.may_start_linger(pid=202)  # 101 lingers, no slot stays free: 202 may not
    sig.publish(0, spare=True)
    assert sig.may_start_linger(pid=202)  # a slot stays free: a second one may
    sig.publish(0, spare=False)
    sig.note_lingerer(202, False)  # not the noted one: changes nothing
    assert sig.lingerer() == 101
    sig.note_lingerer(101, False)
    assert sig.lingerer() == 0 and sig.may_start_linger(pid=202)
    sig.note_lingerer(101, True)
    sig.publish(1, spare=False)
    assert not sig.may_start_linger(pid=101)  # a request waits: nobody begins


def test_a_lingerer_note_lapses(monkeypatch) -> None:
    from mqorder.celery import capacity

    monkeypatch.setattr(capacity, "LINGERER_STALE_S", 0.05)
    sig = CapacitySignal()
    sig.publish(0, spare=False)
    sig.note_lingerer(101, True)
    assert not sig.may_start_linger(pid=202)
    time.sleep(0.1)  # 101 was killed without a word
    sig.publish(0, spare=False)
    assert sig.lingerer() == 0 and sig.may_start_linger(pid=202)


class _Req:
    """A received request (only its identity matters to ``WaitingRequests``)."""


def test_a_request_counts_as_waiting_only_once_it_has_waited_for_a_slot_a_while() -> None:
    """Stock prefork -c 2 after an idle spell once locked itself into a task per message: every
    drained run saw the next short request waiting (about to get the other slot), so none lingered.
    A request counts only once it has waited ``after``; never more than exceed the pool's slots."""
    w = capacity.WaitingRequests(2, after=0.05)
    a, b, c, d = _Req(), _Req(), _Req(), _Req()
    assert w.count({a, b}, {a, b}) == 0 and not w.young  # the pool is full, nobody waits
    assert w.count({a, b, c}, {a, b}) == 0 and w.young  # c waits, not for long yet
    time.sleep(0.06)
    assert w.count({a, b, c}, {a, b}) == 1 and not w.young
    assert w.count({a, b, c, d}, {a, b}) == 1 and w.young  # d just came: c still counts, d not yet
    time.sleep(0.06)
    assert w.count({a, b, c, d}, {a, b}) == 2
    # One of them on its way to a child that just freed up: at most what exceeds the slots counts.
    assert w.count({a, c, d}, {a}) == 1
    # The pool has room again: every wait forgotten, so a request waiting later starts afresh.
    assert w.count({a}, {a}) == 0 and not w.young
    assert w.count({a, b, c}, {a, b}) == 0 and w.young


class _Held(capacity.WaitingRequests):
    """``WaitingRequests`` over given sets instead of Celery's worker state."""

    def __init__(self, held: set, active: set, after: float) -> None:
        super().__init__(2, after=after)
        self.held, self.active = held, active

    def __call__(self) -> int:
        return self.count(self.held, self.active)


def test_a_publisher_publishes_a_waiting_request_once_it_has_waited_not_before() -> None:
    """Lingering children give their slot up ``after`` a request came to a full pool: not at once
    (that was the task-per-message lock), and not never (the publisher looks again while it waits)."""
    sig = CapacitySignal()
    full = {_Req(), _Req()}
    waiting = _Held(set(full), set(full), after=0.1)
    pub = CapacityPublisher(waiting, sig, interval=0.005)
    # A slow idle interval: only the publisher's look at ``young`` brings it back within 0.6 s.
    pub.idle_interval = 1.0
    pub.start()
    try:
        time.sleep(capacity.ACTIVE_WINDOW_S + 0.1)  # past the fast window: the idle interval
        assert sig.read()[1] == 0
        came = time.monotonic()
        waiting.held.add(_Req())  # a third request: it waits for a slot
        pub.poke()  # Celery's task_received
        while sig.read()[1] == 0 and time.monotonic() - came < 3.0:
            time.sleep(0.002)
        waited = time.monotonic() - came
        assert sig.read()[1] == 1, "the waiting request was never published"
        assert waited >= 0.1, f"published after {waited:.3f} s, before it had waited 0.1 s"
        assert waited < 0.6, f"published after {waited:.3f} s: the publisher did not look again while it waited"
    finally:
        pub.stop()


def test_a_copy_of_celerys_request_set_survives_other_threads_changing_it() -> None:
    """Celery's request sets are WeakSets: iterating one while another thread adds and removes
    raised "Set changed size during iteration" (a review found it: in prefork the publisher would
    have stopped for good, in the threads pool the run would have failed before its commit)."""
    import threading
    import weakref

    ws: weakref.WeakSet[_Req] = weakref.WeakSet()
    keep = [_Req() for _ in range(64)]
    for r in keep[:32]:
        ws.add(r)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            ws.add(keep[32 + i % 32])
            ws.discard(keep[32 + (i + 7) % 32])
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    w = capacity.WaitingRequests(1, after=0.0)
    try:
        for _ in range(50_000):
            assert w.count(ws, ()) >= 0
    finally:
        stop.set()
        t.join()
    assert set(capacity._snapshot(ws)) == set(ws)

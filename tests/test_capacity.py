"""The capacity signal that lets prefork children linger: shared across fork, safe when stale."""

from __future__ import annotations

import multiprocessing
import time

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


def test_a_request_may_begin_to_linger_only_while_a_slot_would_stay_free() -> None:
    """``spare`` gates beginning to linger; going on lingering needs only that nobody waits."""
    sig = CapacitySignal()
    assert not sig.may_start_linger()  # never published
    sig.publish(0, spare=True)
    assert sig.may_linger() and sig.may_start_linger()
    sig.publish(0, spare=False)  # every slot busy, nobody waiting: lingerers go on, none begins
    assert sig.may_linger() and not sig.may_start_linger()
    sig.publish(1, spare=True)
    assert not sig.may_linger() and not sig.may_start_linger()
    pub = CapacityPublisher(lambda: 0, sig, interval=0.005, spare=lambda: False)
    pub.start()
    time.sleep(0.03)
    assert sig.may_linger() and not sig.may_start_linger()
    pub.stop()
    assert not sig.may_start_linger()

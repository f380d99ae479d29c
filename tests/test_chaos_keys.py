"""The chaos checker in key order (``ordering="key"``, issue 14): order and overlap per key, fed
records with injected violations (the key-order scenarios themselves run in ``make chaos``)."""

from __future__ import annotations

import dataclasses

import pytest

from chaos import records
from chaos.evidence import Event
from chaos.records import Entry
from tests.test_chaos_smoke import checked, refusal

pytestmark = pytest.mark.chaos_smoke


def kcall(run_id: str, key: str, offset: int, seq: int, start: float, *, pid: int = 1, client: str = "c1",
          epoch: int = 1, still_owner: bool | None = True) -> Entry:
    """One 0.5 s listener call of ``key`` on queue 0."""
    return Entry(key=key, seq=seq, queue=0, offset=offset, epoch=epoch, client=client, pid=pid, start=start,
                 end=start + 0.5, reconsume=0, status=records.SUCCESS, still_owner=still_owner, run=run_id)


def test_keys_of_one_queue_may_overlap_and_interleave_in_key_order() -> None:
    entries = [kcall("a", "x", 0, 1, 10.0), kcall("a", "y", 1, 1, 10.1), kcall("a", "y", 3, 2, 10.7),
               kcall("a", "x", 2, 2, 10.6)]
    assert checked(entries, ordering="key").problems == []
    # The same records break queue order: calls of one queue overlap and offsets go back in a run.
    queue = checked([kcall("a", "x", 0, 1, 10.0), kcall("b", "y", 1, 1, 10.1, pid=2, client="c2")])
    assert queue.overlaps_forbidden


def test_two_calls_of_one_key_at_once_are_reported_even_in_one_process() -> None:
    res = checked([kcall("a", "x", 0, 1, 10.0), kcall("a", "x", 1, 2, 10.2)], ordering="key")
    assert res.overlaps == 1 and res.overlaps_forbidden and not res.passed


def test_a_key_going_back_in_its_run_is_an_order_violation_in_key_order() -> None:
    res = checked([kcall("a", "x", 0, 1, 10.0), kcall("a", "x", 5, 3, 10.6), kcall("a", "x", 2, 2, 11.2)],
                  ordering="key")
    assert any("run a key x on queue 0: offset 2" in v for v in res.violations)
    assert not res.passed


def test_a_suspended_offset_retried_in_the_same_run_is_no_violation_in_key_order() -> None:
    suspended = Entry(key="p", seq=0, queue=0, offset=3, epoch=1, client="c1", pid=1, start=10.0, end=10.1,
                      reconsume=0, status="SUSPEND_CURRENT_QUEUE_A_MOMENT", still_owner=True, run="a")
    again = Entry(key="p", seq=0, queue=0, offset=3, epoch=1, client="c1", pid=1, start=11.0, end=11.1,
                  reconsume=1, status="SUSPEND_CURRENT_QUEUE_A_MOMENT", still_owner=True, run="a")
    assert checked([suspended, again], ordering="key").violations == []
    # A SUCCESS handed out again in the same run is still one.
    done = Entry(**{**suspended.__dict__, "status": records.SUCCESS, "seq": 1})
    twice = Entry(**{**again.__dict__, "status": records.SUCCESS, "seq": 1})
    assert checked([done, twice], ordering="key").violations


def paused_call(asked: float) -> Entry:
    """A call of key x at epoch 1 by c1 that asked ``ctx.still_owner()`` at ``asked`` and got True,
    its process SIGSTOPped from 10.01 to 20.0 (the keys-sigstop-lease failure at 2b2e0c2)."""
    return dataclasses.replace(kcall("a", "x", 0, 1, 10.0), end=20.0, asked=asked)


def newer_calls() -> list[Entry]:
    """c2 took the queue at epoch 2 and runs key x from 12.3 on, while c1 is paused."""
    return [kcall("b", "x", 0, 1, 12.3, client="c2", pid=2, epoch=2, still_owner=None),
            kcall("b", "x", 1, 2, 12.9, client="c2", pid=2, epoch=2, still_owner=None)]


def test_a_true_still_owner_asked_before_the_takeover_and_read_after_a_pause_is_allowed() -> None:
    """Redis answered True right when it was asked (10.01, c1 still held epoch 1: the newer epoch
    was first used at 12.3); c1 was stopped before it read the answer, at 20.0. The answer was
    right; the fenced commit, refused, is what protects the data."""
    pause = Event(10.01, "sigstop", "w1", t_end=20.0, queues=[0], info={"client": "c1"})
    res = checked([paused_call(10.01), *newer_calls()], [refusal("a", 20.01)], ordering="key", events=[pause])
    assert res.problems == []
    assert (res.stale_calls, res.stale_asked_before_replaced, res.overlaps_allowed) == (1, 1, 2)


def test_a_true_still_owner_asked_after_the_queue_was_known_replaced_is_reported() -> None:
    # Asked after the newer epoch's first call: Redis already held epoch 2 and still said True.
    late = checked([paused_call(12.5), *newer_calls()], [refusal("a", 20.01)], ordering="key")
    assert any("ctx.still_owner() said True after the queue was known to be replaced" in p for p in late.problems)
    assert late.overlaps_forbidden and late.stale_asked_before_replaced == 0
    # Asked before c2's first call, but after a lock-table sample showed epoch 2: reported too.
    sample = (11.0, 0, "c2", 2, 17_000, 0, 11_000, "tok", 0, 0)
    sampled = checked([paused_call(11.5), *newer_calls()], [refusal("a", 20.01)], ordering="key", samples=[sample])
    assert sampled.overlaps_forbidden and not sampled.passed
    # A record that does not say when it asked is held to the end of its call, as before.
    unknown = checked([paused_call(0.0), *newer_calls()], [refusal("a", 20.01)], ordering="key")
    assert unknown.overlaps_forbidden and not unknown.passed
    # Allowed only with the refused commit: a True asked in time does not excuse an unfenced call.
    assert not checked([paused_call(10.01), *newer_calls()], ordering="key").passed


def conc_call(start: float, *, epoch: int, reconsume: int, client: str = "c1", pid: int = 1,
              status: str = "SUSPEND_CURRENT_QUEUE_A_MOMENT") -> Entry:
    """One 0.1 s call of poison message p#0 of a concurrent listener: the first from chaos queue 0,
    redeliveries (``reconsume`` > 0) from the retry topic's queue 0, each at its own queue's epoch."""
    return Entry(key="p", seq=0, queue=0, offset=5 if reconsume else 3, epoch=epoch, client=client, pid=pid,
                 start=start, end=start + 0.1, reconsume=reconsume, status=status, still_owner=True, run=f"r{start}")


def test_a_concurrent_redelivery_is_judged_by_its_retry_queues_epoch_not_its_first_queues() -> None:
    """The concurrent chaos scenario at 6c15890 reported 3 stale calls: a poison message first
    handled on chaos queue 0 at epoch 3, then redelivered three times from the retry topic's queue
    0, still at that queue's epoch 2. Both queues have id 0; their epochs are unrelated."""
    entries = [conc_call(10.0, epoch=3, reconsume=0), conc_call(11.0, epoch=2, reconsume=1, client="c2", pid=2),
               conc_call(12.0, epoch=2, reconsume=2, client="c2", pid=2, status=records.SUCCESS)]
    res = checked(entries, ordering="concurrent")
    assert res.stale_calls == 0 and res.problems == [] and res.passed
    # A redelivery at a retry-queue epoch older than one already used there is still a stale call.
    stale = [*entries, conc_call(12.5, epoch=3, reconsume=3, client="c1"), conc_call(13.0, epoch=2, reconsume=4,
                                                                                      client="c2", pid=2)]
    res = checked(stale, ordering="concurrent")
    assert res.stale_calls == 1 and any("stale call" in p for p in res.problems) and not res.passed

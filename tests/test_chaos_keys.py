"""The chaos checker in key order (``ordering="key"``, issue 14): order and overlap per key, fed
records with injected violations (the key-order scenarios themselves run in ``make chaos``)."""

from __future__ import annotations

from chaos import records
from chaos.records import Entry
from tests.test_chaos_smoke import checked


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

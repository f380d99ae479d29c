"""A short smoke of the chaos suite inside ``make test``: the same runner and checker as
``make chaos``, one combined run (3 prefork workers, beat, ~20 s of traffic at 300 msg/s, one
``kill -9`` of a queue owner with a restart, two deletions of the Celery direct queues)."""

from __future__ import annotations

import time

import pytest

from chaos.scenarios import SMOKE, run


@pytest.mark.timeout(150)
def test_chaos_smoke_kill_and_lost_tasks_keep_order_and_lose_nothing() -> None:
    t0 = time.monotonic()
    res = run(SMOKE, drain_timeout=40)
    assert res.produced > 3000
    assert res.violations == []
    assert res.lost == []
    assert res.dup_unexplained == []
    assert res.overlaps_forbidden == []
    assert res.fault_kinds.get("kill") == 1 and res.fault_kinds.get("delete-tasks") == 2
    assert res.failovers and not res.no_failover
    assert res.problems == []
    assert time.monotonic() - t0 < 90

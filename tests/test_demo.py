"""The demo's own path (workers, beat, producer, table), at a smaller size than `make demo`."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mqorder.demo import run_demo

pytestmark = pytest.mark.e2e


def test_demo_reports_zero_violations_and_zero_loss(redis_url: str) -> None:
    out = io.StringIO()
    res = run_demo(orders=300, queues=8, workers=2, concurrency=2, timeout=120,
                   console=Console(file=out, width=120))
    assert res.ok
    assert (res.produced, res.consumed, res.out_of_order, res.lost, res.dlq) == (1200, 1200, 0, 0, 0)
    text = out.getvalue()
    assert "out-of-order" in text and "p99 produce->handle" in text

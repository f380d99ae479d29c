"""The ``batching`` bench section's figures and verdicts (``bench.batching``, ``bench.targets``):
same-run ratios to ``send_orderly``, the judged configuration, and the rows it renders."""

from __future__ import annotations

from bench.batching import report_lines, speedups
from bench.common import Config
from bench.figures import Figures
from bench.targets import TARGETS


def _row(rate: float, cpu_us: float, p99_ms: float | None) -> dict[str, object]:
    paced = None if p99_ms is None else {"messages": 1000, "seconds": 1.0, "rate": 1000.0, "cpu_us": cpu_us * 2,
                                         "redis_cpu_us": 30.0, "p50_ms": p99_ms / 2, "p99_ms": p99_ms, "max_ms": p99_ms}
    return {"messages": 32_000, "seconds": 32_000 / rate, "rate": rate, "cpu_us": cpu_us, "redis_cpu_us": 10.0,
            "calls_per_msg": 0.4, "paced": paced}


RES = {"threads": 32, "queues": 16, "keys": 2000, "linger_ms": 2, "per_thread": 1000, "paced_rate": 1000,
       "paced_seconds": 5, "runs": {
           "sync": [_row(8000, 130, 0.3), _row(10000, 120, 0.4)],
           "async": [_row(48000, 24, 3.0), _row(40000, 30, 6.0)],  # 6.0x and 4.0x their run's sync
           "async_b32": [_row(20000, 40, 3.0), _row(20000, 40, 3.0)],
           "floor": [_row(50000, 25, 0.1), _row(50000, 25, 0.1)],
           "async_nowait": [_row(46000, 16, None), _row(46000, 16, None)]}}


def test_speedup_is_per_run_against_the_same_runs_send_orderly() -> None:
    s = speedups(RES)
    assert s is not None and s.values == [6.0, 4.0] and s.median == 5.0


def test_targets_judge_linger_2_and_show_batch_size_32_beside() -> None:
    rows = {t.id: t.row(Figures(Config(), {"batching": RES})) for t in TARGETS if t.id.startswith("batching")}
    assert rows["batching_throughput"][1].startswith("linger_ms=2: 5.00x (4.00–6.00, 2 runs); with batch_size=32")
    assert rows["batching_throughput"][2] == "**met** (linger_ms=2) (batch_size=32: **NOT met**)"
    assert rows["batching_cpu"][2].startswith("**NOT met**")  # median 27 µs > 25 µs
    assert rows["batching_p99"][2].startswith("**met**")  # median 4.5 ms <= 5 ms
    p99 = next(t for t in TARGETS if t.id == "batching_p99")
    assert p99.row(Figures(Config(), {}))[1:] == ["n/a", "n/a"]  # the section did not run


def test_section_renders_every_variant_and_leaves_the_unpaced_one_blank() -> None:
    text = "\n".join(report_lines(RES))
    assert "| `send_orderly`, one call per message | 9,000 (8,000–10,000, 2 runs) | 1 |" in text
    assert "| 5.00x (4.00–6.00, 2 runs) |" in text
    nowait = next(line for line in text.splitlines() if "then waiting for them" in line)
    assert nowait.endswith("| – | – | – |")
    assert "16,000 msg/s whatever the implementation" in text
    assert report_lines({}) == []

"""The ``concurrent`` section: a concurrent listener's no-op drain vs an orderly one's (issue 15).

``python -m bench.run --only concurrent`` (``--quick`` for a smoke-sized run).

The same backlog (16 queues, 2,000 keys) drained by 2 prefork workers (-c 2) whose listener
returns at once, registered as ``@orderly_listener`` (RocketMQ's queue order) or as
``@concurrent_listener`` (no order; each queue's calls on up to ``consume_concurrency`` lane
threads of its run, the committed offset the lowest one in flight, with the offset map). Worker
sets alternate (orderly, concurrent, orderly, ...) so both see the same machine conditions; each
set drains one unmeasured warm-up and one measured backlog. At consume batch 32 (the headline
drain's) and at batch 1 (RocketMQ's default ``consumeMessageBatchMaxSize``).

What it shows: with a listener that does nothing, concurrency inside a queue cannot help (there
is no wait to overlap), so the figure is the price of the concurrent machinery (lanes, offset
map) against the orderly run's single loop; with I/O-bound listeners the ``keys`` section's key
order shows what in-queue parallelism buys, and a concurrent listener has the same lanes.
"""

from __future__ import annotations

from typing import Any

from bench.common import Config, log, summarize
from bench.mqorder_drain import DrainSpec, drain

QUEUES = 16
BATCHES = (32, 1)
ORDERINGS = ("orderly", "concurrent")


def run(cfg: Config, messages: int, runs: int) -> dict[str, Any]:
    out: dict[str, list[dict[str, Any]]] = {}
    for batch in BATCHES:
        n = messages if batch > 1 else max(1, messages // 4)  # batch 1 is slower: a smaller backlog
        for i in range(runs):
            for ordering in ORDERINGS:
                env = {"BENCH_ORDERING": "concurrent"} if ordering == "concurrent" else {}
                spec = DrainSpec(tag=f"conc-{ordering}-b{batch}-{i}", workers=2, concurrency=2, batch_max=batch,
                                 pull=32, plan=[(QUEUES, n)], warmup=2_000, env=env)
                row = drain(cfg, spec)[0]
                out.setdefault(f"{ordering}-b{batch}", []).append(row)
                log(f"concurrent: {ordering} batch {batch} run {i}: {row['rate']:,.0f} msg/s")
    return {"messages": messages, "queues": QUEUES, "runs": out}


def _median(rows: list[dict[str, Any]]) -> float:
    return summarize(r["rate"] for r in rows).median if rows else float("nan")


def _cpu_us(rows: list[dict[str, Any]]) -> float:
    """Median CPU of the worker processes per message (µs): steadier than wall time on a shared host."""
    return summarize(r["worker_cpu_s"] / r["messages"] * 1e6 for r in rows).median


def ratios(res: dict[str, Any]) -> dict[int, float]:
    """Concurrent / orderly median drain rate per consume batch size."""
    runs = res.get("runs") or {}
    return {b: _median(runs.get(f"concurrent-b{b}", [])) / _median(runs.get(f"orderly-b{b}", []))
            for b in BATCHES if runs.get(f"orderly-b{b}")}


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``concurrent`` section (``bench.report``)."""
    out = ["## Concurrent listener vs orderly listener, no-op drain (issue 15)", ""]
    if not res:
        return out
    runs = res["runs"]
    header = ["consume batch", "orderly msg/s (runs)", "concurrent msg/s (runs)", "concurrent / orderly",
              "worker CPU per message, orderly → concurrent"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for b in BATCHES:
        o, c = runs.get(f"orderly-b{b}") or [], runs.get(f"concurrent-b{b}") or []
        if not o or not c:
            continue
        fmt = lambda rows: ", ".join(f"{r['rate']:,.0f}" for r in rows)  # noqa: E731
        out.append(f"| {b} | {_median(o):,.0f} ({fmt(o)}) | {_median(c):,.0f} ({fmt(c)}) | "
                   f"{_median(c) / _median(o):.2f}x | {_cpu_us(o):.1f} → {_cpu_us(c):.1f} µs |")
    n1 = max(1, res["messages"] // 4)
    out += ["", f"2 prefork workers -c 2, {res['queues']} queues, 2,000 keys, a listener that returns at once; "
            f"{res['messages']:,} messages per run at batch 32, {n1:,} at batch 1; worker sets alternate between the "
            "two listeners (medians). A no-op listener has nothing to overlap, so this is the cost of the "
            "concurrent machinery; the `keys` section shows what parallel calls inside a queue buy with I/O.", ""]
    return out

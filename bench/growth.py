"""Cost growth: drain throughput at 1, 2 and 4 workers over topics of 4, 16 and 64 queues.

Same procedure as ``bench.mqorder_drain`` (idle workers, backlog pre-produced, one rebalance
starts the clock, summed lag 0 stops it), with a smaller backlog. One worker set per worker count
serves every queue count and run (each run on its own topic), with the runs interleaved over the
queue counts so that drift on a shared machine spreads evenly. Stock consume settings (consume
batch 1, pull batch 32). On a 2-core machine more workers cannot add CPU: this is the overhead
curve of more processes and more queues, not a scaling curve.
"""

from __future__ import annotations

from typing import Any

from bench.common import Config
from bench.mqorder_drain import DrainSpec, drain


def run(cfg: Config, *, messages: int, concurrency: int, workers: tuple[int, ...] = (1, 2, 4),
        queues: tuple[int, ...] = (4, 16, 64), runs: int = 3, batch_max: int = 1) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for w in workers:
        plan = [(q, messages) for _ in range(runs) for q in queues]
        spec = DrainSpec(tag=f"growth-w{w}", workers=w, concurrency=concurrency, batch_max=batch_max, plan=plan,
                         warmup=min(5000, messages))
        out.extend(drain(cfg, spec))
    return out

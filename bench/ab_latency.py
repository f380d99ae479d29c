"""Same-run A/B of the latency section's configurations (``bench.latency.mqorder_latency``).

    python -m bench.ab_latency --spec before=/tmp/tree-abc --spec after=. --runs 5 --seconds 5
    python -m bench.ab_latency --spec off=.:MQORDER_CONSUME_LINGER_IDLE_QUEUES=0 --spec on=.

Each ``--spec KEY=ROOT[:VAR=VAL,...]`` is a worker configuration: ``ROOT`` the source tree the
workers run (``.``: this one; a ``git archive`` of another commit for an A/B of two engines) and
settings for them. Stock prefork ``-c`` (default 2) and 2 workers over 16 queues unless told. The
configurations run interleaved (``mqorder_latency``), each on its own redis-server; the medians
per configuration are printed, every run is written to ``bench/runs/ab-<stamp>/ab.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.common import RUNS_DIR, Config, log
from bench.latency import MqLatSpec, mqorder_latency

FIELDS = ("p50_ms", "p99_ms", "max_ms", "tasks_per_msg", "worker_cpu_us_per_msg", "redis_cpu_us_per_msg",
          "producer_cpu_us_per_msg", "machine_busy_cores")


def parse_spec(text: str, pool: str, concurrency: int) -> MqLatSpec:
    key, _, rest = text.partition("=")
    root, _, settings = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    root_path = "" if root in ("", ".") else str(Path(root).resolve())
    return MqLatSpec(key, key, pool=pool, concurrency=concurrency, env=env, root=root_path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", required=True, help="KEY=ROOT[:VAR=VAL,...]")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--pool", default="prefork")
    ap.add_argument("-c", "--concurrency", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--queues", type=int, default=16)
    args = ap.parse_args()
    out_dir = RUNS_DIR / time.strftime("ab-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(runs=args.runs, logdir=out_dir)
    specs = [parse_spec(s, args.pool, args.concurrency) for s in args.spec]
    res = mqorder_latency(cfg, rate=args.rate, seconds=args.seconds, runs=args.runs, specs=specs,
                          workers=args.workers, queues=args.queues)
    (out_dir / "ab.json").write_text(json.dumps({"args": vars(args), "runs": res}, indent=1))
    for s in specs:
        runs = res[s.key]
        log(f"[{s.key}] medians of {len(runs)} runs: " + ", ".join(
            f"{f} {statistics.median(r[f] for r in runs):.2f}" for f in FIELDS))
        log(f"[{s.key}] p99 per run: " + ", ".join(f"{r['p99_ms']:.1f}" for r in runs))
    log(f"written {out_dir / 'ab.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

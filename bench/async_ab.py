"""Same-run A/B of the keys section's async rows (issue 31): ``bench.keys.measure`` for chosen
specs, each on two (or more) worker trees, interleaved round by round.

    python -m bench.async_ab --spec before=/tmp/tree-abc --spec after=. --tags async-pre-key --rounds 3

Each ``--spec KEY=ROOT[:VAR=VAL,...]``: ``ROOT`` the source tree the workers run (``.``: this one;
a ``git archive`` of another commit) and settings for them (as ``bench.ab_latency``). Every round
runs every tag on every tree, the trees' order alternating between rounds, so a burst of other load
on this shared 2-core machine falls on both sides alike. ``--failing`` adds the measured run with
the failing key. Prints medians (min-max) of msg/s and worker CPU µs/msg per tag and tree and the
ratio of each tree to the first; every run goes to ``bench/runs/async-ab-<stamp>/ab.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import RUNS_DIR, Config, load1, log
from bench.keys import ASYNC_SPECS, EXTRA_SPECS, SPECS, KeysSpec, measure


def parse_spec(text: str) -> tuple[str, str, dict[str, str]]:
    key, _, rest = text.partition("=")
    root, _, settings = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in settings.split(",") if kv)
    return key, ("" if root in ("", ".") else str(Path(root).resolve())), env


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.1f} ({min(xs):,.1f}-{max(xs):,.1f})" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", required=True, help="KEY=ROOT[:VAR=VAL,...]")
    ap.add_argument("--tags", default="async-pre-key", help="comma-separated KeysSpec tags")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--messages", type=int, default=20_000, help="before KeysSpec.scale (x5 in key order)")
    ap.add_argument("--failing", action="store_true", help="also the run with the failing key")
    args = ap.parse_args()
    by_tag: dict[str, KeysSpec] = {s.tag: s for s in (*SPECS, *ASYNC_SPECS, *EXTRA_SPECS)}
    tags = [t for t in args.tags.split(",") if t]
    unknown = [t for t in tags if t not in by_tag]
    if unknown:
        raise SystemExit(f"unknown tags {unknown}; known: {sorted(by_tag)}")
    specs = [parse_spec(s) for s in args.spec]
    out_dir = RUNS_DIR / time.strftime("async-ab-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(runs=args.rounds, logdir=out_dir)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        for tag in tags:
            for key, root, env in order:
                log(f"async_ab round {rnd + 1}/{args.rounds}: {tag} on [{key}] (load {load1():.2f})")
                for res in measure(cfg, by_tag[tag], args.messages, root=root, failing=args.failing, env_extra=env):
                    res.update(tree=key, round=rnd, cpu_us=res["worker_cpu_s"] / res["messages"] * 1e6)
                    rows.append(res)
                (out_dir / "ab.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    for tag in tags:
        for fails in ((False, True) if args.failing else (False,)):
            base: tuple[float, float] | None = None
            for key, _, _ in specs:
                rs = [r for r in rows if r["tag"] == tag and r["tree"] == key and r["failing_key"] == fails]
                rate, cpu = [r["others_rate"] for r in rs], [r["cpu_us"] for r in rs]
                loads = [r["load1"] for r in rs]
                m = (statistics.median(rate), statistics.median(cpu)) if rs else (float("nan"), float("nan"))
                base = base or m
                log(f"{tag}{' +failing key' if fails else ''} [{key}]: msg/s {_med(rate)}, worker CPU µs/msg "
                    f"{_med(cpu)}, load1 {_med(loads)}; vs [{specs[0][0]}]: rate {m[0] / base[0]:.2f}x, "
                    f"CPU {m[1] / base[1]:.2f}x")
    log(f"written {out_dir / 'ab.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``make bench``: measure every system and figure in one run and write ``bench/RESULTS.md``.

    python -m bench.run                 # everything, full sizes -> bench/RESULTS.md
    python -m bench.run --quick         # tiny sizes, 1 run each (smoke) -> bench/runs/<stamp>/RESULTS.md
    python -m bench.run --only latency  # one section (comma-separated for several) -> bench/runs/<stamp>/
    python -m bench.run --rerender bench/runs/<stamp> --out bench/RESULTS.md   # rebuild the report only

Raw per-run data and worker logs go to ``bench/runs/<stamp>/`` (git-ignored). Every process a
section starts is stopped when the section ends, on error and on SIGINT/SIGTERM as well. What is
measured and how much: ``bench.plan``; the report: ``bench.report`` (its targets and thresholds:
``bench.targets``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    BENCH_DIR,
    ROOT,
    RUNS_DIR,
    Config,
    dump_json,
    engine_changes,
    load1,
    loadavg,
    log,
    machine_cpu,
    machine_facts,
    own_cpu,
    summarize,
)
from bench.plan import DEFAULT_CONCURRENCY, DRAIN_THREADS_C, LAT_THREADS_C, SECTIONS, concurrency, size
from bench.report import Report

# -- sections ------------------------------------------------------------------------------------------


def _measured() -> dict[str, Any]:
    """When, at which commit and under what load a section measured on its own (``--only``) ran: its
    report says so, as it is placed in the RESULTS.md of an earlier full run."""
    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": _git_commit(), "load1": round(load1(), 2)}


def sec_raw(cfg: Config, res: dict[str, Any]) -> None:
    from bench import raw

    res["raw"] = raw.run(cfg, messages=size(cfg, "drain_messages"), runs=cfg.runs)


def sec_mqorder(cfg: Config, res: dict[str, Any]) -> None:
    from bench.mqorder_drain import DrainSpec, drain
    from bench.raw import RawCeiling

    n = size(cfg, "drain_messages")
    plan = [(16, n)] * cfg.runs
    warm = min(5000, n)
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as st:
        # The raw ceiling on its own redis-server, measured right before every mqorder run.
        rc = RawCeiling(st, messages=n)
        for c in (1, 2):
            out[f"b32_c{c}"] = drain(cfg, DrainSpec(tag=f"mq-b32-c{c}", concurrency=c, batch_max=32, plan=plan,
                                                    warmup=warm), pair=rc.measure)
        med = {c: summarize(r["rate"] for r in out[f"b32_c{c}"]).median for c in (1, 2)}
        best = max(med, key=lambda c: med[c])
        cfg.best_concurrency = best
        log(f"mqorder: best worker concurrency -c {best} ({med[1]:,.0f} vs {med[2]:,.0f} msg/s at batch 32)")
        out["best_concurrency"] = best
        out["b1"] = drain(cfg, DrainSpec(tag=f"mq-b1-c{best}", concurrency=best, batch_max=1, plan=plan,
                                         warmup=warm), pair=rc.measure)
        out[f"b32_threads_c{DRAIN_THREADS_C}"] = drain(
            cfg, DrainSpec(tag=f"mq-b32-t{DRAIN_THREADS_C}", pool="threads", concurrency=DRAIN_THREADS_C,
                           batch_max=32, plan=plan, warmup=warm), pair=rc.measure)
        out["threads_concurrency"] = DRAIN_THREADS_C
    out["b32"] = out[f"b32_c{best}"]
    res["mqorder"] = out


def sec_costs(cfg: Config, res: dict[str, Any]) -> None:
    from bench import costs

    res["costs"] = costs.run(cfg, messages=size(cfg, "costs_messages"), runs=cfg.runs,
                             profile_messages=size(cfg, "costs_profile"))


def sec_naive(cfg: Config, res: dict[str, Any]) -> None:
    from bench import naive

    c = concurrency(cfg)
    res["naive"] = {"concurrency": c, "workers": 2,
                    "runs": naive.throughput(cfg, messages=size(cfg, "naive_messages"), concurrency=c, runs=cfg.runs)}


def sec_single_lane(cfg: Config, res: dict[str, Any]) -> None:
    from bench import single_lane

    res["single_lane"] = single_lane.run(cfg, messages=size(cfg, "lane_messages"), runs=cfg.runs)


def sec_latency(cfg: Config, res: dict[str, Any]) -> None:
    from bench import latency
    from mqorder.settings import Settings

    c = concurrency(cfg)
    # Issue 14's configuration: stock `celery -A workers.app worker`, whose -c defaults to the
    # machine's cores, whatever the drain section found best.
    stock_c = os.cpu_count() or 1
    secs = size(cfg, "latency_seconds")
    linger_ms = Settings.model_fields["consume_linger_ms"].default
    specs = [
        latency.MqLatSpec("prefork", f"stock prefork -c {stock_c}", pool="prefork", concurrency=stock_c),
        latency.MqLatSpec("prefork_wide", f"prefork -c {LAT_THREADS_C}", pool="prefork", concurrency=LAT_THREADS_C),
        latency.MqLatSpec("threads", f"threads -c {LAT_THREADS_C}", pool="threads", concurrency=LAT_THREADS_C),
        latency.MqLatSpec("threads_nolinger", f"threads -c {LAT_THREADS_C}, linger off", pool="threads",
                          concurrency=LAT_THREADS_C, env={"MQORDER_CONSUME_LINGER_MS": "0"}),
    ]
    mq = latency.mqorder_latency(cfg, rate=1000, seconds=secs, runs=cfg.runs, specs=specs)
    res["latency"] = {
        "rate": 1000, "seconds": secs, "concurrency": c, "stock_concurrency": stock_c,
        "threads_concurrency": LAT_THREADS_C, "linger_ms": linger_ms, "prefork_lingers": True,
        "warmup_each_run": True,
        # "mqorder" stays the first prefork configuration, as in results.json files written before the
        # others; with "stock_concurrency" it is the stock one (-c = cores), the one the target judges.
        "mqorder": mq["prefork"], "mqorder_prefork_wide": mq["prefork_wide"], "mqorder_threads": mq["threads"],
        "mqorder_threads_nolinger": mq["threads_nolinger"],
        "naive": latency.naive_latency(cfg, rate=1000, seconds=secs, runs=cfg.runs, concurrency=c),
    }


def sec_celery_broker(cfg: Config, res: dict[str, Any]) -> None:
    from bench import celery_broker

    res["celery_broker"] = celery_broker.run(cfg, messages=size(cfg, "drain_messages"), runs=cfg.runs,
                                             concurrency=concurrency(cfg), seconds=size(cfg, "latency_seconds"))


def sec_produce(cfg: Config, res: dict[str, Any]) -> None:
    from bench import produce

    res["produce"] = produce.run(cfg, single=size(cfg, "produce_single"), batch=size(cfg, "produce_batch"),
                                 raw=size(cfg, "produce_raw"), runs=cfg.runs)


def sec_failover(cfg: Config, res: dict[str, Any]) -> None:
    from bench import failover

    c = concurrency(cfg)
    res["failover"] = {"concurrency": c, "kills": failover.run(cfg, kills=size(cfg, "failover_kills"), concurrency=c)}


def sec_rebalance(cfg: Config, res: dict[str, Any]) -> None:
    from bench import rebalance

    res["rebalance"] = rebalance.run(cfg, runs=size(cfg, "rebalance_runs"))


def sec_memory(cfg: Config, res: dict[str, Any]) -> None:
    from bench import memory

    c = concurrency(cfg)
    res["memory"] = {"concurrency": c,
                     "runs": memory.run(cfg, messages=size(cfg, "memory_messages"), concurrency=c, runs=cfg.runs)}


def sec_growth(cfg: Config, res: dict[str, Any]) -> None:
    from bench import growth

    c, n = concurrency(cfg), size(cfg, "growth_messages")
    res["growth"] = {"concurrency": c, "messages": n,
                     "runs": growth.run(cfg, messages=n, concurrency=c, runs=cfg.runs)}


def sec_retention(cfg: Config, res: dict[str, Any]) -> None:
    from bench import retention

    c = concurrency(cfg)
    out: dict[str, Any] = {"steady": retention.steady(cfg, rate=5000, seconds=size(cfg, "retention_seconds"),
                                                      retention_ms=size(cfg, "retention_ms"), concurrency=c)}
    res["retention"] = out  # kept even if the drain comparison fails
    out["drain"] = retention.drain_cost(cfg, messages=size(cfg, "retention_drain_messages"), runs=cfg.runs,
                                        concurrency=c)
    png = retention.plot(out, cfg.logdir / "retention_memory.png")
    out["plot"] = str(png) if png else None


def sec_spark(cfg: Config, res: dict[str, Any]) -> None:
    from bench import spark

    res["spark"] = spark.run(cfg)


def sec_spark_audit(cfg: Config, res: dict[str, Any]) -> None:
    from bench import spark_audit

    res["spark_audit"] = spark_audit.run(size(cfg, "audit_records"), ab_runs=1 if cfg.quick else cfg.runs)


def sec_dedup(cfg: Config, res: dict[str, Any]) -> None:
    from bench import dedup

    res["dedup"] = dedup.run(cfg, messages=size(cfg, "dedup_messages"), runs=cfg.runs)


def sec_durable_send(cfg: Config, res: dict[str, Any]) -> None:
    from bench import durable_send

    res["durable_send"] = durable_send.run(cfg, single=size(cfg, "durable_single"), batch=size(cfg, "durable_batch"),
                                           runs=cfg.runs)


def sec_sentinel(cfg: Config, res: dict[str, Any]) -> None:
    from bench import sentinel

    res["sentinel"] = sentinel.run(cfg, messages=size(cfg, "drain_messages"), runs=cfg.runs,
                                   concurrency=concurrency(cfg), kills=size(cfg, "sentinel_kills"))
    # The section says when and from what it was measured: it may be run on its own (--only
    # sentinel) and its section placed in a RESULTS.md of an earlier full run.
    res["sentinel"]["measured"] = _measured()


def sec_cluster(cfg: Config, res: dict[str, Any]) -> None:
    from bench import cluster

    res["cluster"] = cluster.run(cfg, messages=size(cfg, "cluster_messages"), runs=cfg.runs,
                                 concurrency=concurrency(cfg))
    # Measured on its own (--only cluster) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["cluster"]["measured"] = _measured()


def sec_transactions(cfg: Config, res: dict[str, Any]) -> None:
    from bench import transactions

    res["transactions"] = transactions.run(cfg, messages=size(cfg, "transactions_messages"), runs=cfg.runs)


def sec_concurrent(cfg: Config, res: dict[str, Any]) -> None:
    from bench import concurrent

    res["concurrent"] = concurrent.run(cfg, messages=size(cfg, "concurrent_messages"), runs=max(2, cfg.runs))


def sec_keys(cfg: Config, res: dict[str, Any]) -> None:
    from bench import keys

    res["keys"] = keys.run(cfg, messages=size(cfg, "keys_messages"), runs=cfg.runs)


def sec_trickle_cost(cfg: Config, res: dict[str, Any]) -> None:
    from bench import trickle_cost

    res["trickle_cost"] = trickle_cost.run(cfg, [trickle_cost.CostSpec("now")], runs=cfg.runs,
                                           seconds=size(cfg, "trickle_cost_seconds"),
                                           drain_messages=size(cfg, "trickle_cost_drain"))
    # Measured on its own (--only trickle_cost) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["trickle_cost"]["measured"] = _measured()


def sec_spark_modes(cfg: Config, res: dict[str, Any]) -> None:
    from bench import spark_modes

    res["spark_modes"] = spark_modes.run(cfg, rows=size(cfg, "spark_modes_rows"), runs=cfg.runs)
    # Measured on its own (--only spark_modes) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["spark_modes"]["measured"] = _measured()


def sec_trickle_floor(cfg: Config, res: dict[str, Any]) -> None:
    from bench import trickle_floor

    res["trickle_floor"] = trickle_floor.run(cfg, seconds=size(cfg, "trickle_floor_seconds"), runs=cfg.runs)
    # Measured on its own (--only trickle_floor) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["trickle_floor"]["measured"] = _measured()


def sec_idle(cfg: Config, res: dict[str, Any]) -> None:
    from bench import idle

    res["idle"] = idle.run(cfg, seconds=size(cfg, "idle_seconds"), slow_seconds=size(cfg, "idle_slow_seconds"),
                           warmup_s=size(cfg, "idle_warmup_seconds"))
    res["idle"]["measured"] = _measured()


def sec_groups(cfg: Config, res: dict[str, Any]) -> None:
    """60 groups at a trickle on two stock workers (``bench.groups``); with ``BENCH_GROUPS_BEFORE=<a
    source tree>`` (a ``git archive`` of another commit) that tree's workers run beside this one's,
    interleaved: the same-run A/B the section then shows."""
    from bench import groups
    from bench.trickle_cost import CostSpec, parse_spec

    before = os.environ.get("BENCH_GROUPS_BEFORE")
    specs = [CostSpec("now")]
    if before:
        try:  # a path that holds no mqorder tree is refused, saying how to make one
            specs.insert(0, parse_spec(f"before={before}"))
        except ValueError as exc:
            raise ValueError(f"BENCH_GROUPS_BEFORE={before!r}: {exc}") from None
    res["groups"] = groups.run(cfg, specs, shape=groups.GroupsShape(), rate=groups.RATE,
                               seconds=size(cfg, "groups_seconds"), runs=cfg.runs)
    # Measured on its own (--only groups) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["groups"]["measured"] = _measured()


def sec_exporter_scrape(cfg: Config, res: dict[str, Any]) -> None:
    from bench import exporter_scrape

    res["exporter_scrape"] = exporter_scrape.run(cfg, runs=cfg.runs)
    res["exporter_scrape"]["measured"] = _measured()


def sec_batching(cfg: Config, res: dict[str, Any]) -> None:
    from bench import batching

    res["batching"] = batching.run(cfg, per_thread=size(cfg, "batching_per_thread"),
                                   paced_seconds=size(cfg, "batching_paced_seconds"), runs=cfg.runs)
    # Measured on its own (--only batching) and placed in a RESULTS.md of an earlier full run, as sentinel.
    res["batching"]["measured"] = _measured()


RUNNERS: dict[str, Callable[[Config, dict[str, Any]], None]] = {
    "raw": sec_raw, "mqorder": sec_mqorder, "costs": sec_costs, "naive": sec_naive,
    "single_lane": sec_single_lane, "latency": sec_latency, "celery_broker": sec_celery_broker,
    "produce": sec_produce, "failover": sec_failover, "rebalance": sec_rebalance, "memory": sec_memory,
    "growth": sec_growth, "retention": sec_retention, "spark": sec_spark,
    "spark_audit": sec_spark_audit, "spark_modes": sec_spark_modes, "dedup": sec_dedup, "transactions": sec_transactions, "keys": sec_keys,
    "concurrent": sec_concurrent, "durable_send": sec_durable_send, "sentinel": sec_sentinel,
    "cluster": sec_cluster, "trickle_cost": sec_trickle_cost,
    "trickle_floor": sec_trickle_floor, "idle": sec_idle, "batching": sec_batching,
    "exporter_scrape": sec_exporter_scrape,
    "groups": sec_groups,
}


# -- main ----------------------------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mqorder", "workers", "config"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}{' + uncommitted engine changes' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return "?"


def rerender(rundir: Path, out: Path | None) -> int:
    """Write RESULTS.md again from a stored ``results.json`` (same figures, current report code).

    Runs stored before per-section wall-clock times were recorded get them reconstructed from the
    start date and the section durations; engine files modified during the run are looked up again.
    """
    data = json.loads((rundir / "results.json").read_text())
    facts, meta, res = data["facts"], data["meta"], data["results"]
    quick = rundir.name.endswith("-quick")
    cfg = Config(quick=quick, runs=1 if quick else 3, logdir=rundir)
    if "start_wall" not in meta:
        start = time.mktime(time.strptime(facts["date"].rsplit(" ", 1)[0], "%Y-%m-%d %H:%M:%S"))
        meta["start_wall"] = start
        t = start
        for name, secs in meta.get("sections_s", {}).items():
            c = meta.setdefault("conditions", {}).setdefault(name, {})
            c.setdefault("start_wall", t)
            c.setdefault("end_wall", t + secs)
            t += secs
    meta.setdefault("end_wall", meta["start_wall"] + meta.get("wall_s", 0))
    if "engine_changes" not in meta:
        meta["engine_changes"] = engine_changes(meta["start_wall"], meta["end_wall"])
    target = out or (rundir / "RESULTS.md")
    target.write_text(Report(cfg, res, facts, meta).render())
    log(f"wrote {target} from {rundir / 'results.json'}")
    return 0


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 run each (a smoke test of the harness)")
    ap.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(SECTIONS)}")
    ap.add_argument("--runs", type=int, default=None, help="measured runs per figure (default 3; 1 with --quick)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help=f"worker -c when the mqorder section does not run (default {DEFAULT_CONCURRENCY})")
    ap.add_argument("--rerender", default=None, metavar="RUNDIR",
                    help="rebuild RESULTS.md from RUNDIR/results.json without measuring (to --out, or RUNDIR)")
    ap.add_argument("--out", default=None, help="where to write RESULTS.md (default: bench/RESULTS.md for a full "
                                                "run, the run directory otherwise)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    if args.rerender:
        return rerender(Path(args.rerender), Path(args.out) if args.out else None)
    signal.signal(signal.SIGTERM, _sigterm)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mqorder").setLevel(logging.ERROR)

    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    rundir = RUNS_DIR / stamp
    cfg = Config(quick=args.quick, runs=args.runs or (1 if args.quick else 3), logdir=rundir)
    if args.concurrency:
        cfg.best_concurrency = args.concurrency
    full = not args.quick and not only
    out_path = Path(args.out) if args.out else (BENCH_DIR / "RESULTS.md" if full else rundir / "RESULTS.md")
    facts = machine_facts()
    meta: dict[str, Any] = {"rundir": str(rundir.relative_to(ROOT)), "commit": _git_commit(), "errors": {},
                            "sections_s": {}, "conditions": {}, "start_wall": time.time()}
    res: dict[str, Any] = {}
    t_all = time.perf_counter()
    log(f"bench: sections {', '.join(only or SECTIONS)}; logs and raw data in {rundir}")
    try:
        for name in SECTIONS:
            if only and name not in only:
                continue
            log(f"== {name}")
            t0 = time.perf_counter()
            m0, own0, load0, w0 = machine_cpu(), own_cpu(), load1(), time.time()
            try:
                RUNNERS[name](cfg, res)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
                meta["errors"][name] = f"{type(exc).__name__}: {exc}"
                log(f"section {name} FAILED:\n{traceback.format_exc()}")
            meta["sections_s"][name] = round(time.perf_counter() - t0, 1)
            m1, own1 = machine_cpu(), own_cpu()
            wall = time.perf_counter() - t0
            cores = os.cpu_count() or 1
            meta["conditions"][name] = {
                "wall_s": wall, "load_start": load0, "load_end": load1(),
                "other_share": max(0.0, (m1[0] - m0[0]) - (own1 - own0)) / (wall * cores),
                "steal_share": (m1[1] - m0[1]) / (wall * cores), "start_wall": w0, "end_wall": time.time(),
            }
            log(f"== {name} took {meta['sections_s'][name]:.0f}s")
            dump_json(rundir / "results.json", {"facts": facts, "meta": meta, "results": res})
    finally:
        meta["wall_s"] = time.perf_counter() - t_all
        meta["end_wall"] = time.time()
        meta["engine_changes"] = engine_changes(meta["start_wall"], meta["end_wall"])
        meta["load_end"] = loadavg()
        dump_json(rundir / "results.json", {"facts": facts, "meta": meta, "results": res})
        if res:
            text = Report(cfg, res, facts, meta).render()
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(text)
            log(f"wrote {out_path} ({meta['wall_s'] / 60:.1f} min)")
    return 1 if meta["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())


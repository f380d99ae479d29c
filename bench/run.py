"""``make bench``: measure every system and figure in one run and write ``bench/RESULTS.md``.

    python -m bench.run                 # everything, full sizes -> bench/RESULTS.md
    python -m bench.run --quick         # tiny sizes, 1 run each (smoke) -> bench/runs/<stamp>/RESULTS.md
    python -m bench.run --only latency  # one section (comma-separated for several) -> bench/runs/<stamp>/
    python -m bench.run --rerender bench/runs/<stamp> --out bench/RESULTS.md   # rebuild the report only

Raw per-run data and worker logs go to ``bench/runs/<stamp>/`` (git-ignored). Every process a
section starts is stopped when the section ends, on error and on SIGINT/SIGTERM as well.
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
    Summary,
    dump_json,
    engine_changes,
    load1,
    log,
    machine_cpu,
    machine_facts,
    own_cpu,
    percentile,
    summarize,
)

SECTIONS = ("raw", "mqorder", "costs", "naive", "single_lane", "latency", "produce", "failover", "rebalance",
            "memory", "growth")
DEFAULT_CONCURRENCY = 2
#: Threads-pool worker concurrency of the latency section and of the threads drain row.
LAT_THREADS_C = 8
DRAIN_THREADS_C = 4

#: Sizes: (full, quick).
SIZES = {
    "drain_messages": (200_000, 10_000),
    "naive_messages": (10_000, 1_000),
    "lane_messages": (20_000, 2_000),
    "latency_seconds": (10, 2),
    "produce_single": (5_000, 500),
    "produce_batch": (100_000, 5_000),
    "produce_raw": (100_000, 5_000),
    "failover_kills": (10, 2),
    "rebalance_runs": (5, 1),
    "memory_messages": (1_000_000, 20_000),
    "growth_messages": (50_000, 5_000),
    "costs_messages": (200_000, 10_000),
    "costs_profile": (50_000, 5_000),
}


def size(cfg: Config, name: str) -> int:
    full, quick = SIZES[name]
    return quick if cfg.quick else full


# -- sections ------------------------------------------------------------------------------------------


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


def _conc(cfg: Config) -> int:
    return cfg.best_concurrency or DEFAULT_CONCURRENCY


def sec_costs(cfg: Config, res: dict[str, Any]) -> None:
    from bench import costs

    res["costs"] = costs.run(cfg, messages=size(cfg, "costs_messages"), runs=cfg.runs,
                             profile_messages=size(cfg, "costs_profile"))


def sec_naive(cfg: Config, res: dict[str, Any]) -> None:
    from bench import naive

    c = _conc(cfg)
    res["naive"] = {"concurrency": c, "workers": 2,
                    "runs": naive.throughput(cfg, messages=size(cfg, "naive_messages"), concurrency=c, runs=cfg.runs)}


def sec_single_lane(cfg: Config, res: dict[str, Any]) -> None:
    from bench import single_lane

    res["single_lane"] = single_lane.run(cfg, messages=size(cfg, "lane_messages"), runs=cfg.runs)


def sec_latency(cfg: Config, res: dict[str, Any]) -> None:
    from bench import latency
    from mqorder.settings import Settings

    c = _conc(cfg)
    secs = size(cfg, "latency_seconds")
    linger_ms = Settings.model_fields["consume_linger_ms"].default
    specs = [
        latency.MqLatSpec("prefork", f"prefork -c {c}", pool="prefork", concurrency=c),
        latency.MqLatSpec("prefork_wide", f"prefork -c {LAT_THREADS_C}", pool="prefork", concurrency=LAT_THREADS_C),
        latency.MqLatSpec("threads", f"threads -c {LAT_THREADS_C}", pool="threads", concurrency=LAT_THREADS_C),
        latency.MqLatSpec("threads_nolinger", f"threads -c {LAT_THREADS_C}, linger off", pool="threads",
                          concurrency=LAT_THREADS_C, env={"MQORDER_CONSUME_LINGER_MS": "0"}),
    ]
    mq = latency.mqorder_latency(cfg, rate=1000, seconds=secs, runs=cfg.runs, specs=specs)
    res["latency"] = {
        "rate": 1000, "seconds": secs, "concurrency": c, "threads_concurrency": LAT_THREADS_C,
        "linger_ms": linger_ms, "prefork_lingers": True,
        # "mqorder" stays the prefork configuration, as in results.json files written before the others.
        "mqorder": mq["prefork"], "mqorder_prefork_wide": mq["prefork_wide"], "mqorder_threads": mq["threads"],
        "mqorder_threads_nolinger": mq["threads_nolinger"],
        "naive": latency.naive_latency(cfg, rate=1000, seconds=secs, runs=cfg.runs, concurrency=c),
    }


def sec_produce(cfg: Config, res: dict[str, Any]) -> None:
    from bench import produce

    res["produce"] = produce.run(cfg, single=size(cfg, "produce_single"), batch=size(cfg, "produce_batch"),
                                 raw=size(cfg, "produce_raw"), runs=cfg.runs)


def sec_failover(cfg: Config, res: dict[str, Any]) -> None:
    from bench import failover

    res["failover"] = {"concurrency": _conc(cfg),
                       "kills": failover.run(cfg, kills=size(cfg, "failover_kills"), concurrency=_conc(cfg))}


def sec_rebalance(cfg: Config, res: dict[str, Any]) -> None:
    from bench import rebalance

    res["rebalance"] = rebalance.run(cfg, runs=size(cfg, "rebalance_runs"))


def sec_memory(cfg: Config, res: dict[str, Any]) -> None:
    from bench import memory

    res["memory"] = {"concurrency": _conc(cfg),
                     "runs": memory.run(cfg, messages=size(cfg, "memory_messages"), concurrency=_conc(cfg),
                                        runs=cfg.runs)}


def sec_growth(cfg: Config, res: dict[str, Any]) -> None:
    from bench import growth

    res["growth"] = {"concurrency": _conc(cfg), "messages": size(cfg, "growth_messages"),
                     "runs": growth.run(cfg, messages=size(cfg, "growth_messages"), concurrency=_conc(cfg),
                                        runs=cfg.runs)}


RUNNERS: dict[str, Callable[[Config, dict[str, Any]], None]] = {
    "raw": sec_raw, "mqorder": sec_mqorder, "costs": sec_costs, "naive": sec_naive,
    "single_lane": sec_single_lane, "latency": sec_latency, "produce": sec_produce, "failover": sec_failover,
    "rebalance": sec_rebalance, "memory": sec_memory, "growth": sec_growth,
}


# -- report ------------------------------------------------------------------------------------------


def _rates(rows: list[dict[str, Any]] | None) -> Summary | None:
    if not rows:
        return None
    return summarize(r["rate"] for r in rows)


def _ratio(a: Summary | None, b: Summary | None) -> tuple[float, float, float] | None:
    """Ratio of medians, with the envelope (min a / max b, max a / min b)."""
    if a is None or b is None or not b.median:
        return None
    return a.median / b.median, a.lo / b.hi, a.hi / b.lo


def _paired(rows: list[dict[str, Any]] | None) -> Summary | None:
    """Per-run ratio of a drain to the raw-ceiling run paired with it (taken just before it)."""
    xs = [r["rate"] / r["paired"]["rate"] for r in (rows or []) if r.get("paired")]
    return summarize(xs) if xs else None


def _fp(s: Summary | None) -> str:
    if s is None:
        return "n/a"
    return f"{s.median:.2f}x ({s.lo:.2f}–{s.hi:.2f}, {s.n} paired runs)"


def _fr(r: tuple[float, float, float] | None) -> str:
    if r is None:
        return "n/a"
    return f"{r[0]:.2f}x ({r[1]:.2f}–{r[2]:.2f})"


def _dur(secs: float) -> str:
    return f"{secs:.0f} s" if secs < 120 else f"{secs / 60:.1f} min"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**NOT met**")


def _s(s: Summary | None, digits: int = 0, unit: str = "msg/s") -> str:
    return "n/a" if s is None or s.n == 0 else s.fmt(digits, unit)


def _lat_configs(lat: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The mqorder configurations of the latency section: (results key, short name, table label)."""
    c, tc, linger = lat.get("concurrency", "?"), lat.get("threads_concurrency", LAT_THREADS_C), lat.get("linger_ms", 50)
    if not lat.get("prefork_lingers"):  # results.json of a run made before prefork children lingered
        return [
            ("mqorder", f"prefork pool -c {c}",
             f"mqorder, **prefork** pool, 2 workers -c {c} (stock settings; prefork children never linger)"),
            ("mqorder_threads", f"threads pool -c {tc} + linger",
             f"mqorder, **threads** pool, 2 workers -c {tc}, **linger {linger} ms** (stock settings)"),
            ("mqorder_threads_nolinger", f"threads pool -c {tc}, linger off",
             f"mqorder, **threads** pool, 2 workers -c {tc}, **linger off** (`MQORDER_CONSUME_LINGER_MS=0`)"),
        ]
    return [
        ("mqorder", f"prefork pool -c {c}",
         f"mqorder, **prefork** pool, 2 workers -c {c} (stock settings, linger {linger} ms)"),
        ("mqorder_prefork_wide", f"prefork pool -c {tc}",
         f"mqorder, **prefork** pool, 2 workers **-c {tc}** (stock settings, linger {linger} ms)"),
        ("mqorder_threads", f"threads pool -c {tc}",
         f"mqorder, **threads** pool, 2 workers -c {tc} (stock settings, linger {linger} ms)"),
        ("mqorder_threads_nolinger", f"threads pool -c {tc}, linger off",
         f"mqorder, **threads** pool, 2 workers -c {tc}, **linger off** (`MQORDER_CONSUME_LINGER_MS=0`)"),
    ]


class Report:
    def __init__(self, cfg: Config, res: dict[str, Any], facts: dict[str, str], meta: dict[str, Any]) -> None:
        self.cfg, self.res, self.facts, self.meta = cfg, res, facts, meta
        self.lines: list[str] = []

    def w(self, s: str = "") -> None:
        self.lines.append(s)

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.w("| " + " | ".join(header) + " |")
        self.w("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            self.w("| " + " | ".join(r) + " |")
        self.w()

    def render(self) -> str:  # noqa: C901 - one linear document
        res, cfg = self.res, self.cfg
        mq = res.get("mqorder") or {}
        raw = res.get("raw") or {}
        s_raw, s_rawdec = _rates(raw.get("raw")), _rates(raw.get("raw+decode"))
        s_b32, s_b1 = _rates(mq.get("b32")), _rates(mq.get("b1"))
        naive = res.get("naive") or {}
        s_naive = _rates(naive.get("runs"))
        s_lane = _rates(res.get("single_lane"))
        best = mq.get("best_concurrency", _conc(cfg))
        n_drain = size(cfg, "drain_messages")

        self.w("# mqorder benchmark results")
        self.w()
        self.w(f"Generated by `make bench` (`python -m bench.run{' --quick' if cfg.quick else ''}`) on "
               f"{self.facts['date']}; written by the program, not by hand. Raw per-run data: "
               f"`{self.meta['rundir']}/results.json` (git-ignored).")
        if cfg.quick:
            self.w()
            self.w("**QUICK SMOKE RUN: tiny sizes, 1 run each. These numbers are not the benchmark.**")
        self.w()
        changes = self.meta.get("engine_changes") or []
        if changes:
            self.w("**Warning: the engine's source changed while this run was in progress** (files under "
                   "mqorder/, workers/, config/, tasks/ modified between the start and the end of the run). "
                   "Workers started after a change may have loaded the changed code, or a mix (Lua scripts are "
                   "read when a process first needs them). Treat the sections listed as measuring an engine that "
                   "is not exactly the commit named below:")
            self.w()
            cond = self.meta.get("conditions") or {}
            for f, m in changes:
                during = [n for n, c in cond.items() if c.get("start_wall", 0) <= m <= c.get("end_wall", 0)]
                after = [n for n, c in cond.items() if c.get("start_wall", 0) > m]
                self.w(f"- `{f}` modified at {time.strftime('%H:%M:%S', time.localtime(m))}"
                       + (f", during section `{during[0]}`" if during else "")
                       + (f"; sections started after it: {', '.join(f'`{a}`' for a in after)}" if after else ""))
            self.w()
        self.w("## Machine")
        self.w()
        facts = dict(self.facts)
        facts["engine commit"] = self.meta.get("commit", "?")
        facts["loadavg at end"] = self.meta.get("load_end", "?")
        facts["wall time of this run"] = f"{self.meta.get('wall_s', 0) / 60:.1f} min"
        self.table(["fact", "value"], [[k, f"`{v}`" if k in ("redis-server", "engine commit") else v]
                                       for k, v in facts.items()])
        self.w("Every system runs on its own `redis-server` (started by `mqorder.embedded.RedisServer` on a free "
               "loopback port), on this one machine, in this one run. The machine has "
               f"{facts['nproc']} cores shared by Redis, the workers and the benchmark driver, and possibly "
               "by other work: treat absolute numbers as this box's, and ratios as the result.")
        self.w()

        cond = self.meta.get("conditions") or {}
        if cond:
            self.w("Conditions per section (the machine may be shared: \"other work\" is the machine's busy CPU time "
                   "minus the CPU of this benchmark and every process it started, as a share of all cores over the "
                   "section's wall time):")
            self.w()
            self.table(["section", "wall time", "load average (1 min) at start → end", "CPU used by other work",
                        "CPU steal"],
                       [[name, f"{c['wall_s']:.0f} s", f"{c['load_start']:.2f} → {c['load_end']:.2f}",
                         f"{c['other_share'] * 100:.0f}% of {self.facts['nproc']} cores",
                         f"{c['steal_share'] * 100:.1f}%"] for name, c in cond.items()])

        # ---- targets ---------------------------------------------------------------------------------
        self.w("## Targets")
        self.w()
        rows = []
        r_raw32, r_raw1 = _ratio(s_b32, s_raw), _ratio(s_b1, s_raw)
        p_raw32, p_raw1 = _paired(mq.get("b32")), _paired(mq.get("b1"))
        rows.append([f"mqorder no-op, 2 workers -c {best}, pull 32, consume batch 32 ≥ 1.0x raw ceiling",
                     _fp(p_raw32), _met(None if p_raw32 is None else p_raw32.median >= 1.0)])
        rows.append(["mqorder, consume batch 1 ≥ 0.6x raw ceiling", _fp(p_raw1),
                     _met(None if p_raw1 is None else p_raw1.median >= 0.6)])
        r_nv32, r_nv1 = _ratio(s_b32, s_naive), _ratio(s_b1, s_naive)
        rows.append(["mqorder ≥ 50x naive Celery", f"batch 32: {_fr(r_nv32)}; batch 1: {_fr(r_nv1)}",
                     _met(None if r_nv32 is None else r_nv32[0] >= 50)
                     + ("" if r_nv1 is None else f" (batch 1: {_met(r_nv1[0] >= 50)})")])
        r_ln32, r_ln1 = _ratio(s_b32, s_lane), _ratio(s_b1, s_lane)
        rows.append(["mqorder ≥ 10x Celery single-lane", f"batch 32: {_fr(r_ln32)}; batch 1: {_fr(r_ln1)}",
                     _met(None if r_ln32 is None else r_ln32[0] >= 10)
                     + ("" if r_ln1 is None else f" (batch 1: {_met(r_ln1[0] >= 10)})")])
        lat = res.get("latency") or {}
        lat_short = {k: short for k, short, _ in _lat_configs(lat)}
        p99s = {k: summarize(r["p99_ms"] for r in lat[k]) for k in lat_short if lat.get(k)}
        if p99s:
            best_lat = min(p99s, key=lambda k: p99s[k].median)
            others = "; ".join(f"{lat_short[k]}: {p99s[k].fmt(1, 'ms')}" for k in p99s if k != best_lat)
            rows.append(["p99 send→handle ≤ 10 ms at 1,000 msg/s (mqorder, best configuration measured)",
                         f"**{lat_short[best_lat]}: {p99s[best_lat].fmt(1, 'ms')}**"
                         + (f"; other configurations: {others}" if others else ""),
                         f"{_met(p99s[best_lat].median <= 10)} ({lat_short[best_lat]})"])
        else:
            rows.append(["p99 send→handle ≤ 10 ms at 1,000 msg/s (mqorder)", "n/a", _met(None)])
        prod = res.get("produce") or {}
        s_pb, s_px = _rates(prod.get("send_orderly_batch")), _rates(prod.get("raw_xadd"))
        r_prod = _ratio(s_pb, s_px)
        rows.append(["send_orderly_batch ≥ 0.5x raw pipelined XADD", _fr(r_prod),
                     _met(None if r_prod is None else r_prod[0] >= 0.5)])
        fo = [k for k in ((res.get("failover") or {}).get("kills") or [])]
        fo_t = [k["failover_s"] for k in fo]
        fo_p99 = percentile(fo_t, 99) if fo_t else None
        rows.append([f"failover p99 ≤ 5 s ({len(fo_t)} kills)",
                     "n/a" if fo_p99 is None else f"p99 {fo_p99:.2f} s (p50 {percentile(fo_t, 50):.2f} s)",
                     _met(None if fo_p99 is None else fo_p99 <= 5.0)])
        rb = (res.get("rebalance") or {}).get("initial") or []
        s_rb = summarize(x["wall_ms"] for x in rb) if rb else None
        rows.append(["rebalance + lock of 1,024 queues over 8 clients ≤ 50 ms", _s(s_rb, 1, "ms"),
                     _met(None if s_rb is None else s_rb.median <= 50)])
        mem = (res.get("memory") or {}).get("runs") or []
        s_mem = summarize(x["peak_rss_mib"] for x in mem) if mem else None
        mem_n = mem[0]["messages"] if mem else size(cfg, "memory_messages")
        rows.append([f"worker peak RSS draining a {mem_n:,}-message backlog ≤ 200 MiB", _s(s_mem, 1, "MiB"),
                     _met(None if s_mem is None else s_mem.hi <= 200)])
        self.table(["target", "measured (median, envelope or min–max)", "verdict"], rows)
        self.w("The two raw-ceiling targets use *paired* runs: right before each measured mqorder drain, the raw "
               "reader drains the same-size backlog on its own redis-server, and the figure is the median (and "
               "min–max) of the per-run ratios, so a burst of other load on the machine hits both sides of a ratio "
               "alike. Other ratios are ratios of medians, with the envelope in brackets (slowest run of the "
               "numerator over the fastest of the denominator, and the reverse). The memory target is judged on "
               "the worst run.")
        self.w()

        # ---- throughput ------------------------------------------------------------------------------
        self.w("## Throughput: draining a pre-produced backlog over 2,000 keys")
        self.w()
        trows = []

        def add(name: str, s: Summary | None, count: str, note: str) -> None:
            trows.append([name, _s(s), count, note])

        add("raw single-process ceiling (redis-py + hiredis, XRANGE 32 + fenced Lua commit)", s_raw,
            f"{n_drain:,}", "one process, no decoding, no Celery")
        dtc = mq.get("threads_concurrency", DRAIN_THREADS_C)
        k_thr = f"b32_threads_c{dtc}"
        paired_rows = [r["paired"] for k in ("b32_c1", "b32_c2", "b1", k_thr) for r in (mq.get(k) or [])
                       if r.get("paired")]
        add("raw ceiling, paired runs (one right before each mqorder run below)", _rates(paired_rows), f"{n_drain:,}",
            "same reader; these are the denominators of the raw targets")
        add("raw + mqorder decode_entries", s_rawdec, f"{n_drain:,}", "the raw reader also decodes every batch")
        costs = res.get("costs") or {}
        add("mqorder engine in-process, consume batch 1 (no Celery, 1 process)", _rates(costs.get("engine_b1")),
            f"{size(cfg, 'costs_messages'):,}", "ConsumeRequest.run() called directly; diagnostic")
        add("mqorder engine in-process, consume batch 32 (no Celery, 1 process)", _rates(costs.get("engine_b32")),
            f"{size(cfg, 'costs_messages'):,}", "ConsumeRequest.run() called directly; diagnostic")
        for c in (1, 2):
            add(f"**mqorder**, 2 workers -c {c}, consume batch 32, pull 32", _rates(mq.get(f"b32_c{c}")),
                f"{n_drain:,}", "best concurrency" if c == best else "")
        add(f"**mqorder**, 2 workers -c {best}, consume batch 1, pull 32", s_b1, f"{n_drain:,}", "")
        if mq.get(k_thr):
            add(f"**mqorder**, 2 workers **-P threads -c {dtc}**, consume batch 32, pull 32", _rates(mq.get(k_thr)),
                f"{n_drain:,}", "threads pool (stock settings)")
        nn = size(cfg, "naive_messages")
        add(f"naive Celery (task per message, SET NX PX lock, retry 50 ms), 2 workers -c {naive.get('concurrency', '?')}",
            s_naive, f"**{nn:,}**",
            "**smaller count** (same 2,000 keys)" + (
                f": {n_drain:,} at its rate would take ~{_dur(n_drain / s_naive.median)} per run"
                if s_naive and s_naive.median else "") + "; rates compare")
        nl = size(cfg, "lane_messages")
        add("Celery single-lane (2 shard queues, 2 workers -c 1, no-op task)", s_lane, f"**{nl:,}**",
            "**smaller count**, same 2,000 keys; rates compare")
        self.table(["system", "messages/s: median (min–max, runs)", "messages per run", "notes"], trows)
        rrows = [
            ["mqorder batch 32 / raw ceiling (paired runs)", _fp(p_raw32)],
            ["mqorder batch 1 / raw ceiling (paired runs)", _fp(p_raw1)],
            [f"mqorder batch 32, -c {3 - best} / raw ceiling (paired runs)", _fp(_paired(mq.get(f"b32_c{3 - best}")))],
            *([[f"mqorder batch 32, -P threads -c {dtc} / raw ceiling (paired runs)", _fp(_paired(mq.get(k_thr)))]]
              if mq.get(k_thr) else []),
            ["mqorder batch 32 / raw ceiling (standalone raw section, ratio of medians)", _fr(r_raw32)],
            ["mqorder batch 1 / raw ceiling (standalone raw section, ratio of medians)", _fr(r_raw1)],
            ["mqorder batch 32 / raw + decode", _fr(_ratio(s_b32, s_rawdec))],
            ["mqorder batch 32 / naive", _fr(r_nv32)], ["mqorder batch 1 / naive", _fr(r_nv1)],
            ["mqorder batch 32 / single-lane", _fr(r_ln32)], ["mqorder batch 1 / single-lane", _fr(r_ln1)],
        ]
        self.table(["ratio (same run)", "value"], rrows)
        if naive.get("runs"):
            nr = naive["runs"]
            self.w(f"Naive Celery delivered **{summarize(x['out_of_order_keys'] for x in nr).fmt(0)} keys out of "
                   f"order** (of ~{nr[0]['keys']:,} keys per run; a key counts once if its handled sequence numbers "
                   f"are not strictly increasing), with {summarize(x['retries'] for x in nr).fmt(0)} lock retries. "
                   "The per-key lock prevents overlap, not reordering: two workers holding consecutive messages "
                   "of a key can run them in either order. mqorder and single-lane preserve per-key order by "
                   "construction (not re-verified here; the test suite checks it).")
            self.w()
        self.w("Method: workers start idle. mqorder: the listener's topic does not exist when they join; the "
               "backlog is produced with `send_orderly_batch` into a new 16-queue topic that nobody owns yet, then "
               "the clock starts and one rebalance (from the driver) assigns the queues and dispatches the "
               "ConsumeRequests; the clock stops when the summed lag (`MessageLog.lag`: next offset − consume "
               "offset, polled every 10 ms) is 0. Celery baselines: tasks are pre-published to a queue nobody "
               "consumes; the clock starts at `control.add_consumer`. A short unmeasured warm-up run precedes the "
               "measured runs of each worker set. Keys are chosen at random (seeded, the same sequence in every "
               "system) with per-key sequence numbers.")
        self.w()
        self.w(f"Worker concurrency for mqorder: tried -c 1 and -c 2 per worker at batch 32; the better median "
               f"(**-c {best}**) is used for batch 1, the prefork latency row, failover, memory, growth and the naive "
               "baseline.")
        self.w()

        # ---- consume path cost ----------------------------------------------------------------------
        self.w("## Per-message cost of the consume path")
        self.w()
        crow = []
        for label, key in (("batch 32", "b32"), ("batch 1", "b1")):
            rows_ = mq.get(key) or []
            if not rows_:
                continue
            msgs = sum(r["messages"] for r in rows_)
            pulls = msgs / 32
            tasks = sum(r["consume_tasks"] for r in rows_)
            ev = sum(r["evalsha"] for r in rows_)
            xr = sum(r["xrange"] for r in rows_)
            calls = sum(r["listener_calls"] for r in rows_)
            tot = sum(r["commands_total"] for r in rows_)
            evus = sum(r.get("evalsha_usec", 0) for r in rows_)
            crow.append([f"Celery drain, consume {label}", f"{tasks / msgs:.5f} ({tasks} runs / {msgs:,} msgs)",
                         f"{ev / pulls:.2f}", f"{evus / ev:.0f} µs" if ev else "n/a", f"{xr / pulls:.2f}",
                         f"{calls / msgs:.3f}", f"{tot / msgs:.3f}"])
        self.table(["path", "consume_request tasks per message", "EVALSHA per pulled batch of 32",
                    "Redis time per EVALSHA", "XRANGE per batch of 32", "listener calls per message",
                    "Redis commands per message (all)"], crow)
        budget = []

        def cpu_row(name: str, rows_: list[dict[str, Any]] | None, note: str = "") -> None:
            rows_ = [x for x in (rows_ or []) if "worker_cpu_s" in x]
            if not rows_:
                return
            n = sum(x["messages"] for x in rows_)
            wc = sum(x["worker_cpu_s"] for x in rows_) / n * 1e6
            rc = sum(x["redis_cpu_s"] for x in rows_) / n * 1e6
            budget.append([name, _s(_rates(rows_)), f"{wc:.1f}", f"{rc:.1f}", f"{wc + rc:.1f}", note])

        cpu_row("raw ceiling", raw.get("raw"), "XRANGE 32 + tiny fenced commit, 2 round trips per batch")
        cpu_row("raw + decode_entries", raw.get("raw+decode"))
        cpu_row("engine in-process, batch 32", costs.get("engine_b32"), "no Celery")
        cpu_row("engine in-process, batch 1", costs.get("engine_b1"), "no Celery")
        cpu_row(f"mqorder Celery drain, batch 32, -c {best}", mq.get("b32"), "all worker processes")
        cpu_row(f"mqorder Celery drain, batch 1, -c {best}", mq.get("b1"), "all worker processes")
        cpu_row(f"mqorder Celery drain, batch 32, -P threads -c {dtc}", mq.get(k_thr), "all worker processes")
        if budget:
            self.w("CPU spent per message (user + system time from `/proc/<pid>/stat` of the reader / all worker "
                   "processes, and of `redis-server`, over the timed region; total over runs / messages):")
            self.w()
            self.table(["path", "messages/s", "reader/worker CPU µs/msg", "redis-server CPU µs/msg",
                        "total µs/msg", "notes"], budget)
        dec = costs.get("decode_us_per_msg")
        self.w("- **Round trips**: the raw reader makes 2 per batch of 32 (XRANGE, then the commit script). "
               "mqorder makes 1 `begin.lua` per ConsumeRequest run (claim, lock check, first pull, inside Lua), "
               "then per pulled batch of 32 one round trip carrying the fenced `commit.lua` with a plain `XRANGE` "
               "of the next batch pipelined behind it (discarded if the commit is refused); a drained queue's "
               "last commit ends the run itself: about 1 EVALSHA and 1 XRANGE per 32 messages plus a few per run, "
               "as the table shows.")
        self.w("- **Lua**: every mqorder script also reads Redis `TIME`; commit.lua does HMGET + HSET + GET "
               "(+ EXISTS on the retries hash) and no longer reads entries, so Redis does not convert them into "
               "Lua tables and back. \"Redis time per EVALSHA\" is Redis's own accounting (`INFO commandstats` "
               "usec / calls, begin.lua's first pull included). \"Redis commands per message (all)\" counts "
               "everything Redis executed during the drain, including the commands inside scripts, Celery's "
               "broker traffic, the workers' heartbeats and the driver's lag polling.")
        if dec is not None:
            self.w(f"- **Decode**: `decode_entries` costs **{dec:.2f} µs per message** here (JSON header parse, "
                   "type checks, `MessageExt`); the raw ceiling with decoding added is shown above.")
        self.w("- **Celery task overhead**: one `consume_request` task runs per queue per drain (a run keeps "
               "consuming until its queue is empty or `max_time_consume_continuously` elapses), so tasks per "
               "message is ~queues/messages; the Celery cost is per run, not per message.")
        for b in (1, 32):
            prof = costs.get(f"profile_b{b}")
            if not prof:
                continue
            self.w()
            self.w(f"In-process engine profile, consume batch {b} ({prof['messages']:,} messages under cProfile, "
                   f"{prof['total_s']:.2f} s profiled; top functions by own time):")
            self.w()
            self.table(["function", "calls", "own time (s)", "cumulative (s)"],
                       [[f"`{r['function']}`", f"{r['calls']:,}", f"{r['tottime_s']:.3f}", f"{r['cumtime_s']:.3f}"]
                        for r in prof["top"][:12]])

        # ---- latency ---------------------------------------------------------------------------------
        self.w("## Latency: send → handler at a steady 1,000 messages/s")
        self.w()
        lrows = []
        lat_rows = [(label, key) for key, _, label in _lat_configs(lat)]
        lat_rows.append((f"naive Celery, prefork pool, 2 workers -c {lat.get('concurrency', '?')}", "naive"))
        for name, key in lat_rows:
            rr = lat.get(key) or []
            if not rr:
                continue
            tpm = summarize(r["tasks_per_msg"] for r in rr).fmt(3) if "tasks_per_msg" in rr[0] else "1 (by design)"
            wcpu = (summarize(r["worker_cpu_us_per_msg"] for r in rr).fmt(0, "µs")
                    if "worker_cpu_us_per_msg" in rr[0] else "not measured")
            rcpu = (summarize(r["redis_cpu_us_per_msg"] for r in rr).fmt(0, "µs")
                    if "redis_cpu_us_per_msg" in rr[0] else "not measured")
            lrows.append([name, summarize(r["p50_ms"] for r in rr).fmt(2, "ms"),
                          summarize(r["p99_ms"] for r in rr).fmt(2, "ms"),
                          summarize(r["max_ms"] for r in rr).fmt(1, "ms"),
                          f"{sum(r['samples'] for r in rr):,}", summarize(r["send_rate"] for r in rr).fmt(0, "msg/s"),
                          tpm, wcpu, rcpu])
        self.table(["system (configuration)", "p50 (median of runs)", "p99 (median of runs)", "max", "samples",
                    "achieved send rate", "Celery tasks per message", "worker CPU per message",
                    "redis-server CPU per message"], lrows)
        if lat:
            tc = lat.get("threads_concurrency", LAT_THREADS_C)
            self.w(f"Paced producer in the driver process ({lat.get('seconds')} s per run after 1 s of discarded "
                   "warm-up, one `send_orderly`/`send_task` per message on a fixed schedule, 16 queues, 2,000 keys); "
                   "the body carries `time.time_ns()` taken just before the send and the handler pushes "
                   "`now − sent` to a Redis list. Percentiles are nearest-rank per run; the table shows their "
                   "median and min–max over runs. Every mqorder configuration uses stock settings (consume batch 1, "
                   "pull 32) on 2 workers with its own redis-server; all the worker sets are started up front and "
                   "their runs are interleaved (run i of each configuration back to back, the order rotating from "
                   "run to run), so they face the same machine conditions and the same key sequence. The first "
                   "prefork configuration uses the -c chosen by the throughput section; the wide prefork one "
                   f"and the threads pool run -c {tc} (one slot per queue each worker owns).")
            self.w()
            if lat.get("prefork_lingers"):
                self.w(f"**Linger** (`MQORDER_CONSUME_LINGER_MS`, default {lat.get('linger_ms', 50)} ms), like a "
                       "RocketMQ long-polling pull: a ConsumeRequest that drained its queue waits on the stream "
                       "(`XREAD BLOCK` in 10 ms slices) instead of ending its run, as long as its worker has a free "
                       "slot for every request it received; it keeps its pending token, so the producer wakes "
                       "nobody and the next message is handled without a pub/sub wake-up and a new Celery task. It "
                       "gives the slot back within a slice when a request waits for one, when a rebalance assigns "
                       "the queue elsewhere, or on shutdown. The threads pool reads Celery's bookkeeping directly; "
                       "prefork children read it from a shared page the worker's main process keeps current "
                       "(`mqorder.celery.capacity`). With **fewer slots than owned queues** (-c 1 here, 8 queues "
                       "per worker) a slot can serve one lingering queue at a time, so most messages still take "
                       "the wake-up path: that row shows the cost of the wake-up path itself. The linger-off row is "
                       "the threads pool with `MQORDER_CONSUME_LINGER_MS=0`.")
            else:
                self.w(f"**Linger** (`MQORDER_CONSUME_LINGER_MS`, default {lat.get('linger_ms', 50)} ms): a "
                       "ConsumeRequest that drained its queue waits on the stream (`XREAD BLOCK` in 10 ms slices) "
                       "instead of ending its run, as long as its worker has no received request waiting for a "
                       "slot. In this run it acted only in the threads pool; prefork children never lingered.")
            self.w()
            self.w("\"Celery tasks per message\" counts `consume_request` tasks run in the window (without linger, "
                   "each idle queue that receives a message is woken through pub/sub and the worker dispatches a "
                   "task for it); \"worker CPU per message\" is the CPU of all worker processes (and threads) over "
                   "the window divided by the messages: multiplied by 1,000 msg/s it says how many of the "
                   "machine's cores the workers need at this rate. \"redis-server CPU per message\" is the same "
                   "for that configuration's redis-server (lingering requests poll with `XREAD BLOCK`).")
            nv = _rates((res.get("naive") or {}).get("runs"))
            if nv is not None and nv.median < 1000:
                self.w()
                self.w(f"Naive Celery drains at ~{nv.median:,.0f} msg/s on this machine, below the 1,000 msg/s "
                       "offered: its queue grows during the run, and its latency is mostly queueing delay.")
            self.w()

        # ---- produce ---------------------------------------------------------------------------------
        self.w("## Produce rate")
        self.w()
        if prod:
            self.table(["producer", "messages/s", "messages per run"], [
                ["`send_orderly`, one synchronous call per message", _s(_rates(prod.get("send_orderly"))),
                 f"{size(cfg, 'produce_single'):,}"],
                ["`send_orderly_batch`, 10,000 items per call", _s(s_pb), f"{size(cfg, 'produce_batch'):,}"],
                ["raw pipelined `XADD` (1,000 per pipeline, pre-encoded entries)", _s(s_px),
                 f"{size(cfg, 'produce_raw'):,}"],
            ])
            self.w(f"`send_orderly_batch` / raw XADD: {_fr(r_prod)}; `send_orderly` / raw XADD: "
                   f"{_fr(_ratio(_rates(prod.get('send_orderly')), s_px))}. 16 queues, 2,000 keys, one subscribing "
                   "group (no owner, so no wake-ups). The raw XADD has its headers encoded and queues chosen before "
                   "the clock starts; the producer does validation, ids, header encoding and queue selection inside.")
            self.w()

        # ---- failover --------------------------------------------------------------------------------
        self.w("## Failover after kill -9")
        self.w()
        if fo:
            mv = [k["moved_s"] for k in fo]
            fp = [k["first_progress_s"] for k in fo]
            self.table(["measure", "p50", "p99", "min–max", "kills"], [
                ["all queues of the killed worker progressed elsewhere (the figure)", f"{percentile(fo_t, 50):.2f} s",
                 f"{percentile(fo_t, 99):.2f} s", f"{min(fo_t):.2f}–{max(fo_t):.2f} s", str(len(fo_t))],
                ["all its queues' locks moved to a live worker", f"{percentile(mv, 50):.2f} s",
                 f"{percentile(mv, 99):.2f} s", f"{min(mv):.2f}–{max(mv):.2f} s", str(len(mv))],
                ["first of its queues progressed", f"{percentile(fp, 50):.2f} s", f"{percentile(fp, 99):.2f} s",
                 f"{min(fp):.2f}–{max(fp):.2f} s", str(len(fp))],
            ])
            self.w(f"3 workers -c {(res.get('failover') or {}).get('concurrency')}, stock settings (heartbeat "
                   "interval and timeout, sweep, leases), 16 queues, steady traffic of 500 msg/s. Each kill: "
                   "`WorkerProcess.kill()` (SIGKILL to the process group) of a worker owning queues (read from the "
                   "lock entries), then the state hashes of its queues are polled every 10 ms; the worker is "
                   "restarted and the next kill waits for a steady state. Detection is bounded below by the "
                   "heartbeat timeout minus the age of the last heartbeat, plus up to one heartbeat interval "
                   "until a surviving worker notices and rebalances. With 10 kills, p99 is the worst kill.")
            self.w()
            self.table(["kill", "victim", "queues owned", "moved (s)", "progressed (s)"],
                       [[str(k["kill"]), k["victim"], str(k["queues_owned"]), f"{k['moved_s']:.2f}",
                         f"{k['failover_s']:.2f}"] for k in fo])

        # ---- rebalance -------------------------------------------------------------------------------
        self.w("## Rebalance")
        self.w()
        rbr = res.get("rebalance") or {}
        if rbr:
            rows = []
            for key, name in (("initial", "first rebalance: allocate + lock all 1,024 queues (the figure)"),
                              ("unchanged", "again, nothing changed (every lock kept)"),
                              ("one_left", "after one of the 8 clients left")):
                xs = rbr.get(key) or []
                if xs:
                    rows.append([name, summarize(x["wall_ms"] for x in xs).fmt(1, "ms"),
                                 summarize(x["moved"] for x in xs).fmt(0)])
            self.table(["rebalance of 1,024 queues, 8 clients", "wall time of `RebalanceService.rebalance()`",
                        "queues moved"], rows)
            self.w("8 fake clients registered with `ClientRegistry`, one clustering group subscribed to a topic of "
                   "1,024 queues (the per-broker maximum); the timed call includes the mutex, the membership read, "
                   "the allocation, `assign.lua` over all queues and the assignment hint write. One unmeasured "
                   "warm-up round first.")
            self.w()

        # ---- memory ----------------------------------------------------------------------------------
        self.w("## Memory")
        self.w()
        if mem:
            self.table(["measure", "value"], [
                ["peak summed RSS of the worker (main + pool)", _s(s_mem, 1, "MiB")],
                ["RSS when the worker had just registered (consumption starting)",
                 summarize(x.get("registered_rss_mib", float("nan")) for x in mem).fmt(1, "MiB")],
                ["RSS when the drain finished", summarize(x["final_rss_mib"] for x in mem).fmt(1, "MiB")],
                ["processes in the worker's tree", str(mem[0]["processes"])],
                ["drain rate of that single worker", _s(summarize(x["rate"] for x in mem))],
                ["redis-server RSS holding the backlog", f"{mem[0]['redis_rss_mib_after_produce']:.0f} MiB"],
            ])
            self.w(f"One stock worker -c {(res.get('memory') or {}).get('concurrency')} drains a {mem_n:,}-message "
                   "backlog (16 queues, 2,000 keys) alone; each run is a fresh worker with a new consumer group "
                   "starting at offset 0. Summed `VmRSS` from `/proc` of the main process and its descendants, every "
                   "0.2 s, from process start until the lag is 0 (summing RSS counts pages shared after fork once "
                   "per process: an upper bound on real use).")
            self.w()

        # ---- growth ----------------------------------------------------------------------------------
        self.w("## Cost growth: workers × queues")
        self.w()
        gr = (res.get("growth") or {}).get("runs") or []
        if gr:
            ws = sorted({x["workers"] for x in gr})
            qs = sorted({x["queues"] for x in gr})
            rows = []
            for w in ws:
                row = [f"{w} worker{'s' if w > 1 else ''}"]
                for q in qs:
                    cell = [x["rate"] for x in gr if x["workers"] == w and x["queues"] == q]
                    row.append(summarize(cell).fmt(0) if cell else "n/a")
                rows.append(row)
            self.table(["msg/s: median (min–max, runs)"] + [f"{q} queues" for q in qs], rows)
            g = res["growth"]
            self.w(f"Backlog {g['messages']:,} messages per run over 2,000 keys, stock consume settings (consume "
                   f"batch 1, pull 32), each worker -c {g['concurrency']}. **This machine has "
                   f"{self.facts['nproc']} cores**: more workers add processes, not CPU, so this shows the overhead "
                   "curve of more processes and more queues (scheduling, rebalance, per-queue runs), not scaling. "
                   "With 4 queues and more pool processes than queues, some processes have nothing to do.")
            self.w()

        # ---- hot-path history -------------------------------------------------------------------------
        hist_path = Path(__file__).with_name("history.json")
        if hist_path.exists():
            hist = json.loads(hist_path.read_text())
            self.w("## Hot-path changes: before → after")
            self.w()
            self.w(f"From `bench/history.json` (not measured by this run): {hist['about']}")
            self.w()
            for ch in hist["changes"]:
                self.w(f"**{ch['date']}, `{ch['commit']}`**: {ch['change']} Measured with {ch['how']}.")
                self.w()
                self.table(["figure", "before", "after"], [list(r) for r in ch["rows"]])

        # ---- notes -----------------------------------------------------------------------------------
        self.w("## Notes")
        self.w()
        self.w("- Each figure is the median of runs in this invocation with min–max; run counts are shown.")
        self.w(f"- Naive Celery ran {nn:,} messages per run and single-lane {nl:,} (mqorder and the raw ceiling: "
               f"{n_drain:,}), over the same 2,000 keys: messages/s are comparable, counts are not the same.")
        self.w("- All Celery apps use JSON only and a broker on their own redis-server; workers are real "
               "`celery worker` subprocesses, started by the benchmark and stopped at its end: prefork pool, "
               "except the rows marked threads (`-P threads`).")
        self.w("- The benchmark driver (producer, pollers) shares the same cores as the systems measured.")
        if self.meta.get("errors"):
            self.w()
            self.w("## Errors")
            self.w()
            for name, err in self.meta["errors"].items():
                self.w(f"- section `{name}` failed: `{err}` (see the log)")
        self.w()
        return "\n".join(self.lines)


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
        try:
            meta["load_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        except OSError:
            meta["load_end"] = "?"
        dump_json(rundir / "results.json", {"facts": facts, "meta": meta, "results": res})
        if res:
            text = Report(cfg, res, facts, meta).render()
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(text)
            log(f"wrote {out_path} ({meta['wall_s'] / 60:.1f} min)")
    return 1 if meta["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())


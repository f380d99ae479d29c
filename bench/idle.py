"""What an idle deployment costs (issue 27): 2 stock workers + celery beat over 1,024 idle queues.

Stock deployment as ``workers/`` runs it: ``celery -A workers.app worker`` (prefork, ``-c`` = the
machine's cores, stock settings) twice and one ``celery -A workers.app beat`` (its schedule:
``mqorder.celery.setup.beat_schedule``: rebalance and lock renewal every 20 s, the transaction
check every 60 s), Celery's broker the store's own Redis. Two layouts of the 1,024 queues: one
topic of 1,024 queues (one group), and 64 topics of 16 queues (64 groups: each topic its own
listener, as ``bench.listeners`` registers lanes).

Warm-up: the topics exist before the workers join; once they have registered, one message is sent
to every queue (each queue's ConsumeRequest runs once and ends: the state a deployment is in
after traffic stops) and the lag is waited to 0; then ``WARMUP_S`` more seconds (linger ends, the
joins' rebalances and the first lock renewals pass). Then nothing is sent for ``seconds`` (a
multiple of the 20 s rebalance/lock interval; the full size covers the 60 s transaction check
once): worker CPU (each worker's main process and its pool children), beat CPU and Redis CPU
(``INFO cpu``), Redis's round trips and ``commandstats``, per second and as a share of one core.
A second, shorter window with the SLOWLOG at threshold 0 names the scripts (``bench.redis_meter``).

Issue 27's target: workers and Redis together ≤ 2 % of one core.

A/B of two engines in the same run: with ``BENCH_IDLE_BASELINE=<commit>`` each layout is measured
twice, the workers and beat of one measurement running a ``git archive`` of that commit (its
``PYTHONPATH`` and working directory), the other this tree, in alternating order (baseline first
for the first layout, this tree first for the next); the report gives both and their ratio.

    python -m bench.run --only idle
    BENCH_IDLE_BASELINE=30e00c7 python -m bench.run --only idle --out /tmp/idle.md
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import subprocess
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    Config,
    cpu_s,
    log,
    measured_note,
    mq_env,
    queues_of,
    redis_and_client,
    start_mq_workers,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import lane_names
from bench.redis_meter import RedisMeter, library_script_names, pretty
from mqorder import Producer
from mqorder.testing.launcher import BeatProcess

#: (topics, queues per topic): 1,024 queues either way.
LAYOUTS = ((1, 1024), (64, 16))
#: Issue 27: workers + Redis, share of one core.
TARGET_SHARE = 0.02
WARMUP_S = 40.0
#: Seconds per slice of the window: its Redis commands/s and CPU per slice show whether it was steady.
SLICE_S = 10.0


def _keys_per_queue(n: int) -> list[str]:
    """A sharding key for each of ``n`` queues under the default selector (crc32 mod n)."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < n:
        k = f"k{i}"
        out.setdefault(zlib.crc32(k.encode()) % n, k)
        i += 1
    return [out[q] for q in range(n)]


def _script_names(tree: Path | None = None) -> dict[str, str]:
    """SHA1 -> script name for the SLOWLOG: this tree's scripts, or (A/B) those of ``tree``, whose
    sources may differ (read by that tree's own ``mqorder.store.scripts``, in a subprocess)."""
    import hashlib
    import json
    import sys

    from mqorder.store import scripts

    if tree is None:
        return {**library_script_names(),
                **{hashlib.sha1(scripts.source(n).encode()).hexdigest(): n for n in scripts.NAMES}}
    code = ("import hashlib, json\nfrom mqorder.store import scripts\n"
            "print(json.dumps({hashlib.sha1(scripts.source(n).encode()).hexdigest(): n for n in scripts.NAMES}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         check=True, capture_output=True, text=True).stdout
    return {**library_script_names(), **json.loads(out)}


def _slices(meter: RedisMeter, seconds: float) -> list[dict[str, float]]:
    """Sleep ``seconds`` in slices of ``SLICE_S``; per slice, Redis's commands/s and CPU share (one
    ``INFO`` at the start and one per slice: reads the caller takes out, ``len(result) + 1``)."""

    def sample() -> tuple[float, int, float]:
        info = meter.r.info("all")
        return (time.perf_counter(), int(info["total_commands_processed"]),
                float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))

    out = []
    t_end = time.perf_counter() + seconds
    prev = sample()
    while (left := t_end - time.perf_counter()) > 0.5:
        time.sleep(min(SLICE_S, left))
        now = sample()
        dt = now[0] - prev[0]
        out.append({"seconds": dt, "commands_per_s": (now[1] - prev[1] - 1) / dt,  # its own INFO left out
                    "cpu_share": (now[2] - prev[2]) / dt})
        prev = now
    return out


@contextlib.contextmanager
def commit_tree(commit: str) -> Iterator[Path]:
    """A temporary directory holding the whole tree of ``commit`` (``git archive``): the baseline's
    workers, beat and listeners run from it."""
    raw = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory(prefix="mqorder-idle-baseline-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def measure(cfg: Config, *, topics: int, queues: int, seconds: float, slow_seconds: float,
            warmup_s: float = WARMUP_S, tree: Path | None = None, variant: str = "") -> dict[str, Any]:
    """One layout, on a redis-server of its own; see the module docstring. ``tree``: the source tree
    the workers and beat run (default: this one)."""
    tag = f"idle-{topics}x{queues}" + (f"-{variant}" if variant else "")
    concurrency = os.cpu_count() or 1
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        lanes = lane_names("idle", "g-idle", topics)
        p = Producer(srv.url)
        st.callback(p.close)
        for t, _ in lanes:
            p.create_topic(t, queues=queues)
        extra = {"PYTHONPATH": str(tree)} if tree is not None else {}
        env = mq_env(srv.url, topic="idle", group="g-idle", lanes=topics, **extra)
        log(f"idle {tag}: 2 workers -c {concurrency} + beat")
        ws = start_mq_workers(st, srv.url, [f"{tag}-w{i}" for i in range(2)], env, concurrency, cfg.logdir / tag,
                              cwd=tree)
        beat = BeatProcess(env=env, workdir=cfg.logdir / tag / "beat", logfile=cfg.logdir / tag / "beat.log",
                           cwd=tree or ROOT)
        beat.start()
        st.callback(beat.stop)
        keys = _keys_per_queue(queues)
        for t, _ in lanes:
            for k in keys:
                p.send_orderly(t, b"{}", sharding_key=k)
        for t, g in lanes:
            wait_lag_zero(r, g, queues_of(t, queues), 120, alive=lambda: all(w.alive() for w in ws))
        time.sleep(warmup_s)
        if not beat.alive():
            raise RuntimeError(f"celery beat exited; see {cfg.logdir / tag / 'beat.log'}")
        meter = RedisMeter(srv.url, _script_names(tree))
        st.callback(meter.close)
        assert beat.proc is not None
        pids, beat_pid = [w.pid for w in ws], beat.proc.pid

        def cpus() -> tuple[float, float, float]:
            return tree_cpu_s(pids), sum(cpu_s(p) for p in pids), tree_cpu_s([beat_pid])

        w0, m0, b0 = cpus()
        meter.start()
        slices = _slices(meter, seconds)
        win = meter.stop(own_reads=len(slices) + 1)
        w1, m1, b1 = cpus()
        win["slices"] = slices
        meter.start(slowlog=True)
        time.sleep(slow_seconds)
        slow = meter.stop()
        if not all(w.alive() for w in ws) or not beat.alive():
            raise RuntimeError(f"idle {tag}: a worker or beat exited during the window; see {cfg.logdir / tag}")
    out = {"topics": topics, "queues": queues, "variant": variant, "concurrency": concurrency, "warmup_s": warmup_s,
           "worker_cpu_s": w1 - w0, "worker_main_cpu_s": m1 - m0, "beat_cpu_s": b1 - b0, "window": win,
           "slow": slow}
    s = win["seconds"]
    log(f"idle {tag}: workers {(w1 - w0) / s * 100:.2f} % of a core (main {(m1 - m0) / s * 100:.2f}), beat "
        f"{(b1 - b0) / s * 100:.2f} %, redis {win['cpu_s'] / s * 100:.2f} %, {win['reads'] / s:.0f} reads/s, "
        f"{sum(v['calls'] for v in win['commandstats'].values()) / s:.0f} commands/s")
    return out


def run(cfg: Config, *, seconds: float, slow_seconds: float, warmup_s: float = WARMUP_S) -> dict[str, Any]:
    baseline = os.environ.get("BENCH_IDLE_BASELINE", "").strip()
    out: dict[str, Any] = {"seconds": seconds, "slow_seconds": slow_seconds, "target_share": TARGET_SHARE}
    if not baseline:
        out["layouts"] = [measure(cfg, topics=t, queues=q, seconds=seconds, slow_seconds=slow_seconds,
                                  warmup_s=warmup_s) for t, q in LAYOUTS]
        return out
    def rev(c: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", c], check=True, capture_output=True,
                              text=True).stdout.strip()

    full = rev(baseline)
    out["baseline"] = full
    # BENCH_IDLE_NEW=<commit>: the new side from an archive too (a shared checkout may hold others'
    # uncommitted changes); default: this tree as it is.
    new = os.environ.get("BENCH_IDLE_NEW", "").strip()
    out["new"] = rev(new) if new else ""
    lays: list[dict[str, Any]] = []
    with commit_tree(full) as tree, (commit_tree(out["new"]) if new else contextlib.nullcontext()) as new_tree:
        for i, (t, q) in enumerate(LAYOUTS):
            order = [("baseline", tree), ("new", new_tree)]
            for variant, root in order if i % 2 == 0 else order[::-1]:
                lays.append(measure(cfg, topics=t, queues=q, seconds=seconds, slow_seconds=slow_seconds,
                                    warmup_s=warmup_s, tree=root, variant=variant))
    out["layouts"] = lays
    return out


# -- the report ----------------------------------------------------------------------------------------


def shares(lay: dict[str, Any]) -> dict[str, float]:
    """Shares of one core over the window: workers, their main processes, pool children, beat, Redis."""
    s = lay["window"]["seconds"]
    w, m = lay["worker_cpu_s"] / s, lay["worker_main_cpu_s"] / s
    return {"workers": w, "main": m, "children": w - m, "beat": lay["beat_cpu_s"] / s,
            "redis": lay["window"]["cpu_s"] / s, "workers_redis": w + lay["window"]["cpu_s"] / s}


def worst_share(res: dict[str, Any]) -> float | None:
    """Workers + Redis, share of one core, of the costlier layout (what the target judges; in an
    A/B, of this tree's measurements)."""
    lays = [lay for lay in res.get("layouts") or [] if lay.get("variant", "") in ("", "new")]
    return max(shares(lay)["workers_redis"] for lay in lays) if lays else None


def _pct(x: float) -> str:
    return f"{x * 100:.2f} %"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _layout(lay: dict[str, Any]) -> str:
    return f"{lay['topics']} topic{'s' if lay['topics'] > 1 else ''} × {lay['queues']:,} queues"


def _name(lay: dict[str, Any], res: dict[str, Any] | None = None) -> str:
    """The layout, and in an A/B which engine ran it (its commit when it ran from an archive)."""
    variant = lay.get("variant", "")
    if not variant:
        return _layout(lay)
    commit = str((res or {}).get(variant) or "")
    return f"{_layout(lay)}, {variant}" + (f" `{commit[:7]}`" if commit else "")


def _ab_lines(res: dict[str, Any]) -> list[str]:
    """Per layout: this tree's shares over the baseline's (same run), and the order they ran in."""
    lays = res.get("layouts") or []
    rows = []
    for t, q in LAYOUTS:
        pair = {lay.get("variant", ""): lay for lay in lays if (lay["topics"], lay["queues"]) == (t, q)}
        if set(pair) != {"baseline", "new"}:
            continue
        b, n = shares(pair["baseline"]), shares(pair["new"])
        first = "baseline" if lays.index(pair["baseline"]) < lays.index(pair["new"]) else "new"
        cells = [f"{n[k] / b[k]:.2f}x" if b[k] > 0 else "–" for k in ("workers", "main", "children", "redis",
                                                                      "workers_redis")]
        rows.append([_layout(pair["new"]), *cells, first])
    if not rows:
        return []
    return ["New over baseline, same run (shares of one core; below 1: cheaper):", "",
            *_table(["layout", "workers", "main processes", "pool children", "Redis", "workers + Redis",
                     "measured first"], rows)]


def markdown(res: dict[str, Any]) -> list[str]:
    out = ["## Idle cost: 2 stock workers + beat over 1,024 idle queues (issue 27)", ""]
    lays = res.get("layouts") or []
    if not lays:
        return out + ["Not measured in this run (`python -m bench.run --only idle`).", ""]
    out += measured_note(res)
    target = res.get("target_share", TARGET_SHARE)
    rows = []
    for lay in lays:
        sh, win = shares(lay), lay["window"]
        s = win["seconds"]
        ok = sh["workers_redis"] <= target
        rows.append([_name(lay, res), _pct(sh["workers"]), f"{_pct(sh['main'])} / {_pct(sh['children'])}",
                     _pct(sh["beat"]), _pct(sh["redis"]),
                     f"**{_pct(sh['workers_redis'])}** ({'met' if ok else '**NOT met**'})",
                     f"{win['reads'] / s:,.1f}", f"{sum(v['calls'] for v in win['commandstats'].values()) / s:,.1f}"])
    out += _table(["layout", "workers CPU (share of one core)", "… main processes / pool children", "beat CPU",
                   "Redis CPU", f"workers + Redis (target ≤ {target * 100:.0f} %)", "Redis round trips/s",
                   "Redis commands/s (with those scripts run)"], rows)
    out += _ab_lines(res)
    out += ["CPU seconds per second are the same figures as shares of one core (1 % = 10 ms of CPU per second). "
            f"Redis per {SLICE_S:.0f} s slice of the window (commands/s, CPU), to show it was steady: "
            + "; ".join(f"{_name(lay, res)}: " + ", ".join(f"{x['commands_per_s']:,.0f}/s {_pct(x['cpu_share'])}"
                                                      for x in lay["window"].get("slices", []))
                        for lay in lays) + ".", ""]
    out += ["Commands per second by what clients sent (the window with the SLOWLOG on; a script's row counts "
            "its call, the commands it runs are in `commandstats` below) and µs of Redis time per second:", ""]
    labels: dict[str, float] = {}
    for lay in lays:
        for lab, (_calls, usec) in lay["slow"]["slowlog"]["top"].items():
            labels[lab] = max(labels.get(lab, 0.0), usec / lay["slow"]["seconds"])
    trows = []
    for lab in sorted(labels, key=lambda x: labels[x], reverse=True)[:30]:
        cells = []
        for lay in lays:
            calls, usec = lay["slow"]["slowlog"]["top"].get(lab, (0, 0))
            s = lay["slow"]["seconds"]
            cells += [f"{calls / s:,.2f}", f"{usec / s:,.0f}"]
        trows.append([pretty(lab), *cells])
    out += _table(["command or script", *(f"{_name(lay, res)}: {u}" for lay in lays for u in ("calls/s", "µs/s"))], trows)
    out += ["`INFO commandstats` of the main window (commands scripts ran included):", ""]
    cmds: dict[str, float] = {}
    for lay in lays:
        for cmd, v in lay["window"]["commandstats"].items():
            cmds[cmd] = max(cmds.get(cmd, 0.0), v["calls"] / lay["window"]["seconds"])
    crow = []
    for cmd in sorted(cmds, key=lambda x: cmds[x], reverse=True)[:25]:
        cells = []
        for lay in lays:
            v, s = lay["window"]["commandstats"].get(cmd, {"calls": 0, "usec": 0}), lay["window"]["seconds"]
            cells += [f"{v['calls'] / s:,.2f}", f"{v['usec'] / s:,.0f}"]
        crow.append([f"`{cmd}`", *cells])
    out += _table(["command", *(f"{_name(lay, res)}: {u}" for lay in lays for u in ("calls/s", "µs/s"))], crow)
    secs = statistics.median(lay["window"]["seconds"] for lay in lays)
    out += [f"Each layout on a redis-server of its own: 2 workers (`celery -A workers.app worker`, prefork "
            f"-c {lays[0]['concurrency']}, stock settings) and `celery -A workers.app beat`, Celery's broker the "
            f"store's Redis. After the workers registered, one message to every queue (each queue's run starts and "
            f"ends once), lag 0, then {lays[0]['warmup_s']:.0f} s more before the window; {secs:.0f} s measured "
            f"with nothing sent, then {res.get('slow_seconds', 0):.0f} s with the SLOWLOG on for the command table. "
            "Worker CPU is each worker's whole process tree (`/proc/<pid>/stat` via psutil, 10 ms ticks); Redis "
            "CPU is `INFO cpu`.", ""]
    return out

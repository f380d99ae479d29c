"""Many consumer groups at a trickle: send-to-handle latency, Celery tasks and CPU per message.

    python -m bench.groups                                   # this tree: 60 groups, 300 msg/s
    python -m bench.groups --spec before=/tmp/tree-before --spec after=. --runs 3   # a same-run A/B

An operator's walk-through (2026-11-29): 60 groups, each consuming a topic of its own with 8
queues (480 queues), at 300 msg/s in all, on two stock ``prefork -c 2`` workers. RocketMQ gives
each group consume threads of its own; a Celery worker's pool slots serve every group, and one
request per worker lingers. When that request watched the idle queues of its own group only,
nearly every message of the other 59 groups cost a wake-up and a Celery task, and those tasks
queued behind each other: p99 send to handle 0.8-6 s, where one group measures milliseconds.

Each configuration (``--spec KEY=ROOT``, a source tree: ``.`` for this one, or a ``git archive``
of another commit) gets its own redis-server and workers, all started up front; their runs are
interleaved (the order rotating from run to run) so a burst of other load falls on all alike.
Per run: one second of warm-up traffic (not recorded), then ``--seconds`` at ``--rate`` msg/s,
each message to the next group's topic in turn (a random key of 2,000), the body its send time;
the bench ``latency`` listener records send to handle. Reported per run: p50/p99/max, Celery
``consume_request`` tasks per message, worker (all processes), Redis and producer CPU per message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    RUNS_DIR,
    Config,
    Workload,
    broker_env,
    celery_broker_url,
    celery_task_totals,
    cpu_s,
    ctl_app,
    log,
    measured_note,
    mq_env,
    queues_of,
    redis_and_client,
    server_pid,
    start_mq_workers,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.latency import WARMUP_S, _summary, _wait_len, paced
from bench.listeners import LAT_KEY, WARMUP_PREFIX, lane_names
from bench.mqorder_drain import CONSUME_TASK
from bench.trickle_cost import parse_spec
from mqorder import Producer

TOPIC, GROUP = "grp", "g-grp"
#: The operator's walk-through: 300 msg/s over all the groups.
RATE = 300.0


@dataclass(frozen=True)
class GroupsShape:
    groups: int = 60
    queues: int = 8
    workers: int = 2
    concurrency: int = 2
    pool: str = "prefork"
    keys: int = 2000


class _GroupsRig:
    """A redis-server, ``groups`` topics and groups, and stock workers of one source tree."""

    def __init__(self, st: contextlib.ExitStack, cfg: Config, key: str, root: str, env_extra: dict[str, str],
                 shape: GroupsShape) -> None:
        self.key = key
        srv, self.r = redis_and_client(st)
        self.p = Producer(srv.url)
        st.callback(self.p.close)
        self.lanes = lane_names(TOPIC, GROUP, shape.groups)
        for topic, _ in self.lanes:
            self.p.create_topic(topic, queues=shape.queues)
        broker = celery_broker_url(st, "redis", srv.url)
        extra = dict(env_extra)
        if root:
            extra["PYTHONPATH"] = root
        env = mq_env(srv.url, topic=TOPIC, group=GROUP, mode="latency", lanes=shape.groups,
                     **broker_env(broker, srv.url), **extra)
        log(f"groups [{key}]: {shape.groups} groups x {shape.queues} queues, starting {shape.workers} worker(s) "
            f"-P {shape.pool} -c {shape.concurrency}" + (f" from {root}" if root else ""))
        self.ws = start_mq_workers(st, srv.url, [f"grp-{key}-w{i}" for i in range(shape.workers)], env,
                                   shape.concurrency, cfg.logdir / "groups", pool=shape.pool,
                                   cwd=Path(root) if root else None)
        self.mqs = {group: queues_of(topic, shape.queues) for topic, group in self.lanes}
        self.wl = Workload(shape.keys)
        self.app = ctl_app(broker)
        st.callback(self.app.close)
        self.hostnames = [w.hostname for w in self.ws]
        self.redis_pid = server_pid(srv)
        self._i = 0

    def _send(self, prefix: bytes) -> None:
        topic = self.lanes[self._i % len(self.lanes)][0]
        self._i += 1
        k, _ = self.wl.next()
        self.p.send_orderly(topic, prefix + str(time.time_ns()).encode(), sharding_key=f"key-{k}")

    def measure(self, n: int, rate: float, warmup: int) -> dict[str, float]:
        r, ws = self.r, self.ws
        r.delete(LAT_KEY)
        if warmup:
            paced(warmup, rate, lambda _: self._send(WARMUP_PREFIX))
        tasks0 = celery_task_totals(self.app, self.hostnames).get(CONSUME_TASK, 0)
        cpu_w0, cpu_r0, cpu_p0 = tree_cpu_s(w.pid for w in ws), cpu_s(self.redis_pid), time.process_time()
        achieved = paced(n, rate, lambda _: self._send(b""))
        cpu_p = time.process_time() - cpu_p0
        for group, mqs in self.mqs.items():
            wait_lag_zero(r, group, mqs, 120, alive=lambda: all(w.alive() for w in ws))
        _wait_len(r, LAT_KEY, n, 60)
        cpu_w, cpu_r = tree_cpu_s(w.pid for w in ws) - cpu_w0, cpu_s(self.redis_pid) - cpu_r0
        tasks = celery_task_totals(self.app, self.hostnames).get(CONSUME_TASK, 0) - tasks0
        res = _summary([int(x) for x in r.lrange(LAT_KEY, 0, -1)], achieved)
        res.update({"tasks_per_msg": tasks / n, "worker_cpu_us_per_msg": cpu_w / n * 1e6,
                    "redis_cpu_us_per_msg": cpu_r / n * 1e6, "producer_cpu_us_per_msg": cpu_p / n * 1e6})
        return res


def run(cfg: Config, specs: list[Any], *, shape: GroupsShape, rate: float, seconds: float,
        runs: int) -> dict[str, Any]:
    """Every spec measured ``runs`` times, interleaved (after one unrecorded run each)."""
    out: dict[str, Any] = {"shape": shape.__dict__, "rate": rate, "seconds": seconds,
                           "specs": {s.key: s.root or "." for s in specs}, "runs": {s.key: [] for s in specs}}
    with contextlib.ExitStack() as st:
        rigs = [_GroupsRig(st, cfg, s.key, s.root, s.env, shape) for s in specs]
        for i in range(-1, runs):
            n = int(rate * (1.0 if i < 0 else seconds))
            k = max(i, 0) % len(rigs)
            for rig in rigs[k:] + rigs[:k]:
                time.sleep(0.5)
                res = rig.measure(n, rate, warmup=int(rate * WARMUP_S) if i >= 0 else 0)
                if i < 0:
                    continue
                res["run"] = i
                log(f"groups [{rig.key}] run {i}: p50 {res['p50_ms']:.2f} ms p99 {res['p99_ms']:.2f} ms "
                    f"max {res['max_ms']:.1f} ms at {res['send_rate']:,.0f} msg/s; {res['tasks_per_msg']:.3f} "
                    f"tasks/msg, worker CPU {res['worker_cpu_us_per_msg']:.0f} µs/msg, Redis CPU "
                    f"{res['redis_cpu_us_per_msg']:.0f} µs/msg")
                out["runs"][rig.key].append(res)
    return out


def summary_lines(res: dict[str, Any]) -> list[str]:
    """A Markdown table: medians (min–max) of each spec's runs."""
    def cell(rows: list[dict[str, float]], name: str, digits: int) -> str:
        xs = [row[name] for row in rows]
        return f"{statistics.median(xs):,.{digits}f} ({min(xs):,.{digits}f}–{max(xs):,.{digits}f})"

    lines = ["| source tree | p50 ms | p99 ms | max ms | Celery tasks per message | worker CPU µs/msg | "
             "Redis CPU µs/msg |", "|---|---|---|---|---|---|---|"]
    for key, rows in res["runs"].items():
        lines.append(f"| {key} (`{res['specs'][key]}`) | {cell(rows, 'p50_ms', 2)} | {cell(rows, 'p99_ms', 1)} | "
                     f"{cell(rows, 'max_ms', 0)} | {cell(rows, 'tasks_per_msg', 3)} | "
                     f"{cell(rows, 'worker_cpu_us_per_msg', 0)} | {cell(rows, 'redis_cpu_us_per_msg', 0)} |")
    return lines


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``groups`` section (``bench.report``), only when it ran."""
    if not res:
        return []
    shape = res["shape"]
    out = ["## Many groups at a trickle", ""]
    out += measured_note(res)
    out += summary_lines(res)
    out += ["", f"{shape['groups']} groups, each consuming a topic of its own with {shape['queues']} queues, "
            f"{res['rate']:,.0f} msg/s in all (each message to the next group's topic, a random key of "
            f"{shape['keys']:,}), {shape['workers']} stock `{shape['pool']} -c {shape['concurrency']}` workers; "
            f"{len(next(iter(res['runs'].values())))} interleaved runs of {res['seconds']:g} s per source tree "
            "after one unrecorded run, one second of warm-up traffic before each; send → handle from the "
            "bench `latency` listener; CPU of every worker process and of redis-server over the run. A worker's "
            "few pool slots serve every group and one request per worker lingers: it watches the idle queues "
            "of every group of its process (`mqorder.consumer.idle_watch`; a send to one rings the worker's "
            "doorbell), where it used to watch its own group's only and nearly every message cost a wake-up "
            "and a Celery task.", ""]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=[], help="KEY=ROOT[:VAR=VAL,...] (default: now=.)")
    ap.add_argument("--groups", type=int, default=60)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--rate", type=float, default=RATE)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    try:
        specs = [parse_spec(s) for s in args.spec or ["now=."]]
    except ValueError as exc:
        ap.error(str(exc))
    if min(args.groups, args.queues, args.runs) < 1 or args.rate <= 0 or args.seconds <= 0:
        ap.error("--groups, --queues, --runs, --rate and --seconds must be positive")
    out_dir = RUNS_DIR / time.strftime("groups-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = GroupsShape(groups=args.groups, queues=args.queues)
    res = run(Config(runs=args.runs, logdir=out_dir), specs, shape=shape, rate=args.rate, seconds=args.seconds,
              runs=args.runs)
    (out_dir / "groups.json").write_text(json.dumps(res, indent=1))
    print("\n".join(summary_lines(res)))
    log(f"written {out_dir / 'groups.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

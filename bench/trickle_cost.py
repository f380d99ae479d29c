"""Where a trickling message's cost goes (issue 27): per message at 1,000 msg/s and in a drain.

The trickle is the latency section's stock configuration (``bench.latency``): 2 stock workers,
prefork ``-c 2``, stock settings (consume batch 1, linger on), a 16-queue topic that exists before
they join, the ``latency`` listener, one ``send_orderly`` at a time on a fixed schedule over 2,000
keys, 1 s of discarded warm-up right before every window. The drain is the throughput section's
no-op drain (``bench.mqorder_drain``): a backlog written with ``send_orderly_batch`` to a topic
nobody reads yet, then opened and dispatched ("kick"), consume batch 32, the clock stopping when
the lag is 0 (the driver's lag poll is counted and taken out of the command counts).

Per message, both: worker CPU (all worker processes, pool children included), Redis CPU, client
round trips and commands (``bench.redis_meter``), and where Redis's time goes, per command and
per script, with the commands each script runs and the Lua around them. Each run measures every
configuration twice: a window without the SLOWLOG (CPU, round trips, ``commandstats``: the
figures) and one with it at threshold 0 (the per-command and per-script breakdown; logging every
command costs Redis CPU itself, shown as its own row).

An A/B: every ``--spec KEY=ROOT[:VAR=VAL,...]`` is a configuration (``bench.ab_latency``'s
spelling): ``ROOT`` the source tree its workers *and* its producer run (``bench.tree_client``, a
process of that tree's own), each on its own redis-server; runs interleaved (the order rotating),
medians reported.

    python -m bench.trickle_cost --spec before=/tmp/tree-HEAD --spec after=. --runs 3
    python -m bench.run --only trickle_cost      # this tree alone, the RESULTS.md section
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench.common import (
    BENCH_DIR,
    ROOT,
    RUNS_DIR,
    Config,
    log,
    mq_env,
    percentile,
    queues_of,
    redis_and_client,
    start_mq_workers,
    total_lag,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import LAT_KEY, lane_names
from bench.redis_meter import METER_NAME, RedisMeter, library_script_names
from mqorder import keys
from mqorder.testing.launcher import project_env

QUEUES = 16
KEYS = 2_000
WORKERS = 2
#: Stock ``celery worker``: -c = the machine's cores (2 here), as the latency section's first row.
CONCURRENCY = 2
WARMUP_S = 1.0
#: After the last paced send, before the window closes: the last messages are handled by then.
SETTLE_S = 0.05
#: The drain's lag poll interval, in seconds.
POLL_S = 0.01
#: The scripts of a trickling message, whose preludes alone are timed (``tree_client`` ``lua_floor``).
HOT_SCRIPTS = ("send", "begin", "commit", "finish", "adopt")
#: Messages of the drain's unmeasured first run.
DRAIN_WARMUP = 5_000
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


@dataclass
class CostSpec:
    """One configuration: a key, the source tree it runs (``""``: this one) and settings for its workers."""

    key: str
    root: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def tree(self) -> Path:
        return Path(self.root) if self.root else ROOT


def parse_spec(text: str) -> CostSpec:
    """``KEY=ROOT[:VAR=VAL,...]`` (``ROOT`` ``.`` for this tree), refused with what to write instead."""
    key, eq, rest = text.partition("=")
    root, _, settings = rest.partition(":")
    if not eq or not _KEY.fullmatch(key):
        raise ValueError(f"--spec {text!r}: write KEY=ROOT[:VAR=VAL,...], KEY a name such as before or after "
                         "(letters, digits, - and _), ROOT a source tree (. for this one)")
    path = ROOT if root in ("", ".") else Path(root).resolve()
    if not (path / "mqorder" / "__init__.py").is_file():
        raise ValueError(f"--spec {text!r}: {path} holds no mqorder package; give a checkout or a `git archive` "
                         "of a commit (e.g. git archive HEAD | tar -x -C /tmp/tree-HEAD)")
    env = {}
    for kv in (s for s in settings.split(",") if s):
        var, eq2, val = kv.partition("=")
        if not eq2 or not var.startswith("MQORDER_"):
            raise ValueError(f"--spec {text!r}: setting {kv!r} is not MQORDER_<NAME>=<value>")
        env[var] = val
    return CostSpec(key, "" if path == ROOT else str(path), env)


#: Runs a script file with the working directory (the tree) first on ``sys.path``, not the script's own
#: directory: ``bench/`` holds modules named like the standard library's (``bench/concurrent.py``).
_RUN_SCRIPT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


class TreeClient:
    """A ``bench.tree_client`` process of one configuration's tree: its producer, kick and script names."""

    def __init__(self, st: contextlib.ExitStack, spec: CostSpec, url: str, logfile: Path) -> None:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        env = project_env(url, PYTHONPATH=str(spec.tree()))
        with open(logfile, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _RUN_SCRIPT, str(BENCH_DIR / "tree_client.py"), url], env=env,
                cwd=spec.tree(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        st.callback(self.close)
        self.logfile = logfile

    def request(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tree client exited ({self.proc.poll()}) on {op}; see {self.logfile}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"tree client {op}: {out['error']}")
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "exit"}\n')
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _names(client: TreeClient) -> dict[str, str]:
    try:
        return {**library_script_names(), **client.request("scripts")["names"]}
    except RuntimeError as exc:  # a tree without mqorder.store.scripts.source: rows keep the SHA1's digits
        log(f"trickle_cost: script names unknown ({exc}); EVALSHA rows show SHA1 prefixes")
        return library_script_names()


class _Rig:
    """A redis-server, the configuration's tree client and meter, and its stock workers."""

    def __init__(self, st: contextlib.ExitStack, cfg: Config, spec: CostSpec, tag: str) -> None:
        self.spec = spec
        self.srv, self.r = redis_and_client(st)
        self.url = self.srv.url
        self.client = TreeClient(st, spec, self.url, cfg.logdir / "trickle_cost" / f"{tag}-{spec.key}-client.log")
        self.meter = RedisMeter(self.url, _names(self.client))
        st.callback(self.meter.close)
        self.logdir = cfg.logdir / "trickle_cost"

    def start_workers(self, st: contextlib.ExitStack, tag: str, env: dict[str, str]) -> None:
        extra = dict(self.spec.env)
        if self.spec.root:
            extra["PYTHONPATH"] = self.spec.root
        log(f"trickle_cost [{self.spec.key}]: {tag}, {WORKERS} workers -P prefork -c {CONCURRENCY}"
            + (f" from {self.spec.root}" if self.spec.root else "") + (f" {self.spec.env}" if self.spec.env else ""))
        self.ws = start_mq_workers(st, self.url, [f"{tag}-{self.spec.key}-w{i}" for i in range(WORKERS)],
                                   {**env, **extra}, CONCURRENCY, self.logdir, cwd=self.spec.tree())

    def alive(self) -> bool:
        return all(w.alive() for w in self.ws)


class TrickleRig(_Rig):
    """The latency section's stock rig: a 16-queue topic created before the workers join."""

    def __init__(self, st: contextlib.ExitStack, cfg: Config, spec: CostSpec) -> None:
        super().__init__(st, cfg, spec, "trickle")
        self.topic, self.group = "lat", "g-lat"
        try:  # on this Redis before anything else runs on it
            self.lua_floor: dict[str, Any] = self.client.request("lua_floor", scripts=HOT_SCRIPTS)
        except RuntimeError as exc:  # a tree whose scripts module has no include_order: not shown
            log(f"trickle_cost [{spec.key}]: Lua floor not measured ({exc})")
            self.lua_floor = {}
        self.client.request("create", topic=self.topic, queues=QUEUES, keys=KEYS)
        self.start_workers(st, "trickle", mq_env(self.url, topic=self.topic, group=self.group, mode="latency"))
        self.mqs = queues_of(self.topic, QUEUES)

    def window(self, n: int, rate: float, *, slowlog: bool) -> dict[str, Any]:
        """``n`` messages at ``rate`` right after 1 s of warm-up; the window's figures."""
        self.r.delete(LAT_KEY)
        self.client.request("paced", topic=self.topic, n=int(rate * WARMUP_S), rate=rate, warmup=True)
        cpu_w0 = tree_cpu_s(w.pid for w in self.ws)
        self.meter.start(slowlog=slowlog)
        sent = self.client.request("paced", topic=self.topic, n=n, rate=rate)
        time.sleep(SETTLE_S)
        win = self.meter.stop()
        win["worker_cpu_s"] = tree_cpu_s(w.pid for w in self.ws) - cpu_w0
        win["lag_at_end"] = total_lag(self.r, self.group, self.mqs)
        wait_lag_zero(self.r, self.group, self.mqs, 60, alive=self.alive)
        deadline = time.monotonic() + 30
        while self.r.llen(LAT_KEY) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.r.llen(LAT_KEY)}/{n} latencies recorded after 30 s")
            time.sleep(0.02)
        ms = [int(x) / 1e6 for x in self.r.lrange(LAT_KEY, 0, -1)]
        win.update({"messages": n, "producer_cpu_s": sent["cpu_s"], "rate": sent["rate"],
                    "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)})
        return win


class DrainRig(_Rig):
    """The throughput section's no-op drain (consume batch 32), one lane (topic) per measured drain."""

    def __init__(self, st: contextlib.ExitStack, cfg: Config, spec: CostSpec, lanes: int) -> None:
        super().__init__(st, cfg, spec, "drain")
        topic, group = f"drain-{spec.key}", f"g-drain-{spec.key}"
        self.lanes = lane_names(topic, group, lanes)
        self.next_lane = 0
        self.start_workers(st, "drain", mq_env(
            self.url, topic=topic, group=group, lanes=lanes, MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE="32",
            MQORDER_PULL_BATCH_SIZE="32", MQORDER_REBALANCE_INTERVAL_MS="3600000"))
        self.poller = redis.Redis.from_url(self.url, client_name=METER_NAME, socket_timeout=30)
        st.callback(self.poller.close)

    def window(self, messages: int, *, slowlog: bool, timeout: float = 600) -> dict[str, Any]:
        """Drain a fresh ``messages``-message backlog; the window runs from the kick to lag 0."""
        t, g = self.lanes[self.next_lane]
        self.next_lane += 1
        self.client.request("create", topic=t, queues=QUEUES, perm="w", keys=KEYS)
        self.client.request("backlog", topic=t, n=messages)
        mqs = queues_of(t, QUEUES)
        time.sleep(0.3)  # the producer's CPU burst settles
        if (lag := total_lag(self.r, g, mqs)) != messages:
            raise RuntimeError(f"drain {t}: lag {lag} before the kick, not {messages}: consumed early")
        cpu_w0 = tree_cpu_s(w.pid for w in self.ws)
        self.meter.start(slowlog=slowlog)
        t0 = time.perf_counter()
        self.client.request("kick", topic=t, broker=self.url)
        polls = 0
        while True:
            polls += 1
            if total_lag(self.poller, g, mqs) == 0:
                break
            if time.perf_counter() - t0 > timeout or not self.alive():
                raise RuntimeError(f"drain {t}: not drained after {time.perf_counter() - t0:.0f}s "
                                   f"(workers alive: {self.alive()})")
            time.sleep(POLL_S)
        secs = time.perf_counter() - t0
        win = self.meter.stop(own_calls={"get": polls * QUEUES, "hget": polls * QUEUES}, own_reads=polls)
        win.update({"worker_cpu_s": tree_cpu_s(w.pid for w in self.ws) - cpu_w0, "messages": messages,
                    "rate": messages / secs, "drain_s": secs})
        pipe = self.r.pipeline(transaction=False)
        for mq in mqs:  # free the lane's log memory
            pipe.unlink(keys.queue_log(mq.tag))
        pipe.execute()
        return win


def _pair(rig: TrickleRig | DrainRig, run: int, measure: Any) -> dict[str, Any]:
    """One run of one configuration: the window without the SLOWLOG and the one with it, the order
    alternating from run to run."""
    out: dict[str, Any] = {"run": run}
    for slowlog in ((False, True) if run % 2 == 0 else (True, False)):
        out["slow" if slowlog else "plain"] = measure(rig, slowlog)
    return out


def _interleaved(rigs: list[Any], runs: int, measure: Any, what: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {r.spec.key: [] for r in rigs}
    for run in range(-1, runs):
        k = max(run, 0) % len(rigs)
        for rig in rigs[k:] + rigs[:k]:
            time.sleep(0.5)  # the previous configuration's lingering requests end their slices
            if run < 0:
                measure(rig, False)  # unmeasured: scripts loaded, first runs dispatched, imports done
                continue
            res = _pair(rig, run, measure)
            p, s = res["plain"], res["slow"]
            n = p["messages"]
            log(f"trickle_cost {what} [{rig.spec.key}] run {run}: {p['rate']:,.0f} msg/s, worker CPU "
                f"{p['worker_cpu_s'] / n * 1e6:.1f} µs/msg, redis CPU {p['cpu_s'] / n * 1e6:.1f} µs/msg "
                f"({s['cpu_s'] / n * 1e6:.1f} with the SLOWLOG), {p['reads'] / n:.2f} reads/msg")
            out[rig.spec.key].append(res)
    return out


def run(cfg: Config, specs: list[CostSpec], *, rate: float = 1000, seconds: float = 5, runs: int = 3,
        drain_messages: int = 200_000) -> dict[str, Any]:
    """The trickle windows of every configuration (interleaved), then their drains (interleaved)."""
    if len({s.key for s in specs}) != len(specs):
        raise ValueError(f"configuration keys must differ: {[s.key for s in specs]}")
    res: dict[str, Any] = {"rate": rate, "seconds": seconds, "runs": runs, "drain_messages": drain_messages,
                           "queues": QUEUES, "keys": KEYS, "workers": WORKERS, "concurrency": CONCURRENCY,
                           "specs": [{"key": s.key, "root": s.root, "env": s.env} for s in specs]}
    n = int(rate * seconds)
    with contextlib.ExitStack() as st:
        rigs = [TrickleRig(st, cfg, s) for s in specs]
        res["trickle"] = _interleaved(rigs, runs, lambda rig, slow: rig.window(n, rate, slowlog=slow), "trickle")
        res["lua_floor"] = {rig.spec.key: rig.lua_floor for rig in rigs}
    with contextlib.ExitStack() as st:
        drigs = [DrainRig(st, cfg, s, lanes=1 + 2 * runs) for s in specs]
        warm = min(DRAIN_WARMUP, drain_messages)
        res["drain"] = _interleaved(
            drigs, runs, lambda rig, slow: rig.window(drain_messages if rig.next_lane else warm, slowlog=slow),
            "drain")
    return res


def main() -> int:
    from bench.trickle_cost_report import markdown

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", default=[], help="KEY=ROOT[:VAR=VAL,...] (default: now=.)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="trickle window, per window")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--drain-messages", type=int, default=200_000)
    args = ap.parse_args()
    try:
        specs = [parse_spec(s) for s in args.spec or ["now=."]]
    except ValueError as exc:
        ap.error(str(exc))
    if args.runs < 1 or args.seconds <= 0 or args.rate <= 0 or args.drain_messages < 1:
        ap.error("--runs, --seconds, --rate and --drain-messages must be positive")
    out_dir = RUNS_DIR / time.strftime("trickle-cost-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    res = run(Config(runs=args.runs, logdir=out_dir), specs, rate=args.rate, seconds=args.seconds, runs=args.runs,
              drain_messages=args.drain_messages)
    (out_dir / "trickle_cost.json").write_text(json.dumps(res, indent=1))
    text = "\n".join(markdown(res))
    (out_dir / "trickle_cost.md").write_text(text)
    print(text)
    log(f"written {out_dir / 'trickle_cost.json'} and trickle_cost.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

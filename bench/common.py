"""Shared plumbing of the benchmark sections: servers, workers, statistics, polling, RSS and CPU.

Every process a section starts is registered on a ``contextlib.ExitStack`` the section owns, so
it is stopped on success, on error and on Ctrl-C alike. Process and machine figures (RSS, CPU
times, load) come from psutil; units are in each function's name or docstring: RSS in MiB
(2**20 bytes), CPU in seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.connect import close, connect
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import WorkerProcess, project_env

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "bench"
#: Worker logs and raw per-run data (git-ignored).
RUNS_DIR = BENCH_DIR / "runs"
HOST = os.uname().nodename


# -- configuration of one invocation ------------------------------------------------------------------


@dataclass
class Config:
    quick: bool = False
    runs: int = 3
    logdir: Path = RUNS_DIR
    #: Filled by the mqorder drain section, read by latency/memory/growth/failover.
    best_concurrency: int | None = None
    notes: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# -- statistics ---------------------------------------------------------------------------------------


@dataclass
class Summary:
    median: float
    lo: float
    hi: float
    n: int
    values: list[float]

    def fmt(self, digits: int = 0, unit: str = "") -> str:
        f = f"{{:,.{digits}f}}"
        u = f" {unit}" if unit else ""
        if self.n == 1:
            return f"{f.format(self.median)}{u} (1 run)"
        return f"{f.format(self.median)}{u} ({f.format(self.lo)}–{f.format(self.hi)}, {self.n} runs)"

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n, "values": self.values}


def measured_note(res: dict[str, Any]) -> list[str]:
    """The line a section measured on its own (``--only``, ``bench.run._measured``) opens its report
    with, or nothing."""
    m = res.get("measured")
    if not m:
        return []
    return [f"Measured {m['date']} at engine commit `{m['commit']}` (1-minute load average {m['load1']} at the "
            "section's end).", ""]


def summarize(values: Iterable[float]) -> Summary:
    v = [float(x) for x in values]
    if not v:
        return Summary(float("nan"), float("nan"), float("nan"), 0, [])
    return Summary(statistics.median(v), min(v), max(v), len(v), v)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of an unsorted sequence."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


# -- processes ------------------------------------------------------------------------------------------


def redis_server(stack: contextlib.ExitStack) -> RedisServer:
    """A fresh ``redis-server`` on a free loopback port, stopped when ``stack`` closes."""
    srv = RedisServer().start()
    stack.callback(srv.stop)
    return srv


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=30)


def redis_and_client(stack: contextlib.ExitStack) -> tuple[RedisServer, redis.Redis]:
    """A fresh ``redis-server`` and a client of it; the client is closed, then the server stopped,
    when ``stack`` closes."""
    srv = redis_server(stack)
    r = client(srv.url)
    stack.callback(r.close)
    return srv, r


def server_pid(srv: RedisServer) -> int:
    """The pid of a started ``redis-server``, to read its CPU and RSS (0, which reads as gone, if none)."""
    return srv.proc.pid if srv.proc else 0


def mq_env(url: str, *, topic: str, group: str, mode: str = "noop", lanes: int = 1, **extra: str) -> dict[str, str]:
    """Environment of a stock mqorder worker running the bench listeners."""
    env = project_env(
        url,
        MQORDER_LISTENERS="bench.listeners",
        BENCH_TOPIC=topic,
        BENCH_GROUP=group,
        BENCH_MODE=mode,
        BENCH_LANES=str(lanes),
    )
    env.update(extra)
    return env


def start_mq_workers(
    stack: contextlib.ExitStack,
    url: str,
    names: Sequence[str],
    env: dict[str, str],
    concurrency: int,
    logdir: Path,
    timeout: float = 90.0,
    settle: float = 2.5,
    pool: str = "prefork",
    cwd: Path | None = None,
) -> list[WorkerProcess]:
    """Start stock workers (``celery -A workers.app worker -P <pool>``) and wait until they registered.

    ``cwd``: the source tree the workers run (default: this one); an A/B of two commits in the
    same run starts one configuration from a copy of the other commit (its ``PYTHONPATH`` too)."""
    logdir.mkdir(parents=True, exist_ok=True)
    ws = []
    for name in names:
        w = WorkerProcess(name, env=env, concurrency=concurrency, pool=pool, logfile=logdir / f"{name}.log",
                          cwd=cwd or ROOT)
        w.start()
        stack.callback(w.stop, 30)
        ws.append(w)
    # Any store URL (plain, Sentinel, Redis Cluster): the workers' registrations are read where they write them.
    c = connect(url, socket_timeout=30)
    try:
        for w in ws:
            w.wait_registered(c, timeout=timeout)
    finally:
        close(c)
    # Every worker reacts to the others' joins at its next heartbeat (a rebalance); let that pass
    # so it cannot happen in the middle of a measurement.
    time.sleep(settle)
    return ws


class CeleryWorker:
    """A plain ``python -m celery -A <app> worker`` subprocess (the Celery baselines)."""

    def __init__(self, app: str, name: str, env: dict[str, str], *, concurrency: int, queues: str,
                 logfile: Path, pool: str = "prefork") -> None:
        self.hostname = f"{name}@{HOST}"
        self.args = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-n", f"{name}@%h", "-P", pool,
            "-c", str(concurrency), "-Q", queues, "--loglevel", "WARNING", "--without-mingle",
            "--without-gossip",
        ]
        self.env = env
        self.logfile = logfile
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryWorker:
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.logfile, "ab")
        try:
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def baseline_env(url: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["BENCH_BROKER_URL"] = url
    env.update(extra)
    return env


def start_celery_workers(stack: contextlib.ExitStack, url: str, app: str, names: Sequence[str], *,
                         concurrency: int, logdir: Path, ctl_name: str) -> tuple[list[CeleryWorker], Any]:
    """Start Celery baseline workers of ``app``, each idle on its own queue ``idle-<name>`` (so nothing
    is consumed until a run tells it to), and a control app; return once every worker answers a ping.
    Everything is stopped or closed when ``stack`` closes."""
    env = baseline_env(url)
    workers = []
    for name in names:
        w = CeleryWorker(app, name, env, concurrency=concurrency, queues=f"idle-{name}", logfile=logdir / f"{name}.log")
        w.start()
        stack.callback(w.stop)
        workers.append(w)
    ctl = ctl_app(url, ctl_name)
    stack.callback(ctl.close)
    wait_celery_ready(ctl, [w.hostname for w in workers])
    return workers, ctl


def wait_celery_ready(app: Any, hostnames: Sequence[str], timeout: float = 90.0) -> None:
    """Block until every named Celery worker answers a ``ping`` control command."""
    deadline = time.monotonic() + timeout
    want = set(hostnames)
    while time.monotonic() < deadline:
        replies = app.control.ping(destination=list(want), timeout=0.5) or []
        for r in replies:
            want -= set(r)
        if not want:
            return
    raise TimeoutError(f"celery workers {sorted(want)} did not answer a ping within {timeout}s")


# -- mqorder helpers ------------------------------------------------------------------------------------


def celery_broker_url(stack: contextlib.ExitStack, kind: str, redis_url: str) -> str:
    """Celery's broker of one bench rig: the rig's own Redis (``redis``), or a RabbitMQ vhost of the
    rig's own (``rabbitmq``), deleted when ``stack`` closes. Call it before starting the rig's
    workers, so the vhost outlives them."""
    if kind == "redis":
        return redis_url
    if kind != "rabbitmq":
        raise ValueError(f"unknown Celery broker {kind!r}; use redis or rabbitmq")
    from mqorder.testing.rabbit_vhost import RabbitVhost

    vhost = RabbitVhost("mqorder-bench")
    stack.callback(vhost.stop)
    return vhost.start().url


def rabbitmq_pid() -> int:
    """The pid of the local RabbitMQ server (Erlang's ``beam.smp``), to read its CPU; 0 if none."""
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "beam.smp":
            return int(p.pid)
    return 0


def broker_env(broker_url: str, redis_url: str) -> dict[str, str]:
    """``MQORDER_CELERY_BROKER_URL`` for the workers when Celery's broker is not the rig's Redis."""
    return {} if broker_url == redis_url else {"MQORDER_CELERY_BROKER_URL": broker_url}


def ctl_app(url: str, name: str = "bench-ctl") -> Any:
    """A fresh Celery app publishing to (and controlling workers on) the broker at ``url``."""
    from celery import Celery

    app = Celery(name, broker=url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json",
                    task_ignore_result=True, broker_connection_retry_on_startup=True)
    return app


def kick(url: str, app: Any, topic: str) -> int:
    """Open ``topic`` for reading, run one rebalance from here and dispatch what it asks for:
    "start consuming now".

    Used after a backlog was written to a write-only topic (``produce_backlog(..., hold=True)``)
    that the running, idle workers subscribe to: nothing of it was assigned yet. Opening it bumps
    the topology version, so each worker rebalances too at its next heartbeat; by then this
    rebalance has assigned and dispatched everything and theirs keeps it as it is.
    """
    from mqorder.celery.dispatch import dispatch
    from mqorder.rebalance.service import RebalanceService
    from mqorder.settings import load_settings
    from mqorder.store.brokers import BrokerRegistry

    brokers = BrokerRegistry(url)
    try:
        svc = RebalanceService(brokers, load_settings(redis_url=url))
        svc.topics.update_perm(topic, "rw")
        report = svc.rebalance()  # also records keys.rebalance_last(), so no worker re-runs it
        for d in report.dispatches or []:
            dispatch(app, d.sub, d.mq.key, d.token, d.client)
        return len(report.dispatches or [])
    finally:
        brokers.close()


def queues_of(topic: str, n: int, broker: str = "broker-a") -> list[MessageQueue]:
    return [MessageQueue(topic, broker, i) for i in range(n)]


def total_lag(r: redis.Redis, group: str, mqs: Sequence[MessageQueue]) -> int:
    """Sum over queues of (next offset - consume offset): ``MessageLog.lag`` in one pipeline."""
    pipe = r.pipeline(transaction=False)
    for mq in mqs:
        pipe.get(keys.queue_next(mq.tag))
        pipe.hget(keys.sub_state(mq.tag, group), "offset")
    res = pipe.execute()
    return sum(int(res[i] or 0) - int(res[i + 1] or 0) for i in range(0, len(res), 2))


def wait_lag_zero(r: redis.Redis, group: str, mqs: Sequence[MessageQueue], timeout: float,
                  interval: float = 0.01, on_poll: Callable[[], None] | None = None,
                  alive: Callable[[], bool] | None = None) -> float:
    """Poll until the group's total lag is 0; returns ``time.perf_counter()`` at that moment."""
    deadline = time.monotonic() + timeout
    while True:
        if total_lag(r, group, mqs) == 0:
            return time.perf_counter()
        if on_poll is not None:
            on_poll()
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group}: lag still {total_lag(r, group, mqs)} after {timeout}s")
        if alive is not None and not alive():
            raise RuntimeError(f"a worker died while group {group} was draining")
        time.sleep(interval)


class Workload:
    """Messages over ``n_keys`` keys: each message picks a key at random (seeded, the same in every
    run and every system), and carries that key's next sequence number (1, 2, 3...)."""

    def __init__(self, n_keys: int, seed: int = 42) -> None:
        self.n_keys = n_keys
        self.rng = random.Random(seed)
        self.seq = [0] * n_keys

    def next(self) -> tuple[int, int]:
        k = self.rng.randrange(self.n_keys)
        self.seq[k] += 1
        return k, self.seq[k]

    def items(self, n: int) -> list[tuple[str, bytes]]:
        """``n`` (sharding key, body) pairs for ``send_orderly_batch``."""
        out = []
        for _ in range(n):
            k, s = self.next()
            out.append((f"key-{k}", b'{"k":%d,"s":%d}' % (k, s)))
        return out


def produce_backlog(url: str, topic: str, queues: int, n: int, n_keys: int, chunk: int = 10_000, *,
                    hold: bool = False) -> float:
    """Create ``topic`` and write ``n`` messages with ``send_orderly_batch``; returns seconds taken.

    ``hold``: create it write-only (RocketMQ's topic permission), so running workers that subscribe
    to it take none of it until ``kick`` opens it: the engine rebalances at once on a new topic.
    """
    from mqorder import Producer

    p = Producer(url)
    w = Workload(n_keys)
    try:
        p.create_topic(topic, queues=queues, perm="w" if hold else "rw")
        t0 = time.perf_counter()
        for c in range(0, n, chunk):
            p.send_orderly_batch(topic, w.items(min(chunk, n - c)))
        return time.perf_counter() - t0
    finally:
        p.close()


def commandstats(r: redis.Redis) -> dict[str, dict[str, int]]:
    """Per command: calls and total µs Redis spent in it (commands inside scripts included)."""
    return {k.removeprefix("cmdstat_"): {"calls": int(v["calls"]), "usec": int(v["usec"])}
            for k, v in r.info("commandstats").items()}


def celery_task_totals(app: Any, hostnames: Sequence[str]) -> dict[str, int]:
    """Tasks executed per name, summed over the given workers (``inspect stats`` → ``total``)."""
    out: dict[str, int] = {}
    try:
        stats = app.control.inspect(destination=list(hostnames), timeout=2.0).stats() or {}
    except Exception as exc:  # noqa: BLE001 - a statistic, not a result
        log(f"inspect stats failed: {exc}")
        return out
    for s in stats.values():
        for name, n in (s.get("total") or {}).items():
            out[name] = out.get(name, 0) + int(n)
    return out


# -- memory and CPU of processes, load of the machine (psutil) --------------------------------------

MIB = 1024 * 1024


def _family(pids: Iterable[int]) -> list[psutil.Process]:
    """The given processes and all their live descendants, each once; a process already gone is left out."""
    out: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            for q in (p, *p.children(recursive=True)):
                out.setdefault(q.pid, q)
    return list(out.values())


def _rss_bytes(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:  # exited since it was listed
        return 0


def rss_mib(pid: int) -> float:
    """Resident set size of one process in MiB (the kernel's ``VmRSS``), 0 if it is gone."""
    try:
        return _rss_bytes(psutil.Process(pid)) / MIB
    except psutil.Error:
        return 0.0


def tree_rss_mib(pid: int) -> tuple[float, int]:
    """(summed RSS in MiB of ``pid`` and all its descendants, number of processes).

    Pages shared after fork count once per process that maps them: an upper bound on real use."""
    procs = _family([pid])
    return sum(_rss_bytes(p) for p in procs) / MIB, len(procs)


def _cpu_s(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
    except psutil.Error:  # exited since it was listed
        return 0.0
    return t.user + t.system


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (its reaped children not included), 0 if it is gone."""
    try:
        return _cpu_s(psutil.Process(pid))
    except psutil.Error:
        return 0.0


def tree_cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of the given processes and all their live descendants."""
    return sum(_cpu_s(p) for p in _family(pids))


def machine_cpu() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, steal seconds), all cores summed, since boot.

    Busy is user + nice + system + irq + softirq: idle and iowait are not busy, and steal (time a
    hypervisor gave to another guest) is returned apart."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq, t.steal


def own_cpu() -> float:
    """CPU seconds of this process and of every child it has reaped (their descendants included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def load1() -> float:
    """The machine's 1-minute load average (NaN if the system does not say)."""
    try:
        return psutil.getloadavg()[0]
    except OSError:
        return float("nan")


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages as ``/proc/loadavg`` prints them ("0.52 0.48 0.40"), or "?"."""
    try:
        return " ".join(f"{x:.2f}" for x in psutil.getloadavg())
    except OSError:
        return "?"


ENGINE_DIRS = ("mqorder", "workers", "config", "tasks")


def engine_changes(since: float, until: float | None = None) -> list[tuple[str, float]]:
    """Engine source files (``.py``/``.lua`` under mqorder, workers, config, tasks) whose mtime lies in
    [since, until]: the code measured may have changed while the benchmark ran."""
    out = []
    for d in ENGINE_DIRS:
        for f in (ROOT / d).rglob("*"):
            if f.suffix in (".py", ".lua") and "__pycache__" not in f.parts:
                m = f.stat().st_mtime
                if m >= since and (until is None or m <= until):
                    out.append((str(f.relative_to(ROOT)), m))
    return sorted(out, key=lambda x: x[1])


# -- machine facts ----------------------------------------------------------------------------------


def machine_facts() -> dict[str, str]:
    def _run(args: list[str]) -> str:
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = f"{psutil.virtual_memory().total / 1024 ** 3:.1f} GiB"
    from importlib.metadata import version

    def _v(pkg: str) -> str:
        try:
            return version(pkg)
        except Exception:  # noqa: BLE001
            return "?"

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": _run(["nproc"]),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "redis-server": _run(["redis-server", "--version"]),
        "packages": ", ".join(f"{p} {_v(p)}" for p in ("celery", "kombu", "redis", "hiredis")),
        "loadavg at start": loadavg(),
    }


def dump_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))

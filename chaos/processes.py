"""Processes: every subprocess of a scenario, started, signalled and always stopped here.

Two ``redis-server`` processes run per scenario: the one under test (AOF on, ``appendfsync``
``always`` or ``everysec``; it is also the Celery broker) and a ledger Redis that the listeners
write to and no fault touches. In the ``sentinel-*`` scenarios the Redis under test is a Sentinel
deployment instead (``chaos.topology``: a primary, two replicas, three Sentinels), reached by every
process through its ``redis+sentinel://`` URL; in the ``cluster-*`` scenarios it is a Redis Cluster
(``chaos.cluster_topology``) reached through its ``redis+cluster://`` URL, and Celery's broker is
the ledger's Redis (database ``BROKER_DB``), since Celery cannot use a cluster. Workers and beats
are real ``celery`` subprocesses in their own process groups, so a fault can stop or kill a
worker's prefork pool with it.

A worker that exits while this class did not take it down (``expected_down``) has *crashed*:
:meth:`Processes.newly_crashed` reports it once, and the checker fails the scenario for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import redis

from chaos.cluster_topology import BROKER_DB, ClusterRedis, ClusterSpec
from chaos.evidence import log
from chaos.listeners import ROLE_ENV
from chaos.topology import SentinelRedis, SentinelSpec
from mqorder.store.connect import connect
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import BeatProcess, WorkerProcess, project_env

ROOT = Path(__file__).resolve().parent.parent


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the prefork pool processes of a worker), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return sorted(out)


class Processes:
    """The Redis under test, the ledger Redis, the workers and the beats of one scenario."""

    def __init__(self, name: str, *, fsync: str, env: dict[str, str], concurrency: int,
                 sentinel: SentinelSpec | None = None, cluster: ClusterSpec | None = None) -> None:
        if sentinel is not None and cluster is not None:
            raise ValueError(f"scenario {name}: a Sentinel deployment or a Redis Cluster, not both")
        self.name = name
        self.fsync = fsync
        self.env_extra = dict(env)
        self.concurrency = concurrency
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mqorder-chaos-{name}-"))
        self.redis = RedisServer(appendonly=True, appendfsync=fsync, workdir=str(self.tmp / "redis"))
        #: The Sentinel deployment under test (``sentinel-*`` scenarios), else None: ``redis`` is.
        self.sentinel = SentinelRedis(sentinel, fsync=fsync) if sentinel is not None else None
        #: The Redis Cluster under test (``cluster-*`` scenarios), else None.
        self.cluster = ClusterRedis(cluster, fsync=fsync) if cluster is not None else None
        self.ledger_redis = RedisServer(workdir=str(self.tmp / "ledger"))
        self.workers: dict[str, WorkerProcess] = {}
        self.beats: list[BeatProcess] = []
        #: Workers this class killed or stopped; any other worker that exits has crashed.
        self.expected_down: set[str] = set()
        self._worker_seq = 0
        self._bg: list[threading.Thread] = []
        self._meta: redis.Redis | None = None

    # -- the two Redis servers ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The store URL every process is given: the Sentinels' (``redis+sentinel://``), the
        cluster's (``redis+cluster://``) or the one Redis's."""
        if self.sentinel is not None:
            return self.sentinel.url
        return self.cluster.url if self.cluster is not None else self.redis.url

    @property
    def ledger_url(self) -> str:
        return self.ledger_redis.url

    def start_servers(self) -> None:
        (self.tmp / "redis").mkdir()
        (self.tmp / "ledger").mkdir()
        if self.sentinel is not None:
            self.sentinel.start()
        elif self.cluster is not None:
            self.cluster.start()
        else:
            self.redis.start()
        self.ledger_redis.start()
        if self.cluster is not None:  # known once the ledger Redis holds its port
            self.env_extra["MQORDER_CELERY_BROKER_URL"] = self.ledger_url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
        self._meta = connect(self.url)

    def kill_redis(self) -> None:
        """SIGKILL of the Redis under test (its AOF stays on disk for :meth:`start_redis`)."""
        if self.sentinel is not None or self.cluster is not None:
            raise RuntimeError(f"scenario {self.name} kills a node of its deployment (Faults.kill_primary, "
                               "ClusterFaults.kill_master), not one Redis")
        self.redis.kill()

    def start_redis(self, timeout: float = 60.0) -> None:
        self.redis.start(timeout=timeout)

    # -- workers and beats ----------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        return project_env(self.url, MQORDER_LISTENERS="chaos.listeners", CHAOS_LEDGER_URL=self.ledger_url,
                           **self.env_extra, **extra)

    def new_worker_name(self) -> str:
        self._worker_seq += 1
        return f"w{self._worker_seq}"

    def start_worker(self, name: str, *, wait: bool = True) -> WorkerProcess:
        """Start (or restart, under the same name and log) a worker; ``wait`` for its registration."""
        w = self.workers.get(name)
        if w is None:
            w = WorkerProcess(name, env=self.env(), concurrency=self.concurrency, cwd=ROOT,
                              logfile=self.tmp / f"{name}.log")
            self.workers[name] = w
        w.start()
        self.expected_down.discard(name)
        if wait:
            self.wait_registered(w)
        return w

    def wait_registered(self, w: WorkerProcess, timeout: float = 90.0) -> None:
        assert self._meta is not None, "start_servers() first"
        w.wait_registered(self._meta, timeout=timeout)

    def start_beat(self) -> BeatProcess:
        """A beat named ``beat<n>`` (n: how many beats this scenario started before it)."""
        i = len(self.beats)
        b = BeatProcess(env=self.env(**{ROLE_ENV: f"beat{i}"}), workdir=self.tmp / f"beat{i}",
                        logfile=self.tmp / f"beat{i}.log", cwd=ROOT, loglevel="INFO")
        b.start()
        self.beats.append(b)
        return b

    @property
    def beat_roles(self) -> list[str]:
        return [f"beat{i}" for i in range(len(self.beats))]

    def alive_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive()]

    def kill_worker(self, w: WorkerProcess) -> None:
        self.expected_down.add(w.name)
        w.kill()

    def stop_worker_soon(self, w: WorkerProcess) -> None:
        """Warm shutdown (SIGTERM) in the background, so a scenario keeps its cadence."""
        self.expected_down.add(w.name)
        t = threading.Thread(target=w.stop, kwargs={"timeout": 60}, daemon=True)
        t.start()
        self._bg.append(t)

    def newly_crashed(self) -> list[WorkerProcess]:
        """Workers that exited without being killed or stopped here (each reported once)."""
        out = []
        for w in list(self.workers.values()):
            if w.proc is not None and w.name not in self.expected_down and w.proc.poll() is not None:
                self.expected_down.add(w.name)
                out.append(w)
        return out

    # -- teardown -------------------------------------------------------------------------------

    def stop_celery(self) -> None:
        """Stop every worker (warm, then SIGKILL of its group) and every beat; the servers stay up."""
        self.expected_down.update(self.workers)
        stoppers = []
        for w in self.workers.values():
            if w.alive():
                w.signal(signal.SIGCONT)  # a paused worker cannot handle SIGTERM
                t = threading.Thread(target=w.stop, kwargs={"timeout": 20}, daemon=True)
                t.start()
                stoppers.append(t)
        for t in stoppers + self._bg:
            t.join(65)
        for w in self.workers.values():
            if w.proc is not None:
                try:
                    os.killpg(w.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for b in self.beats:
            b.stop()

    def stop_servers(self) -> None:
        if self._meta is not None:
            self._meta.close()
        if self.sentinel is not None:
            self.sentinel.stop(keep=self.tmp / "sentinel")
        if self.cluster is not None:
            self.cluster.stop(keep=self.tmp / "cluster")
        for srv in (self.redis, self.ledger_redis):
            try:
                srv.stop()
            except OSError:
                pass

    def remove_files(self, keep_logs: bool) -> None:
        if keep_logs:
            log(f"{self.name}: logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

"""Spark beyond ``local[N]`` for the tests: a standalone cluster, a Spark Connect server, and drivers
in processes of their own.

Everything is started from the installed pyspark (``SPARK_HOME`` is its package directory, which
ships ``bin/spark-class``, ``bin/spark-submit``, ``bin/spark-pipelines`` and the Connect server's
jar), on free loopback ports, and stopped at the end of the run:

- ``StandaloneCluster``: one master and two workers (``spark-class ...deploy.master.Master`` /
  ``...deploy.worker.Worker``). Every application gets one executor of 1 core and 512 MiB on each
  worker (``spark-defaults.conf`` in ``conf_dir``); a worker offers 2 such slots, so the tests'
  driver and a ``mqorder pipeline --master spark://...`` run side by side. The cluster's
  environment has no ``MQORDER_*`` variable: executors reach Redis only through what the job
  carries (the options, or the connection the data source resolved where the driver planned it).
- ``ConnectServer``: ``spark-submit --class ...SparkConnectServer`` (what
  ``sbin/start-connect-server.sh`` runs, in the foreground so the fixture owns its process); also
  without ``MQORDER_*``: a Connect client passes ``redisUrl``.
- ``SparkDriver``: a driver process (``tests.spark_driver``) running jobs of ``tests.spark_jobs``
  on request. A driver of its own, not this process: a process holds one SparkContext (the run's
  ``local[2,3]`` session may already be here), and a Spark Connect client marks its whole process
  as Connect (``SPARK_CONNECT_MODE_ENABLED``), which would turn the local session's functions into
  Connect ones for every later test of this worker.

The fixtures are session-scoped, started on first use: one cluster, one Connect server and one
driver of each kind per test process that needs them. ``make test`` runs every test that needs them
on one pytest-xdist worker (``tests/xdist_schedule.py``), so a run starts one of each.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from mqorder.testing.embedded import RedisServer, free_port
from tests.support import xdist_worker

ROOT = Path(__file__).resolve().parent.parent
#: Generous: JVMs start in ~10 s on a quiet 2-core machine, several times that under load.
START_TIMEOUT_S = 300.0
#: What the standalone cluster's workers offer (the issue: two workers of one core each).
WORKERS, WORKER_CORES, WORKER_MEMORY = 2, 2, "1g"
#: What every application of the cluster gets (its ``spark-defaults.conf``): one 1-core executor
#: per worker, and no job before both executors registered.
APP_DEFAULTS = {
    "spark.executor.cores": "1",
    "spark.cores.max": str(WORKERS),
    "spark.executor.memory": "512m",
    "spark.driver.memory": "768m",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "300s",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.session.timeZone": "UTC",
}


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def spark_env(**extra: str) -> dict[str, str]:
    """This environment for a Spark process: no ``MQORDER_*`` (nothing may rely on it but what a
    test passes), no Connect markers, this virtualenv's Python for every Python worker."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MQORDER_", "SPARK_", "PYSPARK_", "PYTEST_")) and k != "PYTHONPATH"}
    env.update(SPARK_HOME=str(spark_home()), PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1")
    env.update(extra)
    return env


class _Process:
    """A JVM (and its children) in a process group of its own, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: Mapping[str, str], log: Path, cwd: Path) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; its log {self.log} ends with:\n"
                               + tail(self.log))

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the group (a worker passes it on to its executors), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group (executors)
        except ProcessLookupError:
            pass
        self.proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until(check, what: str, procs: list[_Process], timeout: float = START_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.check_alive()
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s; logs: " + ", ".join(str(p.log) for p in procs))
        time.sleep(0.5)


class StandaloneCluster:
    """A Spark standalone cluster on loopback: ``master_url`` is ``spark://127.0.0.1:<port>``."""

    def __init__(self, workdir: Path, workers: int = WORKERS) -> None:
        self.workdir = workdir
        self.n_workers = workers
        self.port, self.ui_port = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[_Process] = []
        #: ``SPARK_CONF_DIR`` of the applications: ``spark-defaults.conf`` with ``APP_DEFAULTS``.
        self.conf_dir = workdir / "conf"

    def _state(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def alive_workers(self) -> int:
        state = self._state() or {}
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def start(self) -> StandaloneCluster:
        home = spark_home()
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "spark-defaults.conf").write_text(
            "".join(f"{k} {v}\n" for k, v in {**APP_DEFAULTS, "spark.local.dir": str(self.workdir / "local")}.items()))
        # No REST submission server: its port is fixed (6066) and two xdist workers would collide.
        env = spark_env(SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
        self.procs.append(_Process("spark master", [
            str(home / "bin/spark-class"), "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port)],
            env, self.workdir / "master.log", self.workdir))
        # The workers start with the master, not after it (a JVM start saved): a worker retries
        # registering until the master answers.
        for i in range(self.n_workers):
            wdir = self.workdir / f"worker{i}"
            wdir.mkdir(parents=True, exist_ok=True)
            self.procs.append(_Process(f"spark worker {i}", [
                str(home / "bin/spark-class"), "org.apache.spark.deploy.worker.Worker",
                "--host", "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", str(WORKER_CORES),
                "--memory", WORKER_MEMORY, "--work-dir", str(wdir), self.master_url],
                spark_env(SPARK_LOCAL_DIRS=str(wdir / "local")), self.workdir / f"worker{i}.log", self.workdir))
        wait_until(lambda: self.alive_workers() == self.n_workers, f"{self.n_workers} Spark workers", self.procs)
        return self

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first: they stop their executors
            p.stop()


class ConnectServer:
    """A Spark Connect server (``sc://127.0.0.1:<port>``) running on ``master``."""

    def __init__(self, workdir: Path, master: str = "local[2]") -> None:
        self.workdir = workdir
        self.master = master
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.proc: _Process | None = None

    def _listening(self) -> bool:
        assert self.proc is not None
        if "Spark Connect server started" not in self.proc.log.read_text(errors="replace"):
            return False
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def start(self) -> ConnectServer:
        home = spark_home()
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.memory": "1g",
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "2",
            "spark.sql.session.timeZone": "UTC",
            "spark.local.dir": str(self.workdir / "local"),
            "spark.sql.warehouse.dir": str(self.workdir / "warehouse"),
            "spark.sql.streaming.stopTimeout": "30s",
        }
        cmd = [str(home / "bin/spark-submit"), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
               "--master", self.master, "--name", f"mqorder-connect-{xdist_worker()}"]
        for k, v in conf.items():
            cmd += ["--conf", f"{k}={v}"]
        self.proc = _Process("spark connect server", cmd, spark_env(), self.workdir / "connect.log", self.workdir)
        wait_until(self._listening, "the Spark Connect server", [self.proc])
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class DriverError(Exception):
    """A job of a driver process raised: ``kind`` is the exception's class, ``mqorder`` the
    mqorder error it carried (``mqorder.spark.errors``), as ``(class name, message)``."""

    def __init__(self, kind: str, message: str, mqorder: list[str] | None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message
        self.mqorder = tuple(mqorder) if mqorder else None


class SparkDriver:
    """A Spark driver process (``python -m tests.spark_driver``): ``call(job, **kwargs)`` runs
    ``tests.spark_jobs.<job>(spark, **kwargs)`` there and returns its JSON result."""

    def __init__(self, log: Path, *, master: str | None = None, remote: str | None = None,
                 env: Mapping[str, str] | None = None, conf: Mapping[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "tests.spark_driver"]
        cmd += ["--master", master] if master else ["--remote", str(remote)]
        for k, v in (conf or {}).items():
            cmd += ["--conf", f"{k}={v}"]
        self.log = log
        self._err = log.open("ab")
        base = spark_env(PYTHONPATH=str(ROOT), PYTEST_XDIST_WORKER=xdist_worker())  # names its application
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**base, **(env or {})},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     start_new_session=True)
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="spark-driver-replies", daemon=True).start()
        self._reply(START_TIMEOUT_S, "the driver's session")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def _reply(self, timeout: float, what: str) -> Any:
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{what}: no answer from the driver within {timeout:.0f} s; log {self.log}:\n"
                               + tail(self.log)) from None
        if line is None:
            raise RuntimeError(f"{what}: the driver exited ({self.proc.poll()}); log {self.log}:\n" + tail(self.log))
        reply = json.loads(line)
        if "error" in reply:
            raise DriverError(reply["error"], reply["message"], reply.get("mqorder"))
        return reply.get("ok")

    def call(self, job: str, timeout: float = START_TIMEOUT_S, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"job": job, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout, f"job {job}")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # the driver stops its session and exits
            except OSError:
                pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._err.close()


def _java_or_fail() -> None:
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.fail("Spark needs Java 17+: run `make test` (it installs openjdk-17-jre-headless)")


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    _java_or_fail()
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster_driver(standalone_cluster: StandaloneCluster, redis_server: RedisServer,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkDriver]:
    """A classic driver on the cluster. Its own environment names Redis (``MQORDER_REDIS_URL``,
    as the docs say): the executors get the connection from the planned job, never from theirs."""
    work = tmp_path_factory.mktemp("spark-cluster-driver")
    driver = SparkDriver(work / "driver.log", master=standalone_cluster.master_url,
                         env={"MQORDER_REDIS_URL": redis_server.url, "SPARK_CONF_DIR": str(standalone_cluster.conf_dir)},
                         conf={"spark.sql.warehouse.dir": str(work / "warehouse")})
    yield driver
    driver.stop()


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    _java_or_fail()
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def connect_driver(connect_server: ConnectServer, redis_server: RedisServer,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkDriver]:
    """A Spark Connect client process; the jobs pass ``redisUrl`` (the server has no MQORDER_*)."""
    work = tmp_path_factory.mktemp("spark-connect-client")
    driver = SparkDriver(work / "client.log", remote=connect_server.url, env={"MQORDER_REDIS_URL": redis_server.url})
    yield driver
    driver.stop()

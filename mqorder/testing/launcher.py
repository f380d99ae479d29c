"""Starting and stopping real ``celery worker`` / ``celery beat`` processes.

Used by the demo, the tests, the chaos runner and the benchmarks: every one of them drives real
Celery subprocesses (prefork by default), never an eager or in-thread imitation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from mqorder import keys


def _celery() -> list[str]:
    return [sys.executable, "-m", "celery"]


class WorkerProcess:
    """One ``celery -A <app> worker -n <name>@%h`` subprocess."""

    def __init__(
        self,
        name: str,
        *,
        env: dict[str, str],
        app: str = "workers.app",
        concurrency: int = 2,
        pool: str = "prefork",
        loglevel: str = "WARNING",
        logfile: str | Path | None = None,
        cwd: str | Path | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.name = name
        self.hostname = f"{name}@{os.uname().nodename}"
        self.env = env
        self.app = app
        self.concurrency = concurrency
        self.pool = pool
        self.loglevel = loglevel
        self.logfile = Path(logfile) if logfile else None
        self.cwd = cwd
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        args = [
            *_celery(), "-A", self.app, "worker", "-n", f"{self.name}@%h", "-P", self.pool,
            "-c", str(self.concurrency), "--loglevel", self.loglevel, "--without-mingle",
            "--without-gossip", *self.extra_args,
        ]
        out = open(self.logfile, "ab") if self.logfile else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            args, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        """The exit status once the process ended (None while it runs or before it started)."""
        return None if self.proc is None else self.proc.returncode

    def wait_registered(self, client: redis.Redis, timeout: float = 30.0) -> None:
        """Block until the worker's consumer client has registered its heartbeat."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.zscore(keys.clients(), self.hostname) is not None:
                return
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited with {self.returncode()}; see {self.logfile}")
            time.sleep(0.05)
        raise TimeoutError(f"worker {self.name} did not register within {timeout}s; see {self.logfile}")

    def signal(self, sig: int, *, group: bool = True) -> None:
        """Signal the worker (and, by default, its whole process group: the pool children too)."""
        if not self.alive():
            return
        if group:
            os.killpg(self.pid, sig)
        else:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """``kill -9`` of the worker and its pool: a crash, no clean leave."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 60.0) -> None:
        """Warm shutdown (SIGTERM to the main process), then SIGKILL if it takes too long."""
        if not self.alive():
            return
        assert self.proc is not None
        self.signal(signal.SIGTERM, group=False)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        try:
            os.killpg(self.pid, signal.SIGKILL)  # stray pool children
        except (ProcessLookupError, PermissionError):
            pass


class BeatProcess:
    def __init__(
        self, *, env: dict[str, str], workdir: str | Path, app: str = "workers.app", loglevel: str = "WARNING",
        logfile: str | Path | None = None, cwd: str | Path | None = None,
    ) -> None:
        self.env = env
        self.app = app
        self.workdir = Path(workdir)
        self.loglevel = loglevel
        self.logfile = Path(logfile) if logfile else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> BeatProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            *_celery(), "-A", self.app, "beat", "-s", str(self.workdir / "celerybeat-schedule"),
            "--pidfile", "", "--loglevel", self.loglevel,
        ]
        out = open(self.logfile, "ab") if self.logfile else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            args, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def project_env(redis_url: str, **extra: str) -> dict[str, str]:
    """The environment for worker subprocesses: this interpreter's path plus mqorder settings."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # mqorder/testing/launcher.py -> the checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["MQORDER_REDIS_URL"] = redis_url
    env.pop("MQORDER_CELERY_BROKER_URL", None)
    env.update(extra)
    return env

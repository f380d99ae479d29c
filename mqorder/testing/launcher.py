"""Starting and stopping real ``celery worker`` / ``celery beat`` processes.

Used by the demo, the tests, the chaos runner and the benchmarks: every one of them drives real
Celery subprocesses (prefork by default), never an eager or in-thread imitation.

``app`` is the Celery app the processes load (``celery -A <app>``). Its default, ``workers.app``,
exists only in mqorder's own checkout; an application's tests pass ``app="mqorder.app"`` (the
stock app of an installed mqorder, reading ``MQORDER_LISTENERS``) or their own app.

Each process runs in a session of its own (so a test can signal a worker's whole process group,
pool children included) and, when started from the main thread on Linux, is killed (SIGKILL) when
the process that started it dies (``mqorder.testing.lifetime``): a test run killed with its
process group does not leave workers behind retrying a Redis that is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import redis

from mqorder import keys
from mqorder.testing.lifetime import die_with_parent

#: How much of a process's output an error quotes (the end of it, where the reason is).
TAIL_BYTES = 4000


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
        #: The output kept when no ``logfile`` is given (a deleted temporary file), so an error can
        #: quote why the worker stopped: it used to go to /dev/null and errors said "see None".
        self._output: IO[bytes] | None = None

    def start(self) -> WorkerProcess:
        args = [
            *_celery(), "-A", self.app, "worker", "-n", f"{self.name}@%h", "-P", self.pool,
            "-c", str(self.concurrency), "--loglevel", self.loglevel, "--without-mingle",
            "--without-gossip", *self.extra_args,
        ]
        if self.logfile:
            out: IO[bytes] = open(self.logfile, "ab")
        else:
            if self._output is None:
                self._output = tempfile.TemporaryFile(prefix=f"mqorder-worker-{self.name}-")
            out = self._output
        try:
            self.proc = subprocess.Popen(
                args, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            if out is not self._output:
                out.close()  # the child holds its own copy
        return self

    def output_tail(self, limit: int = TAIL_BYTES) -> str:
        """The last ``limit`` bytes of the worker's output (its logfile, or the kept output)."""
        try:
            if self.logfile is not None:
                with open(self.logfile, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
                    data = f.read()
            elif self._output is not None:
                fd = self._output.fileno()
                size = os.fstat(fd).st_size
                data = os.pread(fd, limit, max(0, size - limit))  # pread: the worker's offset stays
            else:
                return ""
        except OSError:
            return ""
        return data.decode(errors="replace")

    def _where(self) -> str:
        tail = self.output_tail().rstrip()
        where = f"; see {self.logfile}" if self.logfile else ""
        return f"{where}; its last output:\n{tail}" if tail else f"{where} (it wrote nothing)"

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
                raise RuntimeError(f"worker {self.name} exited with {self.returncode()}{self._where()}")
            time.sleep(0.05)
        raise TimeoutError(f"worker {self.name} did not register within {timeout}s{self._where()}")

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
    """One ``celery -A <app> beat`` subprocess (one per deployment: it sends rebalance and lock_all)."""

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
        out: IO[bytes] | int = open(self.logfile, "ab") if self.logfile else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                args, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            if not isinstance(out, int):
                out.close()
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

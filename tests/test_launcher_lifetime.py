"""The harness's processes do not outlive a killed test run, and a worker that will not start says
why (``mqorder.testing.launcher``, ``mqorder.testing.lifetime``).

A run killed with its process group (CI cancel, ``timeout``) used to leave ``celery worker`` and
its pool children orphaned (they run in a session of their own), retrying a dead Redis for minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from mqorder.testing.launcher import WorkerProcess, project_env
from mqorder.testing.lifetime import die_with_parent
from tests.support import ROOT

#: A test run in miniature: a redis-server, a registered prefork worker, then waiting to be killed.
RUN = textwrap.dedent("""
    import json, sys, time
    import psutil, redis
    from mqorder.testing.embedded import RedisServer
    from mqorder.testing.launcher import WorkerProcess, project_env

    srv = RedisServer().start()
    w = WorkerProcess("orphan", env=project_env(srv.url, MQORDER_LISTENERS="tests.listeners"), cwd=sys.argv[1],
                      concurrency=2).start()
    w.wait_registered(redis.Redis.from_url(srv.url), timeout=60)
    kids = [c.pid for c in psutil.Process(w.pid).children(recursive=True)]
    print(json.dumps({"redis": srv.proc.pid, "worker": w.pid, "pool": kids}), flush=True)
    time.sleep(600)
""")


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_worker_and_redis_end_when_the_run_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(ROOT)], stdout=subprocess.PIPE, env=env,
                            start_new_session=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the run exited with {proc.wait(5)} before its worker registered"
        started = json.loads(line)
        pids = [started["redis"], started["worker"], *started["pool"]]
        assert len(started["pool"]) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # what CI's cancel or `timeout -s KILL` does to the run
        proc.wait(10)
        left = _gone(pids, timeout=20)
        assert not left, f"still running after the run was killed: {[psutil.Process(p).cmdline() for p in left]}"
    finally:
        for pid in pids:  # never leave them behind, whatever the outcome
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_no_death_signal_is_promised_from_another_thread() -> None:
    """The kernel's "parent" is the forking thread: a child started from a thread that ends would be
    signalled then, mid-test. Only the main thread gets the hook."""
    assert die_with_parent() is not None or not sys.platform.startswith("linux")
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(die_with_parent()))
    t.start()
    t.join()
    assert seen == [None]


@pytest.mark.e2e
def test_a_worker_that_cannot_start_quotes_its_output(redis_url: str, r: object) -> None:
    """Without a logfile the error used to say "see None"; now it quotes what Celery printed."""
    w = WorkerProcess("broken", env=project_env(redis_url), app="no_such_app_module", cwd=ROOT).start()
    try:
        with pytest.raises(RuntimeError) as err:
            w.wait_registered(r, timeout=60)  # type: ignore[arg-type]
    finally:
        w.stop(timeout=10)
    text = str(err.value)
    assert "see None" not in text
    assert "no_such_app_module" in text, text

"""Streaming exactly once when the driver is ``kill -9``ed mid-micro-batch and restarted from its checkpoint.

The driver is ``tests/spark_kill_driver.py``, a process of its own (its JVM and Python workers
below it). Its test-only hook (``MQORDER_TEST_PAUSE``) holds it at a chosen point of a chosen
micro-batch and writes a marker file; the test then SIGKILLs the driver and every process under
it at once (a machine dying, not a shutdown: no hook, no ``finally`` runs), checks what Redis or
the sink holds at that moment, and starts the driver again on the same checkpoint.

* **writeStream** (topic → ``format("mqorder")`` → topic): killed once with batch 1's tasks staged
  and its commit not started, once with batch 2 published and not yet recorded by Spark; the
  restarted query publishes every row exactly once, each key's rows in their source order, and
  leaves no staged run behind.
* **readStream** (topic → Parquet): killed while a read task of batch 1 is handing its rows to the
  sink; the restarted query's committed files hold every stored message exactly once (no offset
  range skipped, none read twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

from mqorder import Producer
from tests.spark_support import ROOT, staged_keys, stored

pytestmark = [pytest.mark.spark, pytest.mark.timeout(1200)]

QUEUES = 3
MESSAGES = 240
#: 4 micro-batches: each kill lands in a batch after a committed one, and one batch follows the last
#: replay (each batch more is a few seconds of every driver run).
PER_TRIGGER = 60
#: Generous: a JVM start on a loaded 2-core machine takes tens of seconds.
DEADLINE_S = 400.0


def _publish_source(url: str, topic: str) -> dict[str, list[bytes]]:
    """``MESSAGES`` messages over 7 keys; each key's bodies in send order."""
    sent: dict[str, list[bytes]] = {}
    with Producer(url) as p:
        p.create_topic(topic, queues=QUEUES)
        items = []
        for i in range(MESSAGES):
            key = f"k{i % 7}"
            body = json.dumps({"k": key, "i": i}).encode()
            items.append((key, body))
            sent.setdefault(key, []).append(body)
        p.send_orderly_batch(topic, items)
    return sent


def _driver(tmp: Path, *args: str, pause: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    env.pop("MQORDER_TEST_PAUSE", None)
    if pause:
        env["MQORDER_TEST_PAUSE"] = pause
    log = open(tmp / f"driver-{time.monotonic_ns()}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tests.spark_kill_driver", *args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every process under it (JVM, daemon, Python workers) at once."""
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    proc.kill()
    for p in below:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)  # reaped here, by its parent (psutil would take its exit status)
    psutil.wait_procs(below, timeout=30)


def _run_until_paused(tmp: Path, args: list[str], point: str, batch: int) -> None:
    """Start the driver paused at ``point`` of ``batch``, wait for it to get there, kill it."""
    marker = tmp / f"paused-{point}-{batch}"
    proc = _driver(tmp, *args, pause=f"{point}:{batch}:{marker}")
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the driver exited ({proc.returncode}) before {point} of batch {batch}: "
                                     f"{_logs(tmp)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the driver did not reach {point} of batch {batch} in {DEADLINE_S:.0f} s")
            time.sleep(0.1)
    finally:
        _kill_tree(proc)
    assert proc.returncode == -9


def _run_to_end(tmp: Path, args: list[str]) -> None:
    proc = _driver(tmp, *args)
    try:
        rc = proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert rc == 0, _logs(tmp)


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp.glob("driver-*.log")))


def _job_reports(r: redis.Redis) -> dict[int, dict]:
    out = {}
    for key in r.scan_iter(match="mqorder:spark:job:*"):
        if key.endswith(b":runs"):
            continue
        rep = {k.decode(): json.loads(v) for k, v in r.hgetall(key).items()}
        out[rep["batch_id"]] = rep
    return out


def test_write_stream_killed_mid_batch_restarts_exactly_once(redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    sent = _publish_source(redis_url, "src")
    with Producer(redis_url) as p:
        p.create_topic("dst", queues=QUEUES)
    args = ["write", "--url", redis_url, "--src", "src", "--dst", "dst", "--checkpoint", str(tmp_path / "ckpt"),
            "--per-trigger", str(PER_TRIGGER)]

    def published() -> int:
        return sum(len(m) for m in stored(redis_url, "dst").values())

    # Killed with batch 1 staged, its commit not started: batch 0 only is published.
    _run_until_paused(tmp_path, args, "staged", 1)
    assert published() == PER_TRIGGER
    assert staged_keys(r), "batch 1's tasks had staged their rows"

    # Restarted, killed again once batch 2 is published but before Spark recorded it as done.
    _run_until_paused(tmp_path, args, "published", 2)
    assert published() == 3 * PER_TRIGGER
    # Restarted to the end: batch 2 replayed (nothing stored twice), then the rest.
    _run_to_end(tmp_path, args)

    reports = _job_reports(r)
    assert sorted(reports) == list(range(MESSAGES // PER_TRIGGER))
    assert (reports[2]["stored"], reports[2]["duplicates"]) == (0, PER_TRIGGER)  # the replay's report
    assert all(rep["stored"] == PER_TRIGGER for b, rep in reports.items() if b != 2)
    got: dict[str, list[bytes]] = {}
    for msgs in stored(redis_url, "dst").values():
        for _, key, _, body in msgs:
            got.setdefault(key or "", []).append(body)
    assert got == sent  # every row once, each key's rows in their source order
    assert staged_keys(r) == []


def _committed_parquet(out: Path) -> list[Path]:
    """The files the file sink committed (its ``_spark_metadata`` log), as Spark reads them."""
    files = []
    logs = [p for p in (out / "_spark_metadata").iterdir() if p.name.split(".")[0].isdigit()]  # not .N.crc
    for entry in sorted(logs, key=lambda p: int(p.name.split(".")[0])):
        for line in entry.read_text().splitlines()[1:]:  # after the "v1" version line
            files.append(Path(json.loads(line)["path"].removeprefix("file:")))
    return files


def test_read_stream_killed_mid_batch_restarts_exactly_once(redis_url: str, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    _publish_source(redis_url, "src")
    out = tmp_path / "out"
    args = ["read", "--url", redis_url, "--src", "src", "--out", str(out), "--checkpoint", str(tmp_path / "ckpt"),
            "--per-trigger", str(PER_TRIGGER)]
    _run_until_paused(tmp_path, args, "reading", 1)
    _run_to_end(tmp_path, args)

    rows = pq.ParquetDataset([str(f) for f in _committed_parquet(out)]).read().to_pylist()
    expected = {(q, off, msg_id) for q, msgs in stored(redis_url, "src").items() for off, _, msg_id, _ in msgs}
    assert len(rows) == MESSAGES
    assert {(row["queue"], row["offset"], row["msg_id"]) for row in rows} == expected

"""Flower watches the stock workers: a real ``celery flower`` process against a real worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from mqorder.embedded import free_port
from tests.conftest import ROOT, Cluster, wait_for


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except Exception:  # noqa: BLE001
        return 0, b""


def test_flower_serves_the_stock_workers(cluster: Cluster) -> None:
    w = cluster.start_worker("fw")
    port = free_port()
    env = cluster.env(FLOWER_UNAUTHENTICATED_API="true")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/healthcheck")[0] == 200, timeout=30, what="flower healthcheck")

        def worker_listed() -> bool:
            status, data = _get(f"{base}/api/workers?refresh=1")
            return status == 200 and w.hostname in json.loads(data or b"{}")

        wait_for(worker_listed, timeout=30, interval=0.5, what="worker listed by flower")
        status, data = _get(f"{base}/api/workers")
        assert "mqorder.consume_request" in json.dumps(json.loads(data)[w.hostname].get("registered", []))
    finally:
        proc.terminate()
        proc.wait(10)
        time.sleep(0.1)

"""Flower in a real browser: Debian's ``chromium`` headless loads Flower's dashboard and tasks page
while Flower (basic auth on) watches two real prefork workers consuming ``t-order``.

It proves what an operator relies on: the stock workers send task events without ``-E``; the
dashboard lists both workers; the tasks page lists ``mqorder.consume_request`` runs labelled by
group, topic and queue (``argsrepr`` set in ``mqorder.celery.dispatch``) rather than opaque ids;
and the REST API answers 401 without credentials, 200 with them. The screenshots are kept in the
test's tmp dir (``docs/img/flower.png`` is one of them).

No Python browser driver: ``chromium --headless --screenshot --dump-dom`` renders the page, runs
its JavaScript (the tables are filled by XHR) for a bounded virtual time and prints the final DOM.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mqorder.client.producer import Producer
from mqorder.testing.embedded import free_port
from tests.support import ROOT, Cluster, body, ledger, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

USER, PASSWORD = "ops", "flower-test-pw"
#: The flags of the issue: no sandbox (root in a container), no GPU, nothing phoning home.
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
#: Flower's tasks table with the readable ConsumeRequest arguments shown (the default hides args).
TASKS_COLUMNS = "name,args,state,received,runtime,worker"
READABLE_ARGS = re.compile(r"group=g-order topic=t-order queue=broker-a:[0-3]")
KEYS = [f"k{i}" for i in range(40)]


def ensure_chromium() -> str:
    """Debian's ``chromium``, installed with apt-get when absent (as ``make test`` does)."""
    found = shutil.which("chromium")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.fail("chromium is not installed and there is no apt-get to install it with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run([apt, "update", "-qq"], env=env, capture_output=True, timeout=600, check=False)
    done = subprocess.run([apt, "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900,
                          check=False)
    found = shutil.which("chromium")
    if done.returncode != 0 or found is None:
        pytest.fail(f"apt-get install chromium failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    return found


@dataclass
class Page:
    dom: str
    screenshot: Path


def render(chromium: str, url: str, screenshot: Path, size: str = "1400,900") -> Page:
    """Load ``url`` in a fresh headless profile; return the DOM after its scripts ran, and a PNG."""
    with tempfile.TemporaryDirectory(prefix="mqorder-chromium-") as profile:
        done = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
             "--virtual-time-budget=4000", f"--screenshot={screenshot}", "--dump-dom", url],
            capture_output=True, timeout=90, check=False,
        )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return Page(done.stdout.decode(), screenshot)


def api(url: str, auth: tuple[str, str] | None = None) -> tuple[int, object]:
    """GET a Flower URL; the status and the decoded JSON body (None when it is not JSON)."""
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


@pytest.fixture
def flower(cluster: Cluster) -> Iterator[str]:
    """``celery -A workers.app flower`` with basic auth on a free loopback port; yields its base URL."""
    port = free_port()
    log = open(cluster.tmp / "flower.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}", "--address=127.0.0.1",
         f"--basic_auth={USER}:{PASSWORD}", f"--tasks_columns={TASKS_COLUMNS}"],
        env=cluster.env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: api(f"{base}/healthcheck")[0] == 200 or proc.poll() is not None, timeout=30,
                 what="flower healthcheck")
        assert proc.poll() is None, (cluster.tmp / "flower.log").read_text()
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_flower_shows_both_workers_and_readable_consume_requests_in_chromium(
    cluster: Cluster, flower: str, redis_url: str, tmp_path: Path,
) -> None:
    chromium = ensure_chromium()
    workers = [cluster.start_worker(name, wait=False) for name in ("fbw1", "fbw2")]
    for w in workers:
        w.wait_registered(cluster.client, timeout=60)
    hosts = {w.hostname for w in workers}
    auth = (USER, PASSWORD)

    def both_listed() -> bool:
        status, data = api(f"{flower}/api/workers?refresh=1", auth)
        return status == 200 and isinstance(data, dict) and hosts <= set(data)

    wait_for(both_listed, timeout=30, interval=0.5, what="both workers listed by flower")

    # Traffic after Flower connected (it only knows tasks whose events it received).
    with Producer(redis_url) as producer:
        producer.create_topic("t-order", queues=4)
        producer.send_orderly_batch("t-order", [(k, body(k, 1)) for k in KEYS])
    wait_for(lambda: len(ledger(cluster.client, "g-order")) >= len(KEYS), timeout=30, what="every message handled")

    def consume_requests() -> list[dict]:
        status, data = api(f"{flower}/api/tasks?taskname=mqorder.consume_request", auth)
        return list(data.values()) if status == 200 and isinstance(data, dict) else []

    def succeeded_on_both() -> list[dict]:
        # Every queue's request, on both workers: a request that drained its queue lingers (up to
        # consume_linger_ms) before it succeeds, so the ones of one worker do not end together.
        done = [t for t in consume_requests() if t["state"] == "SUCCESS"]
        queues = {ast.literal_eval(t["kwargs"]).get("queue") for t in done}
        return done if {t["worker"] for t in done} == hosts and queues == {0, 1, 2, 3} else []

    tasks = wait_for(succeeded_on_both, timeout=30, interval=0.5, what="consume_request events from both workers")
    for t in tasks:
        assert READABLE_ARGS.fullmatch(t["args"]), t["args"]
        labels = ast.literal_eval(t["kwargs"])
        assert labels["group"] == "g-order" and labels["topic"] == "t-order", labels
    assert {ast.literal_eval(t["kwargs"])["queue"] for t in tasks} == {0, 1, 2, 3}

    # The REST API is behind the same basic auth as the pages.
    for path in ("/api/workers", "/api/tasks"):
        assert api(flower + path)[0] == 401, path
        assert api(flower + path, (USER, "wrong"))[0] == 401, path
        assert api(flower + path, auth)[0] == 200, path

    authed = flower.replace("http://", f"http://{USER}:{PASSWORD}@")
    t0 = time.monotonic()
    dashboard = render(chromium, f"{authed}/", tmp_path / "flower-dashboard.png")
    for host in hosts:
        assert host in dashboard.dom, f"{host} not on the dashboard"
    assert "Online" in dashboard.dom

    page = render(chromium, f"{authed}/tasks", tmp_path / "flower-tasks.png", size="1500,660")
    assert "mqorder.consume_request" in page.dom
    assert READABLE_ARGS.search(page.dom), "the tasks page does not show group/topic/queue"
    assert any(host in page.dom for host in hosts)

    anonymous = render(chromium, f"{flower}/", tmp_path / "flower-anonymous.png")
    assert not any(host in anonymous.dom for host in hosts), "the dashboard is visible without credentials"
    assert time.monotonic() - t0 < 60, "three headless page loads took more than a minute"

    for shot in (dashboard.screenshot, page.screenshot):
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{shot} is not a rendered page"

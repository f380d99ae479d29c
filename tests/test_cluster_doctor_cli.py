"""``mqorder doctor`` as a command on a ``redis+cluster://`` store: the cluster checks, then the
per-Redis ones on each primary. Needs the cluster client of ``mqorder.store.connect`` (the
doctor's brokers are built from the settings), unlike ``test_cluster_doctor``, which probes the
cluster by itself."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from mqorder.cli import app
from mqorder.settings import get_settings
from mqorder.testing.cluster import ClusterDeployment

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def healthy() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3, replicas_per_master=1) as d:
        yield d


def test_mqorder_doctor_runs_the_cluster_checks_and_the_per_primary_ones(
        healthy: ClusterDeployment, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole command on a ``redis+cluster://`` store: cluster checks, then persistence and the
    like on each primary, named ``broker-a <host:port>``; exit 0 (warnings only)."""
    monkeypatch.setenv("MQORDER_REDIS_URL", healthy.url())
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(app, ["doctor", "--app", "", "--json"], catch_exceptions=False)
    finally:
        get_settings.cache_clear()
    assert res.exit_code == 0, res.stdout
    found = json.loads(res.stdout)["findings"]
    checks = {f["check"] for f in found}
    assert {"cluster state", "slot coverage", "replicas", "queue slots", "persistence", "eviction"} <= checks
    primaries = {f"broker-a 127.0.0.1:{healthy.master_of_slot(s).port}" for s in (0, 8000, 16383)}
    assert {f["broker"] for f in found if f["check"] == "eviction"} == primaries
    assert "version" not in checks  # the cluster's own version check (Redis 7 on every node) replaces it


def test_doctor_with_the_stock_app_that_cannot_load_still_checks_the_cluster_and_fails(
        healthy: ClusterDeployment) -> None:
    """A cluster store without MQORDER_CELERY_BROKER_URL: the stock app exits 2 when loaded, and
    that ended the doctor before any cluster check ran (an operator walk-through). Now the cluster
    is checked and the app's failure is a FAIL finding; so is a mistyped --app (it was a WARN and
    exit 0). The real command, in a process of its own (the stock app reads its settings once)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MQORDER_")}
    env["MQORDER_REDIS_URL"] = healthy.url()

    def doctor(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mqorder.cli", "doctor", "--json", *args], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    res = doctor()
    assert res.returncode == 1, res.stdout + res.stderr
    found = {f["check"]: f for f in json.loads(res.stdout)["findings"]}
    assert {"cluster state", "slot coverage", "persistence"} <= set(found)
    assert found["celery"]["verdict"] == "FAIL" and "exited with status 2" in found["celery"]["detail"]
    assert "MQORDER_CELERY_BROKER_URL" in res.stderr  # the app's own reason
    typo = doctor("--app", "nosuch.mod:app")
    assert typo.returncode == 1, typo.stdout + typo.stderr
    (celery,) = [f for f in json.loads(typo.stdout)["findings"] if f["check"] == "celery"]
    assert celery["verdict"] == "FAIL" and "nosuch.mod:app could not be loaded" in celery["detail"]

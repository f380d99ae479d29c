"""``format("mqorder")`` on a real Spark standalone cluster: a master and two workers started from
the installed pyspark, executors in JVMs of their own whose Python workers import mqorder
themselves (``tests.spark_cluster``).

The driver is a process of its own (``cluster_driver``) running ``tests.spark_jobs``; the cluster
has no ``MQORDER_*`` in its environment, so every job reaches Redis through what the driver
planned. Each test checks what Redis holds afterwards, not what the driver says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from tests.spark_checks import LedgerWriter, check_read, check_refusals, check_stream, check_write
from tests.spark_cluster import SparkDriver, StandaloneCluster, spark_env

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


def test_tasks_run_in_executor_jvms_on_both_workers_with_this_virtualenv(cluster_driver: SparkDriver) -> None:
    rows = cluster_driver.call("probe", partitions=4)
    assert len(rows) == 32
    assert {r["executor"] for r in rows} == {"0", "1"}  # one executor per worker, not the driver
    assert {r["python"] for r in rows} == {sys.executable}  # PYSPARK_PYTHON: this virtualenv
    assert not any(r["tests_imported"] for r in rows)  # nothing of the driver's modules


def test_write_then_publish_is_exactly_once_and_ordered_per_key(cluster_driver: SparkDriver, redis_url: str,
                                                                r: redis.Redis) -> None:
    check_write(cluster_driver, redis_url, r, opts={})


def test_batch_read_with_offsets(cluster_driver: SparkDriver, redis_url: str) -> None:
    check_read(cluster_driver, redis_url, opts={})


def test_stream_topic_to_topic_restarted_from_its_checkpoint_is_exactly_once(
        cluster_driver: SparkDriver, redis_url: str, tmp_path: Path) -> None:
    check_stream(cluster_driver, redis_url, tmp_path, opts={})


def test_the_cli_audits_a_ledger_on_the_cluster(standalone_cluster: StandaloneCluster, redis_url: str,
                                                 r: redis.Redis, tmp_path: Path) -> None:
    """``mqorder pipeline audit --master spark://...``: the ledger read and the audit's jobs run on
    the cluster's executors (a second application, beside the tests' driver)."""
    with Producer(redis_url) as p:
        p.create_topic("sa-audit", queues=2)
        p.send_orderly_batch("sa-audit", [(f"k{i % 5}", json.dumps({"s": i}).encode()) for i in range(60)])
        assert LedgerWriter(r, "g-audit").handle_all(p, "sa-audit") == 60
    env = spark_env(MQORDER_REDIS_URL=redis_url, SPARK_CONF_DIR=str(standalone_cluster.conf_dir))
    res = subprocess.run([str(Path(sys.executable).parent / "mqorder"), "pipeline", "audit", "--topic", "sa-audit",
                          "--group", "g-audit", "--report", str(tmp_path / "report"),
                          "--master", standalone_cluster.master_url],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "PASS" in res.stdout
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (rep["messages_stored"], rep["messages_succeeded"], rep["violation_count"], rep["gap_count"]) == (
        60, 60, 0, 0)


def test_bad_input_is_refused_with_mqorder_s_message(cluster_driver: SparkDriver, redis_url: str,
                                                     r: redis.Redis) -> None:
    check_refusals(cluster_driver, redis_url, r, opts={})

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
import time
from collections import defaultdict
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.client.selector import queue_index
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome
from mqorder.store.log import MessageLog
from mqorder.store.scripts import Scripts
from tests.spark_cluster import DriverError, SparkDriver, StandaloneCluster, spark_env
from tests.spark_support import staged_keys, stored

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def test_tasks_run_in_executor_jvms_on_both_workers_with_this_virtualenv(cluster_driver: SparkDriver) -> None:
    rows = cluster_driver.call("probe", partitions=4)
    assert len(rows) == 32
    assert {r["executor"] for r in rows} == {"0", "1"}  # one executor per worker, not the driver
    assert {r["python"] for r in rows} == {sys.executable}  # PYSPARK_PYTHON: this virtualenv
    assert not any(r["tests_imported"] for r in rows)  # nothing of the driver's modules


def check_written(url: str, topic: str, n: int, keys: int) -> None:
    """Every row once, each key in its producer queue and in ``ts`` order."""
    per_key: dict[str, list[int]] = defaultdict(list)
    queues = stored(url, topic)
    for index, msgs in queues.items():
        for _, key, _, body in msgs:
            assert key is not None and queue_index(key, len(queues)) == index
            per_key[key].append(json.loads(body)["ts"])
    assert sum(len(v) for v in per_key.values()) == n
    assert len(per_key) == keys
    for key, ts in per_key.items():
        assert ts == sorted(set(ts)), key  # in order, nothing twice
    assert sorted(t for ts in per_key.values() for t in ts) == list(range(n))


def test_write_then_publish_is_exactly_once_and_ordered_per_key(cluster_driver: SparkDriver, redis_url: str,
                                                                r: redis.Redis) -> None:
    with Producer(redis_url) as p:
        p.create_topic("sa-write", queues=4)
    report = cluster_driver.call("write_then_publish", topic="sa-write", n=600, keys=13, opts={})
    # The staged df.write stored every row; publish of the same rows found every id stored.
    assert (report["rows"], report["stored"], report["duplicates"]) == (600, 0, 600)
    check_written(redis_url, "sa-write", 600, 13)
    assert staged_keys(r) == []


def test_batch_read_with_offsets(cluster_driver: SparkDriver, redis_url: str) -> None:
    with Producer(redis_url) as p:
        p.create_topic("sa-read", queues=3)
        p.send_orderly_batch("sa-read", [(f"k{i % 9}", f"m{i}".encode()) for i in range(150)])
    everything = stored(redis_url, "sa-read")
    rows = cluster_driver.call("read", topic="sa-read", opts={}, starting='{"0": 5, "2": 10}',
                               ending='{"0": 20, "1": -1, "2": -1}')
    expected = sorted([q, off, key, body.decode()] for q, msgs in everything.items() for off, key, _, body in msgs
                      if {0: 5 <= off < 20, 1: True, 2: off >= 10}[q])
    assert rows == expected and len(rows) > 50


def test_stream_topic_to_topic_restarted_from_its_checkpoint_is_exactly_once(
        cluster_driver: SparkDriver, redis_url: str, tmp_path: Path) -> None:
    check_stream(cluster_driver, redis_url, tmp_path, opts={})


def check_stream(driver: SparkDriver, url: str, tmp: Path, opts: dict[str, str]) -> None:
    """readStream → writeStream in micro-batches, twice from one checkpoint with new rows between:
    the sink holds every source message once, each key's in its source order."""
    with Producer(url) as p:
        p.create_topic("src", queues=3)
        p.create_topic("dst", queues=2)
        p.send_orderly_batch("src", [(f"k{i % 8}", f"a{i}".encode()) for i in range(120)])
        first = driver.call("stream", source="src", sink="dst", checkpoint=str(tmp / "ckpt"), opts=opts,
                            max_per_trigger=50)
        p.send_orderly_batch("src", [(f"k{i % 8}", f"b{i}".encode()) for i in range(40)])
    second = driver.call("stream", source="src", sink="dst", checkpoint=str(tmp / "ckpt"), opts=opts,
                         max_per_trigger=50)
    assert (first["rows"], second["rows"]) == (120, 40)
    assert first["batches"] >= 3  # maxOffsetsPerTrigger: 120 messages in batches of at most 50
    source = {(q, off): (key, body.decode()) for q, msgs in stored(url, "src").items() for off, key, _, body in msgs}
    src_order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (q, off), (key, _) in sorted(source.items()):
        src_order[key].append((q, off))
    sink_order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for _, msgs in sorted(stored(url, "dst").items()):
        for _, key, _, body in msgs:
            b = json.loads(body)
            assert source[(b["src_queue"], b["src_offset"])] == (key, b["src_body"])
            sink_order[key].append((b["src_queue"], b["src_offset"]))
    assert sink_order == src_order  # every message once, each key's in its source order


class LedgerWriter:
    """Ledger records as the engine writes them (``LedgerBuffer`` → ``ledger.lua``)."""

    def __init__(self, client: redis.Redis, group: str) -> None:
        self.buf, self.scripts, self.clock = LedgerBuffer(group, "c1@test", "run1", 1_000_000), Scripts(client), 0.0

    def handle_all(self, p: Producer, topic: str) -> int:
        log, n = MessageLog(p.brokers), 0
        self.clock = time.time() * 1000
        for mq in p.describe_topic(topic).message_queues:
            for m in log.read(mq, 0, 10**6):
                self.clock += 5
                self.buf.note([m], LedgerOutcome.SUCCESS, self.clock, self.clock + 1, 1)
                n += 1
        self.buf.flush(self.scripts)
        return n


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
                          "--group", "g-audit", "--report", str(tmp_path / "report"), "--order-field", "s",
                          "--master", standalone_cluster.master_url],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "PASS" in res.stdout
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (rep["messages_stored"], rep["messages_succeeded"], rep["violation_count"], rep["gap_count"]) == (
        60, 60, 0, 0)


def test_bad_input_is_refused_with_mqorder_s_message(cluster_driver: SparkDriver, redis_url: str,
                                                     r: redis.Redis) -> None:
    with Producer(redis_url) as p:
        p.create_topic("sa-bad", queues=2)
    check_refusals(cluster_driver, opts={})
    assert stored(redis_url, "sa-bad") == {0: [], 1: []} and staged_keys(r) == []


def check_refusals(driver: SparkDriver, opts: dict[str, str]) -> None:
    """An unknown topic, a missing key column and null keys, through ``df.write`` (Spark's error
    carries mqorder's, found by ``mqorder.spark.errors``) and ``publish`` (which raises it)."""
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="nope", opts=opts)
    assert err.value.mqorder is not None and err.value.mqorder[0] == "TopicNotFoundError"
    assert "mqorder topic create nope" in err.value.mqorder[1]
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="sa-bad", opts=opts, key="customer")
    assert err.value.mqorder == ("ConfigError", "key column 'customer' is not in the DataFrame; its columns are: "
                                                "k, ts, body")
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="sa-bad", opts=opts, null_key_every=4, via_publish=True)
    assert err.value.kind == "JobRefusedError"  # publish raises mqorder's own error, whatever the mode
    assert "10 rows have a null key ('k')" in err.value.message and "onNull" in err.value.message

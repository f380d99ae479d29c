"""``format("mqorder")`` from a Spark Connect client (``SparkSession.builder.remote("sc://...")``)
against the Connect server of the installed pyspark (``tests.spark_cluster.ConnectServer``).

The client (``connect_driver``, a process of its own) registers the data source; the server's
Python workers import mqorder and run it. The server has no ``MQORDER_*`` in its environment: the
jobs pass ``redisUrl``. The checks are the standalone cluster's (``tests.spark_checks``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome
from mqorder.store.scripts import Scripts
from tests.spark_checks import LedgerWriter, check_read, check_refusals, check_stream, check_write
from tests.spark_cluster import SparkDriver

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


def _opts(url: str) -> dict[str, str]:
    return {"redisUrl": url}


def test_tasks_run_in_the_server_s_python_workers(connect_driver: SparkDriver) -> None:
    rows = connect_driver.call("probe", partitions=2)
    assert len(rows) == 16
    assert {r["executor"] for r in rows} == {"driver"}  # local[2] server: under the server's JVM
    assert {r["python"] for r in rows} == {sys.executable}
    assert not any(r["tests_imported"] for r in rows)


def test_write_then_publish_is_exactly_once_and_ordered_per_key(connect_driver: SparkDriver, redis_url: str,
                                                                r: redis.Redis) -> None:
    check_write(connect_driver, redis_url, r, _opts(redis_url))


def test_batch_read_with_offsets_and_the_ledger(connect_driver: SparkDriver, redis_url: str,
                                                r: redis.Redis) -> None:
    check_read(connect_driver, redis_url, _opts(redis_url))
    with Producer(redis_url) as p:
        n = LedgerWriter(r, "g-connect").handle_all(p, "sa-read")
        records = connect_driver.call("ledger", group="g-connect", opts=_opts(redis_url))
        expected = sorted([q, m.queue_offset, "SUCCESS"] for q, mq in enumerate(p.describe_topic("sa-read").message_queues)
                          for m in _log(p).read(mq, 0, 10**6))
    assert len(records) == n == 150 and records == expected


def _log(p: Producer):
    from mqorder.store.log import MessageLog

    return MessageLog(p.brokers)


def test_stream_topic_to_topic_restarted_from_its_checkpoint_is_exactly_once(
        connect_driver: SparkDriver, redis_url: str, tmp_path: Path) -> None:
    check_stream(connect_driver, redis_url, tmp_path, _opts(redis_url))


def test_bad_input_is_refused_with_mqorder_s_message(connect_driver: SparkDriver, redis_url: str,
                                                     r: redis.Redis) -> None:
    check_refusals(connect_driver, redis_url, r, _opts(redis_url))


def test_the_audit_runs_through_the_connect_client(connect_driver: SparkDriver, redis_url: str,
                                                   r: redis.Redis) -> None:
    """``mqorder.spark.audit`` from a Connect client (no ``sparkContext`` there): a clean ledger
    passes from the ledger alone; a ledger with a swapped pair and a missing message takes phase 2
    (the stored index, read by the server's Python workers) and names both."""
    with Producer(redis_url) as p:
        p.create_topic("sa-audit", queues=3)
        p.send_orderly_batch("sa-audit", [(f"k{i % 9}", f"m{i}".encode()) for i in range(150)])
        LedgerWriter(r, "g-ca-clean").handle_all(p, "sa-audit")
        queues = [_log(p).read(mq, 0, 10**6) for mq in p.describe_topic("sa-audit").message_queues]
    clean = connect_driver.call("audit", topic="sa-audit", group="g-ca-clean", opts=_opts(redis_url))
    assert clean["ok"] and not clean["read_stored"]
    assert (clean["ledger_records"], clean["messages_stored"], clean["messages_succeeded"]) == (150, 150, 150)

    qi = next(i for i, q in enumerate(queues) if len({m.keys[0] for m in q}) >= 2)  # 9 keys, 3 queues
    q0 = queues[qi]
    by_key: dict[str, list[int]] = {}
    for i, m in enumerate(q0):
        by_key.setdefault(m.keys[0], []).append(i)
    swapped_key, gap_key = [k for k, at in by_key.items() if len(at) >= 3][:2]
    order = list(range(len(q0)))
    a, b = by_key[swapped_key][:2]
    order[a], order[b] = b, a  # swapped_key's first two messages handled the wrong way round
    missing = by_key[gap_key][1]  # gap_key's second message never handled, its third is
    order.remove(missing)
    buf, clock = LedgerBuffer("g-ca-faulty", "c1@test", "run1", 1_000_000), time.time() * 1000
    for msg in [q0[i] for i in order] + [m for i, q in enumerate(queues) if i != qi for m in q]:
        clock += 5
        buf.note([msg], LedgerOutcome.SUCCESS, clock, clock + 1, 1)
    buf.flush(Scripts(r))
    faulty = connect_driver.call("audit", topic="sa-audit", group="g-ca-faulty", opts=_opts(redis_url))
    assert not faulty["ok"] and faulty["read_stored"]
    assert [(v["key"], v["queue"], v["offset"], v["after_offset"]) for v in faulty["violations"]] == [
        (swapped_key, qi, q0[a].queue_offset, q0[b].queue_offset)]
    assert [(g["key"], g["queue"], g["offset"], g["msg_id"]) for g in faulty["gaps"]] == [
        (gap_key, qi, q0[missing].queue_offset, q0[missing].msg_id)]
    assert (faulty["messages_stored"], faulty["messages_succeeded"]) == (150, 149)

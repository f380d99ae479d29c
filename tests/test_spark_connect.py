"""``format("mqorder")`` from a Spark Connect client (``SparkSession.builder.remote("sc://...")``)
against the Connect server of the installed pyspark (``tests.spark_cluster.ConnectServer``).

The client (``connect_driver``, a process of its own) registers the data source; the server's
Python workers import mqorder and run it. The server has no ``MQORDER_*`` in its environment: the
jobs pass ``redisUrl``. The checks are the standalone cluster's (``tests.spark_checks``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

from mqorder import Producer
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

"""The Spark side of the tests: one local Spark session for the whole run, and faulty writers.

The session runs on ``local[2,3]``: two task slots (so two tasks really run at once) and up to
three attempts per task (plain ``local[2]`` fails a job at the first task failure, so no retry
would ever be tested). Its executors run this virtualenv's interpreter and can import ``tests``
(the faulty writers below are pickled by reference). It talks to the session's real
``redis-server``.

The faulty writers are the production writers with one hook overridden (``after_chunk``,
``run_id`` or ``commit``): registered as other formats, they inject the failures the issue names
(a first attempt dying half way, two attempts of one partition at once, a job failing after other
tasks succeeded, a stream dying between its commit and Spark's checkpoint).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mqorder.testing.embedded import RedisServer
from tests.support import xdist_worker

ROOT = Path(__file__).resolve().parent.parent


class InjectedFailure(RuntimeError):
    """A failure a test injects on purpose."""


def _faulty_sources() -> list[type]:
    """Defined lazily: this module is imported by conftest even where pyspark is not installed."""
    from pyspark import TaskContext

    from mqorder.spark.source import MQOrderDataSource
    from mqorder.spark.writer import MQOrderStreamWriter, MQOrderWriter

    class FirstAttemptDiesHalfWay(MQOrderWriter):
        """Attempt 0 of every task raises once half of its partition is staged."""

        def after_chunk(self, ctx: TaskContext | None, rows_done: int, rows_total: int) -> None:
            if ctx is not None and ctx.attemptNumber() == 0 and rows_done * 2 >= rows_total:
                raise InjectedFailure(f"attempt 0 of partition {ctx.partitionId()} dies after {rows_done} of "
                                      f"{rows_total} rows")

    class TwoAttemptsAtOnce(MQOrderWriter):
        """Partitions 2k and 2k+1 hold the same rows and stage into one run: two attempts of one
        task, running at the same time in the two task slots, as speculation would run them."""

        def run_id(self, ctx: TaskContext | None) -> int:
            return (ctx.partitionId() if ctx is not None else 0) // 2

        def after_chunk(self, ctx: TaskContext | None, rows_done: int, rows_total: int) -> None:
            time.sleep(0.005)  # interleave the two attempts' staging calls

    class LastPartitionAlwaysFails(MQOrderWriter):
        """Partition 2 of 3 fails half way on every attempt, once partitions 0 and 1 succeeded."""

        partitions = 3

        def _done_key(self) -> str:
            return f"test:succeeded:{self.plan.job_id}"

        def write(self, iterator):
            msg = super().write(iterator)
            client = redis.Redis.from_url(self.plan.conn.redis_url)
            try:
                client.incr(self._done_key())
            finally:
                client.close()
            return msg

        def after_chunk(self, ctx: TaskContext | None, rows_done: int, rows_total: int) -> None:
            if ctx is None or ctx.partitionId() != self.partitions - 1 or rows_done * 2 < rows_total:
                return
            client = redis.Redis.from_url(self.plan.conn.redis_url)
            try:
                deadline = time.monotonic() + 60
                while int(client.get(self._done_key()) or 0) < self.partitions - 1:
                    if time.monotonic() > deadline:
                        raise AssertionError("the other tasks did not succeed within 60 s")
                    time.sleep(0.05)
            finally:
                client.close()
            raise InjectedFailure(f"partition {ctx.partitionId()} fails after the other tasks succeeded")

    class CommitThenCrash(MQOrderStreamWriter):
        """Micro-batch 2 publishes, then its commit fails (once): the query dies before Spark
        records the batch as done, so a restarted query replays batch 2 with the same rows."""

        def commit(self, messages, batchId):
            super().commit(messages, batchId)
            if batchId == 2:
                client = redis.Redis.from_url(self.plan.conn.redis_url)
                try:
                    first = client.set("test:crashed-after-commit", 1, nx=True)
                finally:
                    client.close()
                if first:
                    raise InjectedFailure("the driver dies after micro-batch 2 was published")

    def source(fmt: str, writer: type | None = None, stream_writer: type | None = None) -> type:
        attrs: dict[str, object] = {"name": classmethod(lambda cls: fmt)}
        if writer is not None:
            attrs["writer_class"] = writer
        if stream_writer is not None:
            attrs["stream_writer_class"] = stream_writer
        return type(f"Source_{fmt}", (MQOrderDataSource,), attrs)

    return [
        source("mqorder_first_attempt_dies", FirstAttemptDiesHalfWay),
        source("mqorder_two_attempts_at_once", TwoAttemptsAtOnce),
        source("mqorder_last_partition_fails", LastPartitionAlwaysFails),
        source("mqorder_commit_then_crash", stream_writer=CommitThenCrash),
    ]


@pytest.fixture(scope="session")
def spark(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The one Spark session of the test run (``local[2,3]``), mqorder and the faulty formats registered."""
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.fail("Spark needs Java 17+: run `make test` (it installs openjdk-17-jre-headless) "
                    "or `apt-get install -y openjdk-17-jre-headless`")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["MQORDER_REDIS_URL"] = redis_server.url
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    from mqorder.spark import session

    # One session per test process: under pytest-xdist each worker that runs a Spark test starts
    # its own JVM (driver memory 1g below; `make test` runs 2 workers, so at most two JVMs), with
    # its own local dir and warehouse under its own basetemp and an app name naming the worker.
    spark = session(
        f"mqorder-tests-{xdist_worker()}",
        "local[2,3]",
        **{
            "spark.ui.enabled": "false",
            "spark.sql.warehouse.dir": str(tmp_path_factory.mktemp("spark-warehouse")),
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "4",
            "spark.sql.session.timeZone": "UTC",
            "spark.local.dir": str(tmp_path_factory.mktemp("spark-local")),
            "spark.driver.memory": "1g",
            "spark.sql.streaming.stopTimeout": "30s",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    for src in _faulty_sources():
        spark.dataSource.register(src)
    yield spark
    spark.stop()


# -- reading back what a job stored ---------------------------------------------------------------


def stored(url: str, topic: str) -> dict[int, list[tuple[int, str | None, str, bytes]]]:
    """Every stored message of ``topic`` per queue index: (offset, key, msg id, body), in log order."""
    from mqorder.model import MessageQueue
    from mqorder.store.brokers import BrokerRegistry
    from mqorder.store.log import MessageLog
    from mqorder.store.topics import TopicManager

    brokers = BrokerRegistry(url)
    try:
        log = MessageLog(brokers)
        out = {}
        for i, mq in enumerate(TopicManager(brokers).describe_topic(topic).message_queues):
            msgs = log.read(MessageQueue(mq.topic, mq.broker_name, mq.queue_id), 0, 10**9)
            out[i] = [(m.queue_offset, m.keys[0] if m.keys else None, m.msg_id, m.body) for m in msgs]
        return out
    finally:
        brokers.close()


def staged_keys(client: redis.Redis) -> list[bytes]:
    """Staging runs and run registries left in Redis (none once a job committed or aborted)."""
    return sorted(client.scan_iter(match="mqorder:*stage:*")) + sorted(client.scan_iter(match="mqorder:spark:job:*:runs"))

"""A Spark driver to kill: a streaming query on ``local[2]``, run as its own process by
``tests/test_spark_driver_kill.py``, which ``kill -9``s it (the driver, its JVM and every Python
worker at once) at a chosen point of a chosen micro-batch and starts it again from its checkpoint.

TEST-ONLY HOOK. The point is named by the environment variable ``MQORDER_TEST_PAUSE`` as
``<point>:<batch id>:<marker file>``; when the query reaches it, the process that got there writes
the marker file and waits (up to ``PAUSE_LIMIT_S``) for the kill, so the kill lands exactly there:

* ``staged``: the stream writer's commit of that batch, before it publishes (every task staged);
* ``published``: the same commit after it published, before Spark records the batch as done;
* ``reading``: a read task of that batch, after it handed its first rows to the sink.

The hook lives in subclasses registered as format ``mqorder_pausing`` (this module); production
code has none. Without the variable they are the production reader and writer.

Usage: ``python -m tests.spark_kill_driver (write|read) --url U --src T --dst T|--out DIR --checkpoint DIR
--per-trigger N``: ``write`` streams topic ``src`` into topic ``dst`` (key ``key``, order by the
source offset, body kept); ``read`` streams ``src`` into Parquet files under ``out``. Both run
``Trigger.AvailableNow`` (everything stored when the query starts, ``per-trigger`` offsets per
micro-batch) and exit 0 when the query ends.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "MQORDER_TEST_PAUSE"
#: A paused process gives up after this long (the test kills it well before).
PAUSE_LIMIT_S = 600.0
FORMAT = "mqorder_pausing"
#: Starts of the query when a Python process of Spark's failed to connect back in time.
START_ATTEMPTS = 8


def pause_at(point: str, batch_id: int) -> None:
    """Wait here for the kill if ``MQORDER_TEST_PAUSE`` names this point of this batch."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, batch, marker = spec.split(":", 2)
    if want != point or int(batch) != batch_id:
        return
    tmp = Path(f"{marker}.{os.getpid()}.tmp")
    tmp.write_text(f"{point} {batch_id} pid {os.getpid()}\n")
    tmp.replace(marker)
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
    raise RuntimeError(f"{ENV}: paused at {point} of batch {batch_id} for {PAUSE_LIMIT_S:.0f} s and nobody killed us")


def pausing_source() -> type:
    """The ``mqorder_pausing`` format: ``mqorder``'s stream reader and writer with ``pause_at`` hooks
    (defined lazily: pyspark is imported by the driver only)."""
    import pyarrow as pa
    from pyspark import TaskContext
    from pyspark.sql.datasource import DataSourceStreamReader, DataSourceStreamWriter, InputPartition

    from mqorder.spark.options import read_options
    from mqorder.spark.source import MQOrderDataSource
    from mqorder.spark.streaming import MQOrderStreamReader
    from mqorder.spark.writer import MQOrderStreamWriter

    class PausingStreamWriter(MQOrderStreamWriter):
        def commit(self, messages: Any, batchId: int) -> None:
            pause_at("staged", batchId)
            super().commit(messages, batchId)
            pause_at("published", batchId)

    class PausingStreamReader(MQOrderStreamReader):
        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            ctx = TaskContext.get()
            raw = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
            for i, batch in enumerate(super().read(partition)):
                yield batch
                if i == 0 and raw is not None:
                    pause_at("reading", int(raw))

    class PausingSource(MQOrderDataSource):
        stream_writer_class = PausingStreamWriter

        @classmethod
        def name(cls) -> str:
            return FORMAT

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return PausingStreamReader(read_options(self.options, streaming=True))

        def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamWriter:
            return super().streamWriter(schema, overwrite)

    return PausingSource


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.spark_kill_driver", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("write", "read"))
    ap.add_argument("--url", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--dst", help="write: the topic written")
    ap.add_argument("--out", help="read: the Parquet directory written")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--per-trigger", type=int, default=100)
    args = ap.parse_args(argv)

    from pyspark.sql import functions as F

    from mqorder.spark import session
    from tests.spark_kill_driver import pausing_source  # by its importable name: pickled by reference

    spark = session("mqorder-driver-kill", "local[2]", **{
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "2",
        "spark.driver.memory": "512m", "spark.sql.session.timeZone": "UTC",
    })
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(pausing_source())
    src = (spark.readStream.format(FORMAT).option("topic", args.src).option("redisUrl", args.url)
           .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", str(args.per_trigger)).load())
    if args.mode == "write":
        w = (src.select("key", F.col("offset").alias("src_offset"), "body").writeStream.format(FORMAT)
             .option("topic", args.dst).option("redisUrl", args.url).option("key", "key")
             .option("orderBy", "src_offset").option("body", "body"))
    else:
        w = src.select("queue", "offset", "msg_id", "key").writeStream.format("parquet").option("path", args.out)
    spark.range(10).count()  # the JVM warmed up before the query starts its Python processes
    started = time.monotonic()
    for attempt in range(1, START_ATTEMPTS + 1):
        q = w.option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start()
        try:
            q.awaitTermination()
        except Exception as exc:  # noqa: BLE001 - judged by its text below
            err = str(exc)
        else:
            err = str(q.exception() or "")
        if not err:
            break
        # Spark gives a Python process it starts 10 s to connect back (not configurable): on a loaded
        # machine one may not make it. Starting again from the checkpoint is what is under test anyway.
        if "failed to connect back" not in err or attempt == START_ATTEMPTS:
            sys.stderr.write(f"query failed: {err}\n")
            return 1
        sys.stderr.write(f"query attempt {attempt}: a Python worker did not connect back in time; starting again\n")
        time.sleep(2.0 * attempt)  # let the load that slowed it pass
    for p in q.recentProgress:  # in the driver's log, for a slow run
        sys.stderr.write(f"batch {p['batchId']}: {p['numInputRows']} rows, {p['durationMs']}\n")
    sys.stderr.write(f"query ran {time.monotonic() - started:.1f} s\n")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

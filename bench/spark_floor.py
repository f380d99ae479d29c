"""The floor under a Spark read: what a count costs when reading Redis and cutting replies cost nothing.

Issue 29 asks the reader for 2.5x the old reader's rate into a count. What is left of today's count
is mostly not the reader's Python: this measures how much. In one application on ``local[2]`` it
alternates two counts of the same number of rows with the same schema, in the same number of
partitions:

* ``mqorder``: ``spark.read.format("mqorder")`` over the read A/B's topic (``bench.spark_ab``:
  300,000 messages of 100 bytes over 16 queues, on a ``redis-server`` of its own);
* ``floor``: a Python data source (``FloorSource``, format ``mqorder_floor``) whose read tasks yield
  Arrow record batches built once per worker process and kept: realistic values (32-character
  ids, keys, 100-byte bodies, times), the pages' sizes, and the same ``worker_gc.freeze_imports``.
  No Redis, no parsing: what is left is Spark's own cost of a Python data source's rows (task
  launch, Arrow to the JVM, rows built from every column) and the count.

Per count it reports wall seconds and CPU seconds of the application (driver, JVM, Python workers)
and of ``redis-server``. ``python -m bench.spark_floor --rounds 8`` prints JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.spark_ab import READ_QUEUES, READ_TOPIC, _median, _tree_cpu, bench_session, build_read

#: Rows per floor batch: about what one of the reader's pages of 100-byte messages holds.
FLOOR_BATCH = 16_000
_CACHE: dict[tuple[int, int], list[Any]] = {}


def _floor_batches(rows: int, index: int) -> list[Any]:
    """``rows`` rows of the reader's schema for partition ``index``, built once per process."""
    import numpy as np
    import pyarrow as pa

    from mqorder.spark.reader import ARROW_SCHEMA

    got = _CACHE.get((rows, index))
    if got is None:
        ts = pa.timestamp("us", tz="UTC")
        offsets = np.arange(rows, dtype=np.int64)
        now_us = np.full(rows, 1_795_000_000_000_000, dtype=np.int64)
        cols = [
            pa.repeat(pa.scalar(READ_TOPIC), rows),
            pa.repeat(pa.scalar(index, pa.int32()), rows),
            pa.array(offsets),
            pa.array([f"{i:032X}" for i in range(rows)], pa.string()),
            pa.array([f"key-{i % 2000}" for i in range(rows)], pa.string()),
            pa.nulls(rows, pa.string()),
            pa.MapArray.from_arrays(pa.repeat(pa.scalar(0, pa.int32()), rows + 1), pa.array([], pa.string()),
                                    pa.array([], pa.string())),
            pa.repeat(pa.scalar(b"x" * 100, pa.binary()), rows),
            pa.array(now_us).cast(ts),
            pa.array(now_us + 1000).cast(ts),
        ]
        whole = pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)
        got = _CACHE[(rows, index)] = [whole.slice(i, FLOOR_BATCH) for i in range(0, rows, FLOOR_BATCH)]
    return got


def floor_source(rows: int, partitions: int) -> type:
    """The ``mqorder_floor`` format: ``rows`` rows in ``partitions`` read tasks, nothing read."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from mqorder.spark.reader import SCHEMA_DDL

    class FloorReader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(partitions)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            from mqorder.spark.worker_gc import freeze_imports

            freeze_imports()  # as the reader does: PySpark's per-task collection kept cheap
            share = rows // partitions + (1 if partition.value < rows % partitions else 0)
            yield from _floor_batches(share, partition.value)

    class FloorSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "mqorder_floor"

        def schema(self) -> str:
            return SCHEMA_DDL

        def reader(self, schema: Any) -> DataSourceReader:
            return FloorReader()

    return FloorSource


def _proc_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run(messages: int, rounds: int, master: str) -> dict[str, Any]:
    """Both counts, ``rounds`` times each after a warm-up of each, in one application."""
    import redis

    from mqorder.testing.embedded import RedisServer

    with RedisServer() as srv:
        build_read(srv.url, messages)
        redis_pid = int(redis.Redis.from_url(srv.url).info("server")["process_id"])
        spark = bench_session("mqorder-bench-floor", master)
        try:
            real = spark.read.format("mqorder").option("topic", READ_TOPIC).option("redisUrl", srv.url).load()
            parts = real.rdd.getNumPartitions()
            spark.dataSource.register(floor_source(messages, parts))
            floor = spark.read.format("mqorder_floor").load()
            out: dict[str, Any] = {"messages": messages, "queues": READ_QUEUES, "partitions": parts,
                                   "master": master}
            for name, df in (("mqorder", real), ("floor", floor)):
                df.count()  # warm-up: workers started, modules imported, floor batches built
                out[name] = {"seconds": [], "cpu_seconds": [], "redis_cpu_seconds": []}
            for _ in range(rounds):
                for name, df in (("mqorder", real), ("floor", floor)):
                    c0, r0, t0 = _tree_cpu(), _proc_cpu(redis_pid), time.perf_counter()
                    n = df.count()
                    wall = time.perf_counter() - t0
                    if n != messages:
                        raise SystemExit(f"{name} counted {n} rows, expected {messages}")
                    out[name]["seconds"].append(round(wall, 4))
                    out[name]["cpu_seconds"].append(round(_tree_cpu() - c0, 3))
                    out[name]["redis_cpu_seconds"].append(round(_proc_cpu(redis_pid) - r0, 3))
            for name in ("mqorder", "floor"):
                out[name].update({f"median_{k}": _median(v) for k, v in list(out[name].items())})
            out["mqorder_over_floor"] = out["mqorder"]["median_seconds"] / out["floor"]["median_seconds"]
        finally:
            spark.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        ap.error(f"--messages {args.messages} and --rounds {args.rounds}: give at least 1 of each")
    sys.stdout.write(json.dumps(run(args.messages, args.rounds, args.master)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Jobs a test runs in a driver process of its own (``tests.spark_driver``), on a standalone cluster
or through Spark Connect: the same code for both, so both modes are tested the same way.

Each job takes the session and JSON arguments and returns JSON. ``opts`` are extra options of every
``format("mqorder")`` read and write: ``{}`` on the cluster (the driver's ``MQORDER_REDIS_URL``
names Redis, as the docs say), ``{"redisUrl": ...}`` through Spark Connect (the server's Python
workers plan the job, and they see the server's environment, not the client's). The assertions
are the tests', on what Redis holds afterwards; nothing here is imported by the executors (the
probe's function travels by value).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F


def probe(spark: SparkSession, partitions: int = 4) -> list[dict[str, Any]]:
    """Where the tasks' Python ran: its interpreter, whether it ever imported a test module, and
    the JVM above it (an executor's ``--executor-id``, or the driver)."""

    def where(batches):  # defined here: cloudpickle sends it by value, not as tests.spark_jobs.probe
        import os
        import sys

        import pyarrow as pa

        pid, jvm = os.getpid(), ""
        while pid > 1:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                break
            if "java" in cmd.split(" ", 1)[0]:
                jvm = cmd
                break
            pid = parent
        words = jvm.split()
        executor = words[words.index("--executor-id") + 1] if "--executor-id" in words else "driver"
        for b in batches:
            yield pa.RecordBatch.from_pydict({
                "id": b.column(0),
                "executor": [executor] * b.num_rows,
                "python": [sys.executable] * b.num_rows,
                "tests_imported": [any(m == "tests" or m.startswith("tests.") for m in sys.modules)] * b.num_rows,
                "mqorder_imported": ["mqorder.spark.source" in sys.modules] * b.num_rows,
            })

    df = spark.range(0, partitions * 8, numPartitions=partitions).mapInArrow(
        where, "id long, executor string, python string, tests_imported boolean, mqorder_imported boolean")
    return [r.asDict() for r in df.collect()]


def events(spark: SparkSession, n: int, keys: int, partitions: int = 3) -> DataFrame:
    """``n`` rows ``k<i mod keys>``, ``ts = i``, a JSON body; spread over partitions by a hash, so
    no task gets its rows in order and several tasks hold rows of one key."""
    df = spark.range(0, n, numPartitions=partitions).repartition(partitions, F.col("id") % 5)
    key = F.concat(F.lit("k"), (F.col("id") % keys).cast("string"))
    return df.select(key.alias("k"), F.col("id").alias("ts"),
                     F.to_json(F.struct(key.alias("k"), F.col("id").alias("ts"))).alias("body"))


def write_then_publish(spark: SparkSession, topic: str, n: int, keys: int, opts: dict[str, str]) -> dict[str, Any]:
    """``df.write.format("mqorder")`` (staged, any partitioning), then ``mqorder.spark.publish`` of
    the same rows: the second job finds every id stored."""
    import mqorder.spark

    df = events(spark, n, keys)
    (df.write.format("mqorder").options(**opts).option("topic", topic).option("key", "k").option("orderBy", "ts")
     .option("body", "body").mode("append").save())
    report = mqorder.spark.publish(df, topic, key="k", order_by="ts", body="body", redis_url=opts.get("redisUrl"))
    return asdict(report)


def read(spark: SparkSession, topic: str, opts: dict[str, str], starting: str = "earliest",
         ending: str = "latest") -> list[list[Any]]:
    """A batch read of ``[starting, ending)``: ``[queue, offset, key, body]`` per message."""
    df = (spark.read.format("mqorder").options(**opts).option("topic", topic)
          .option("startingOffsets", starting).option("endingOffsets", ending).load())
    rows = df.select("queue", "offset", "key", F.col("body").cast("string").alias("body")).collect()
    return sorted([r.queue, r.offset, r.key, r.body] for r in rows)


def stream(spark: SparkSession, source: str, sink: str, checkpoint: str, opts: dict[str, str],
           max_per_trigger: int = 0) -> dict[str, Any]:
    """readStream ``source`` → enriched → writeStream ``sink``, ``Trigger.AvailableNow``: every
    message stored when the query starts, once, each key's messages in their source order (the
    source offset orders them; one key lives in one source queue)."""
    # startingOffsets counts only for a new query: a restarted one goes on from its checkpoint.
    reader = (spark.readStream.format("mqorder").options(**opts).option("topic", source)
              .option("startingOffsets", "earliest"))
    if max_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_per_trigger))
    body = F.to_json(F.struct(F.col("key"), F.col("queue").alias("src_queue"), F.col("offset").alias("src_offset"),
                              F.col("body").cast("string").alias("src_body")))
    q = (reader.load().select(F.col("key"), F.col("offset"), body.alias("body"))
         .writeStream.format("mqorder").options(**opts).option("topic", sink).option("key", "key")
         .option("orderBy", "offset").option("body", "body").option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(str(q.exception()))
    rows = [int(p.numInputRows or 0) for p in q.recentProgress]  # the property: Connect's dict may hold None
    return {"batches": sum(1 for n in rows if n), "rows": sum(rows)}


def ledger(spark: SparkSession, group: str, opts: dict[str, str]) -> list[list[Any]]:
    """The group's consumption ledger as a DataFrame: ``[queue, offset, outcome]`` per record."""
    df = spark.read.format("mqorder").options(**opts).option("ledger", group).load()
    return sorted([r.queue, r.offset, r.outcome] for r in df.select("queue", "offset", "outcome").collect())


def bad_write(spark: SparkSession, topic: str, opts: dict[str, str], key: str = "k", null_key_every: int = 0,
              via_publish: bool = False) -> None:
    """A write that must be refused: an unknown topic, a missing key column or null keys."""
    import mqorder.spark

    df = events(spark, 40, 4)
    if null_key_every:
        df = df.withColumn("k", F.when(F.col("ts") % null_key_every == 0, F.lit(None)).otherwise(F.col("k")))
    if via_publish:
        mqorder.spark.publish(df, topic, key=key, order_by="ts", body="body", redis_url=opts.get("redisUrl"))
        return
    (df.write.format("mqorder").options(**opts).option("topic", topic).option("key", key).option("orderBy", "ts")
     .option("body", "body").mode("append").save())


def audit(spark: SparkSession, topic: str, group: str, opts: dict[str, str]) -> dict[str, Any]:
    """``mqorder.spark.audit`` of ``group`` on ``topic``: its report as JSON (``AuditReport.to_json``)."""
    import mqorder.spark

    return mqorder.spark.audit(spark, topic, group, redis_url=opts.get("redisUrl")).to_json()


def timed_publish_and_count(spark: SparkSession, topic: str, n: int, keys: int, body_size: int,
                            opts: dict[str, str], reads: int = 3) -> dict[str, Any]:
    """``bench.spark_modes``: publish ``n`` rows that Spark makes itself (the same rows in every
    mode: ``key-<i mod keys>``, ``ts = i``, a JSON body padded to ``body_size`` bytes) with
    ``mqorder.spark.publish``, then count the topic ``reads`` times. Seconds of each, and what was
    stored and counted (the bench checks them)."""
    import time

    import mqorder.spark
    from mqorder.spark.session import default_parallelism

    key = F.concat(F.lit("key-"), (F.col("id") % keys).cast("string"))
    body = F.rpad(F.to_json(F.struct(key.alias("k"), F.col("id").alias("s"))), body_size, " ")
    df = spark.range(0, n).select(key.alias("k"), F.col("id").alias("ts"), body.alias("body"))
    t0 = time.perf_counter()
    report = mqorder.spark.publish(df, topic, key="k", order_by="ts", body="body", redis_url=opts.get("redisUrl"))
    publish_s = time.perf_counter() - t0
    read_s, counted = [], []
    for _ in range(reads):
        t0 = time.perf_counter()
        counted.append(spark.read.format("mqorder").options(**opts).option("topic", topic).load().count())
        read_s.append(time.perf_counter() - t0)
    return {"publish_s": publish_s, "stored": report.stored, "read_s": read_s, "counted": counted,
            "parallelism": default_parallelism(spark)}

"""mqorder on Apache Spark: the ``mqorder`` PySpark data source.

::

    import mqorder.spark                       # registers "mqorder" on the active session, if any
    mqorder.spark.register(spark)              # or on a given session (idempotent)

    (df.write.format("mqorder").option("topic", "flights").option("key", "tailnum")
       .option("orderBy", "dep_ts").option("body", "json").mode("append").save())
    report = mqorder.spark.publish(df, "flights", key="tailnum", order_by="dep_ts")

    spark.read.format("mqorder").option("topic", "flights").load()
    spark.readStream.format("mqorder").option("topic", "flights").load()
    df.writeStream.format("mqorder").option("topic", "flights")...

Writes are ordered per key and exactly once under task retries, speculation and re-runs, and all
or nothing per job (per micro-batch in a stream); see ``docs/SPARK.md``. This package needs
pyspark (the ``spark`` extra); mqorder's core never imports it.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from mqorder.spark.audit import AuditReport, audit
from mqorder.spark.encoding import Refusal
from mqorder.spark.ledger import LedgerNotFoundError, read_ledger
from mqorder.spark.publish import PublishReport, job_report, publish
from mqorder.spark.queues import queue_of
from mqorder.spark.session import register, session
from mqorder.spark.source import MQOrderDataSource
from mqorder.spark.writer import JobRefusedError

__all__ = [
    "AuditReport",
    "LedgerNotFoundError",
    "JobRefusedError",
    "MQOrderDataSource",
    "PublishReport",
    "Refusal",
    "audit",
    "job_report",
    "publish",
    "queue_of",
    "read_ledger",
    "register",
    "session",
]

_active = SparkSession.getActiveSession()
if _active is not None:
    register(_active)

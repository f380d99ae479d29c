"""``publish(df, topic, key=..., order_by=...)``: the DataFrame → topic path, with its report.

It does what makes the write fast and exactly once for any DataFrame: the key is cast to text
and each row's queue computed in Spark SQL (``pmod(crc32(key), n)``, the producer's queue), rows
are repartitioned on that queue so every queue is staged by exactly one task (one run per queue:
the commit moves it without merging), and the job's commit report is read back from Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pyspark.errors import PySparkException
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import IntegralType, StringType

from mqorder import keys
from mqorder.errors import ConfigError, MessageError, ReplicasBehindError
from mqorder.settings import get_settings, load_settings
from mqorder.spark.errors import mqorder_error
from mqorder.spark.options import BODY_JSON, ON_NULL, reachable
from mqorder.spark.queues import KEY_COLUMN, QUEUE_COLUMN, key_string, queue_of
from mqorder.spark.reader import queue_spans
from mqorder.spark.session import default_parallelism, register
from mqorder.spark.writer import JobRefusedError
from mqorder.store.brokers import BrokerRegistry, check_redis_url
from mqorder.store.replies import text
from mqorder.tokens import new_token


@dataclass(frozen=True)
class PublishReport:
    """What one ``publish`` stored: rows given, rows stored, rows already stored (skipped by id)."""

    job_id: str
    topic: str
    rows: int
    stored: int
    duplicates: int
    skipped_nulls: int
    queues: dict[int, dict[str, Any]] = field(default_factory=dict)
    commit_seconds: float = 0.0


def _columns(df: DataFrame, **named: str | None) -> None:
    cols = df.columns
    lower = {c.lower() for c in cols}
    for role, name in named.items():
        if name is not None and name not in cols and name.lower() not in lower:
            raise ConfigError(f"{role} column {name!r} is not in the DataFrame; its columns are: {', '.join(cols)}")


def publish(
    df: DataFrame,
    topic: str,
    *,
    key: str,
    order_by: str,
    body: str = BODY_JSON,
    id_column: str | None = None,
    on_null: str = "fail",
    redis_url: str | None = None,
    partitions: int | None = None,
    options: dict[str, str] | None = None,
    wait_replicas: int | None = None,
) -> PublishReport:
    """Publish ``df`` to ``topic``, every key's rows in ``order_by`` order, exactly once.

    Raises ``ConfigError`` / ``TopicNotFoundError`` before anything runs, ``JobRefusedError``
    (nothing published) when rows break a rule (null key or orderBy with ``on_null='fail'``, a
    body over ``max_message_size``) or a broker has fewer replicas connected than
    ``wait_replicas`` asks for.

    ``wait_replicas`` (default ``MQORDER_SEND_WAIT_REPLICAS`` of this process, passed to the job as
    option ``waitReplicas`` with the timeout: Spark's processes may not see this environment):
    the commit returns once that many replicas of every broker have the rows, else
    ``ReplicasBehindError`` (published; running it again stores nothing twice and waits again).
    """
    if not isinstance(on_null, str) or on_null.lower() not in ON_NULL:  # any case, as option onNull
        raise ConfigError(f"on_null={on_null!r}: choose fail or skip")
    on_null = on_null.lower()
    _columns(df, key=key, orderBy=order_by, idColumn=id_column,
             body=None if body.lower() == BODY_JSON and body not in df.columns else body)
    if partitions is not None and (isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1):
        # 0 meant the default and -1 reached Spark's repartition as a JVM error.
        raise ConfigError(f"partitions={partitions!r}: give a whole number >= 1 (write tasks; each queue is "
                          "written by one of them), or leave it out for the default")
    if redis_url:
        check_redis_url(redis_url, "redis_url")  # its own name, not MQORDER_REDIS_URL's
    settings = load_settings(redis_url=redis_url) if redis_url else get_settings()
    with reachable("publish"):
        brokers = BrokerRegistry(settings.redis_url, settings.brokers)
        try:
            count = len(queue_spans(brokers, topic))  # TopicNotFoundError says how to create it
        finally:
            brokers.close()
    spark = register(df.sparkSession)

    key = next((c for c in df.columns if c == key), None) or next(c for c in df.columns if c.lower() == key.lower())
    key_type = df.schema[key].dataType
    key_col = key
    if not isinstance(key_type, (StringType, IntegralType)):
        df = df.withColumn(KEY_COLUMN, key_string(key))
        key_col = KEY_COLUMN
    df = df.withColumn(QUEUE_COLUMN, queue_of(F.col(key_col), count))
    n = partitions if partitions is not None else min(count, max(2, default_parallelism(spark) * 2))
    df = df.repartition(n, QUEUE_COLUMN)

    job = new_token()
    writer = (df.write.format("mqorder").mode("append")
              .option("topic", topic).option("key", key_col).option("orderBy", order_by).option("body", body)
              .option("onNull", on_null).option("redisUrl", settings.redis_url).option("jobId", job))
    if settings.brokers:
        writer = writer.option("brokers", json.dumps(settings.brokers))
    if id_column:
        writer = writer.option("idColumn", id_column)
    writer = (writer.option("waitReplicas", str(settings.send_wait_replicas if wait_replicas is None else wait_replicas))
              .option("waitTimeoutMs", str(settings.send_wait_timeout_ms)))
    for k, v in (options or {}).items():
        writer = writer.option(k, v)
    try:
        writer.save()
    except PySparkException as exc:
        report = _report(settings.redis_url, settings.brokers, job)
        if report.get("status") == "refused":
            error = str(report.get("error"))
            if key_col != key:  # the job's key is a string copy of the caller's column: name theirs
                error = error.replace(repr(key_col), repr(key))
            raise JobRefusedError(error) from None
        if report.get("status") == "unreplicated":  # option waitReplicas: published, not yet on the replicas
            raise ReplicasBehindError(str(report.get("error"))) from None
        ours = mqorder_error(exc)  # a check in Spark's Python workers: the same error as a local call
        if ours is not None:
            raise ours from exc
        raise exc
    report = _report(settings.redis_url, settings.brokers, job)
    if report.get("status") != "published":
        raise MessageError(f"publish job {job} ended with status {report.get('status')!r}: {report}")
    return PublishReport(
        job_id=job,
        topic=topic,
        rows=int(report.get("rows", 0)),
        stored=int(report.get("stored", 0)),
        duplicates=int(report.get("duplicates", 0)),
        skipped_nulls=int(report.get("skipped_nulls", 0)),
        queues={int(k): v for k, v in report.get("queues", {}).items()},
        commit_seconds=float(report.get("commit_seconds", 0.0)),
    )


def job_report(job: str, redis_url: str | None = None) -> dict[str, Any]:
    """The stored report of write job ``job`` (``{}`` if none, e.g. a job with no rows at all)."""
    settings = load_settings(redis_url=redis_url) if redis_url else get_settings()
    return _report(settings.redis_url, settings.brokers, job)


def _report(url: str, extra: dict[str, str], job: str) -> dict[str, Any]:
    brokers = BrokerRegistry(url, extra)
    try:
        raw = brokers.meta.hgetall(keys.spark_job(job))
    finally:
        brokers.close()
    return {text(k): json.loads(v) for k, v in raw.items()}

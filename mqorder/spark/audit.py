"""The ordering audit: what a consumer group really did to a topic, rebuilt from its ledger.

``audit(spark, topic, group)`` joins three sources, read in this order on purpose:

1. from Redis, each queue's committed offset and next offset (read first: every message below a
   committed offset was handled before the ledger is read, so its record is there);
2. the group's consumption ledger (``format("mqorder").option("ledger", group)``);
3. the topic's stored messages (``format("mqorder").option("topic", topic)``), and the group's
   dead letters (``%DLQ%<group>``, by their ``ORIGIN_*`` properties).

One row per message, then Spark window functions over each *lane* — a key within its queue
(``ordering="key"``, the default; keyless messages of a queue form one lane), or the whole queue
(``ordering="queue"``) — ordered by each message's first delivery:

- **order violation**: a message first delivered after a later offset of its lane had been;
- **gap**: stored, never SUCCESS nor dead-lettered, and passed over: below the group's committed
  offset, or below an offset of its lane that succeeded (what is merely not consumed yet is
  *pending*, counted with the lag);
- **duplicate**: handled with SUCCESS more than once; a *redelivery after an epoch change* (the
  successes carry different fencing epochs: a failover redelivered what the old owner had not
  committed, which at-least-once allows) or *other* (one epoch: nothing explains it);
- **domain order** (``order_field``): the JSON field of the bodies must not go down along a lane;
- latency born → handled (the start of the call that settled it: SUCCESS or DLQ) p50/p95/p99 per
  queue and overall, throughput over time, lag per queue.

An audit passes (``AuditReport.ok``) when it finds no order violation (of offsets or of the domain
field) and no gap. Duplicates are reported, not failed: a failover may redeliver by design.
A ledger Redis has trimmed (``MQORDER_LEDGER_MAX_LEN``) has lost its oldest records: the gap check
then starts, per queue, at the lowest offset the ledger still holds (``unaudited`` counts the rest).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mqorder import keys
from mqorder.errors import ConfigError, TopicNotFoundError
from mqorder.names import check_name, check_topic
from mqorder.settings import Settings, get_settings, load_settings
from mqorder.spark import audit_frames as frames
from mqorder.spark.audit_model import AuditReport, QueueInfo
from mqorder.spark.ledger import LedgerNotFoundError, ledger_streams, no_ledger_hint
from mqorder.spark.session import register
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager

__all__ = ["AuditReport", "audit"]

ORDERINGS = ("key", "queue")
#: At most this many cases of each kind are listed in a report (their counts are always exact).
DEFAULT_MAX_LISTED = 1000


def queue_infos(brokers: BrokerRegistry, topic: str, group: str) -> list[QueueInfo]:
    """Each queue's next offset and the group's committed offset, straight from Redis."""
    route = TopicManager(brokers).describe_topic(topic)
    log = MessageLog(brokers)
    return [QueueInfo(i, mq.broker_name, mq.queue_id, log.max_offset(mq), log.consume_offset(group, mq))
            for i, mq in enumerate(route.message_queues)]


def _load(spark: SparkSession, settings: Settings, **options: str) -> DataFrame:
    # Executors may not see the driver's environment: name the Redis explicitly.
    conn = {"redisUrl": settings.redis_url}
    if settings.brokers:
        conn["brokers"] = json.dumps(settings.brokers)
    return spark.read.format("mqorder").options(**conn, **options).load()


def _stored(spark: SparkSession, settings: Settings, topic: str, order_field: str | None) -> DataFrame:
    cols = [F.col("queue").alias("qi"), "offset", F.col("key").alias("s_key"), F.col("msg_id").alias("s_msg_id")]
    if order_field:
        path = "$['" + order_field.replace("\\", "\\\\").replace("'", "\\'") + "']"
        cols.append(F.get_json_object(F.col("body").cast("string"), path).alias("field_value"))
    return _load(spark, settings, topic=topic).select(*cols).withColumn("stored", F.lit(True))


def _dead_letters(spark: SparkSession, settings: Settings, brokers: BrokerRegistry, topic: str, group: str,
                  route: DataFrame) -> DataFrame | None:
    """(qi, offset) of the group's dead letters that came from ``topic``; None without a DLQ topic."""
    dlq_topic = keys.dlq_topic(group)
    try:
        TopicManager(brokers).describe_topic(dlq_topic)
    except TopicNotFoundError:
        return None
    p = F.col("properties")
    origins = (_load(spark, settings, topic=dlq_topic)
               .where(p["ORIGIN_TOPIC"] == topic)
               .select(p["ORIGIN_BROKER"].alias("broker"), p["ORIGIN_QUEUE_ID"].cast("int").alias("queue_id"),
                       p["ORIGIN_QUEUE_OFFSET"].cast("long").alias("offset"))
               .join(route.select("qi", "broker", "queue_id"), ["broker", "queue_id"])
               .select("qi", "offset").distinct().withColumn("in_dlq", F.lit(True)))
    return F.broadcast(origins)


def audit(
    spark: SparkSession,
    topic: str,
    group: str,
    *,
    order_field: str | None = None,
    ordering: str = "key",
    report_dir: str | Path | None = None,
    redis_url: str | None = None,
    max_listed: int = DEFAULT_MAX_LISTED,
) -> AuditReport:
    """Audit how ``group`` consumed ``topic``; with ``report_dir``, also write ``report.json``,
    ``report.md`` and the PNG plots there.

    Raises ``TopicNotFoundError``, ``LedgerNotFoundError`` (saying how to switch the ledger on) or
    ``BrokerUnavailableError`` before any Spark job runs.
    """
    check_topic(topic)
    check_name("group", group)
    if ordering not in ORDERINGS:
        raise ConfigError(f"ordering={ordering!r}: choose key (order per sharding key) or queue (per whole queue)")
    if order_field is not None and not order_field:
        raise ConfigError("order_field must name a field of the JSON bodies")
    settings = load_settings(redis_url=redis_url) if redis_url else get_settings()
    spark = register(spark)
    report = AuditReport(topic, group, ordering, order_field, int(time.time() * 1000))
    t_start = time.perf_counter()

    brokers = BrokerRegistry(settings.redis_url, settings.brokers)
    try:
        brokers.default.ping()
        infos = queue_infos(brokers, topic, group)  # before the ledger: see the module docstring
        streams = ledger_streams(brokers, group)
        if not streams:
            raise LedgerNotFoundError(no_ledger_hint(group))
        report.ledger_trimmed = sum(s.trimmed for s in streams)
        route = frames.route_frame(spark, infos, {})
        folded = frames.delivered(_load(spark, settings, ledger=group, topic=topic), route)
        start_at = frames.audit_from(folded, streams, infos)
        if start_at:
            route = frames.route_frame(spark, infos, start_at)
        stored = _stored(spark, settings, topic, order_field)
        dead = _dead_letters(spark, settings, brokers, topic, group, route)
    finally:
        brokers.close()

    m = frames.messages(folded, stored, dead, route, ordering, order_field).persist()
    try:
        overall = frames.summary(m, infos, report)
        frames.series(m, overall, report)
        frames.listed(m, report, max_listed)
    finally:
        m.unpersist()
    report.seconds = round(time.perf_counter() - t_start, 3)
    if report_dir is not None:
        from mqorder.spark.audit_report import write_report

        write_report(report, Path(report_dir))
    return report

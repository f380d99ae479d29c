"""The ordering audit: what a consumer group really did to a topic, rebuilt from its ledger.

``audit(spark, topic, group)`` joins three sources, read in this order on purpose:

1. from Redis, each queue's first stored, next and committed offsets (read first: every message
   below a committed offset was handled before the ledger is read, so its record is there);
2. the group's consumption ledger (``format("mqorder").option("ledger", group)``) and its dead
   letters (``%DLQ%<group>``, by their ``ORIGIN_*`` properties);
3. only if needed (``audit_frames``: phase 2), the stored messages themselves (queue, offset, key:
   ``stored_index``, a light read of the topic).

One row per message, then Spark window functions over each *lane* — a sharding key within its queue
(``ordering="key"``, the default: by the key's hash, what a key-ordered listener orders by; keyless
messages of a queue form one lane), or the whole queue
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
The gap check starts at each queue's first stored message (``start="stored"``), or at the first
offset the ledger records for it (``start="ledger"``: for a ledger switched on after consumption
began, and forced when Redis trimmed the ledger, ``MQORDER_LEDGER_MAX_LEN``); what lies below is
counted as ``unaudited``, never as a gap.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from mqorder import keys
from mqorder.errors import ConfigError, TopicNotFoundError
from mqorder.model import MessageQueue
from mqorder.names import check_name, check_topic
from mqorder.settings import Settings, get_settings, load_settings
from mqorder.spark import audit_frames as frames
from mqorder.spark.audit_model import AuditReport, Gap, QueueInfo
from mqorder.spark.ledger import LedgerNotFoundError, ledger_streams, no_ledger_hint
from mqorder.spark.reader import SCHEMA_DDL as TOPIC_SCHEMA
from mqorder.spark.session import default_parallelism, register
from mqorder.spark.stored_index import FORMAT as INDEX_FORMAT
from mqorder.spark.stored_index import SCHEMA_DDL as INDEX_SCHEMA
from mqorder.spark.stored_index import register_index
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager

__all__ = ["AuditReport", "audit"]

ORDERINGS = ("key", "queue")
STARTS = ("stored", "ledger")
#: At most this many cases of each kind are listed in a report (their counts are always exact).
DEFAULT_MAX_LISTED = 1000


def queue_infos(brokers: BrokerRegistry, topic: str, group: str) -> list[QueueInfo]:
    """Each queue's next offset and the group's committed offset, straight from Redis."""
    route = TopicManager(brokers).describe_topic(topic)
    log = MessageLog(brokers)
    return [QueueInfo(i, mq.broker_name, mq.queue_id, log.max_offset(mq), log.consume_offset(group, mq),
                      log.min_offset(mq)) for i, mq in enumerate(route.message_queues)]


def _load(spark: SparkSession, settings: Settings, schema: str, fmt: str = "mqorder", **options: str) -> DataFrame:
    """A read of ``fmt`` with its schema given: Spark then starts no Python process to ask for it."""
    conn = {"redisUrl": settings.redis_url}  # executors may not see the driver's environment
    if settings.brokers:
        conn["brokers"] = json.dumps(settings.brokers)
    return spark.read.format(fmt).schema(schema).options(**conn, **options).load()


def _max_size(settings: Settings) -> str:
    """The driver's ``max_message_size`` for a topic read: it sizes the read's first page, and the
    process that plans the read (a Connect server, say) may not have the driver's environment."""
    return str(settings.max_message_size)


def _stored(spark: SparkSession, settings: Settings, topic: str, order_field: str | None) -> DataFrame:
    """(qi, offset, key, msg id, order field) of every stored message: the audit's own light read
    (``stored_index``), not the full topic read that would move every body into the JVM."""
    extra = {"orderField": order_field} if order_field else {}
    return _load(register_index(spark), settings, INDEX_SCHEMA, INDEX_FORMAT, topic=topic,
                 minPartitions=str(default_parallelism(spark)), maxMessageSize=_max_size(settings), **extra)


def _dead_letters(spark: SparkSession, settings: Settings, brokers: BrokerRegistry, topic: str, group: str,
                  route: frames.Route) -> DataFrame | None:
    """(qi, offset) of the group's dead letters that came from ``topic``; None without a DLQ topic."""
    dlq_topic = keys.dlq_topic(group)
    try:
        TopicManager(brokers).describe_topic(dlq_topic)
    except TopicNotFoundError:
        return None
    p = F.col("properties")
    origins = (_load(spark, settings, TOPIC_SCHEMA, topic=dlq_topic, maxMessageSize=_max_size(settings))
               .where(p["ORIGIN_TOPIC"] == topic)
               .select(F.expr(route.index_sql("properties['ORIGIN_BROKER']",
                                               "CAST(properties['ORIGIN_QUEUE_ID'] AS INT)")).alias("qi"),
                       p["ORIGIN_QUEUE_OFFSET"].cast("long").alias("offset"))
               .where(F.col("qi").isNotNull()).distinct().withColumn("in_dlq", F.lit(True)))
    return F.broadcast(origins)


def _with_msg_ids(brokers: BrokerRegistry, topic: str, infos: list[QueueInfo], gaps: list[Gap]) -> list[Gap]:
    """The listed gaps with their message ids, read from the log (the audit's Spark side carries none:
    a string column would cost its fold the fast hash aggregation)."""
    if not gaps:
        return gaps
    log = MessageLog(brokers)
    out = []
    for g in gaps:
        q = infos[g.queue]
        found = log.read(MessageQueue(topic, q.broker, q.queue_id), g.offset, 1)
        msg_id = found[0].msg_id if found and found[0].queue_offset == g.offset else None
        out.append(replace(g, msg_id=msg_id if isinstance(msg_id, str) else None))
    return out


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
    start: str = "stored",
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
    if start not in STARTS:
        raise ConfigError(f"start={start!r}: choose stored (check from each queue's first stored message) or ledger "
                          "(from the first offset the ledger records, for a ledger switched on after consumption began)")
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
        key_lanes = report.key_lanes = "key_hash" if all(s.key_hashed for s in streams) else "first_key"
        start_mode = "ledger" if start == "ledger" or report.ledger_trimmed else "stored"
        report.start = start_mode
        route = frames.Route.of(infos)
        cores = default_parallelism(spark)
        recs = frames.records(_load(spark, settings, frames.LEDGER_COLUMNS, ledger=group, topic=topic,
                                    minPartitions=str(cores)), route, key_lanes)
        dead = _dead_letters(spark, settings, brokers, topic, group, route)
        bucket_ms = frames.throughput_bucket_ms(streams)
        parts = frames.lane_partitions(cores, sum(s.length for s in streams),
                                       int(spark.conf.get("spark.sql.shuffle.partitions") or 200))

        # Phase 1: the ledger alone (see audit_frames). A body field needs the stored messages
        # anyway: then phase 1 runs only when the audit start depends on the ledger's first offsets.
        extents: dict[int, frames.Extent] = {}
        done = False
        # Not cached: a clean ledger (the usual case) is read by the summary's one job and never
        # again, and building the cache cost a quarter of that audit's CPU; an audit with findings
        # to list reads the ledger a second time instead.
        if order_field is None or start_mode == "ledger":
            m = frames.messages(recs, None, dead, route, ordering, None, bucket_ms, parts, key_lanes)
            extents = frames.summary(m, infos, report, bucket_ms)
            counts = {q.index: frames.unseen(q, extents.get(q.index, frames.Extent()), start_mode) for q in infos}
            done = order_field is None and not any(u.gaps or u.holes for u in counts.values())
            if done:
                frames.settle_unseen(report, infos, counts)
                frames.listed(m, report, max_listed)

        if not done:  # Phase 2: the stored messages too, each one classified.
            report = AuditReport(topic, group, ordering, order_field, report.started_at_ms, start=start_mode,
                                 read_stored=True, ledger_trimmed=report.ledger_trimmed, key_lanes=key_lanes)
            starts = {q.index: frames.audit_start(q, extents.get(q.index, frames.Extent()), start_mode) for q in infos}
            route = frames.Route.of(infos, starts)
            stored = _stored(spark, settings, topic, order_field)
            m = frames.messages(recs, stored, dead, route, ordering, order_field, bucket_ms, parts, key_lanes).persist()
            try:
                frames.summary(m, infos, report, bucket_ms)
                frames.listed(m, report, max_listed)
            finally:
                m.unpersist()
        report.gaps = _with_msg_ids(brokers, topic, infos, report.gaps)
    finally:
        brokers.close()
    report.seconds = round(time.perf_counter() - t_start, 3)
    if report_dir is not None:
        from mqorder.spark.audit_report import write_report

        write_report(report, Path(report_dir))
    return report

"""The audit's Spark side: one row per message, window functions per lane, and the report's numbers.

A *lane* is what must stay in order: a sharding key within its queue (``ordering="key"``; the
keyless messages of a queue form one lane) or the whole queue (``ordering="queue"``). Within a lane
messages are ranked by their first delivery (its ``start_ms``; the offset breaks ties, as the
messages of one batched call share a start).

The per-message table is cached and read by exactly three jobs, because on a small machine each
Spark job costs about a second however little it reads: ``summary`` (a ``rollup`` gives every
queue's counts and percentiles and the overall ones at once), ``series`` (latency histogram and
throughput buckets, one union) and ``listed`` (every kind of finding, ``max_listed`` of each).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from mqorder.spark.audit_model import (
    AuditReport,
    DomainViolation,
    Duplicate,
    Gap,
    Latency,
    OrderViolation,
    QueueInfo,
    QueueStats,
)
from mqorder.spark.ledger import LedgerStream

#: Throughput is counted in at most about this many time buckets (of whole seconds).
THROUGHPUT_BUCKETS = 200
#: Bins of the latency histogram, log-spaced between the smallest and the largest latency.
LATENCY_BINS = 40
PERCENTILES = (0.5, 0.95, 0.99)


def route_frame(spark: SparkSession, infos: Sequence[QueueInfo], audit_from: dict[int, int]) -> DataFrame:
    """The topic's queues (index, broker, id, committed offset, where the gap check starts), broadcast."""
    rows = [(q.index, q.broker, q.queue_id, q.committed, audit_from.get(q.index, 0)) for q in infos]
    schema = "qi INT, broker STRING, queue_id INT, committed BIGINT, audit_from BIGINT"
    return F.broadcast(spark.createDataFrame(rows, schema))


def delivered(ledger: DataFrame, route: DataFrame) -> DataFrame:
    """One row per delivered message, its records folded; records that are not the engine's (or of
    a queue not in the route) fold into one row with a null ``qi``, counted as malformed."""
    ok, dlq = F.col("outcome") == "SUCCESS", F.col("outcome") == "DLQ"
    bad = F.col("outcome").isNull() | F.col("offset").isNull() | F.col("queue").isNull() | F.col("broker").isNull()
    recs = (ledger.withColumn("bad", bad)
            .select(*(F.when(~F.col("bad"), F.col(c)).alias(c) for c in ("broker", "queue", "offset")),
                    "outcome", "start_ms", "end_ms", "epoch", "key", "born_ms", "msg_id")
            .withColumnRenamed("queue", "queue_id"))
    folded = recs.groupBy("broker", "queue_id", "offset").agg(
        F.count(F.lit(1)).alias("records"),
        F.min("start_ms").alias("first_start"),
        F.sum(ok.cast("int")).alias("successes"),
        F.sum(dlq.cast("int")).alias("dlq_records"),
        F.array_sort(F.collect_set(F.when(ok, F.col("epoch")))).alias("success_epochs"),
        F.min(F.when(ok | dlq, F.col("start_ms"))).alias("settle_start"),
        F.min(F.when(ok, F.col("end_ms"))).alias("success_end"),
        F.max("key").alias("d_key"),
        F.max("born_ms").alias("born_ms"),
        F.max("msg_id").alias("d_msg_id"),
    )
    return folded.join(route.select("qi", "broker", "queue_id"), ["broker", "queue_id"], "left").drop("broker", "queue_id")


def audit_from(folded: DataFrame, streams: Sequence[LedgerStream], infos: Sequence[QueueInfo]) -> dict[int, int]:
    """Where the gap check starts per queue: 0, or on a broker whose ledger Redis trimmed, the lowest
    offset of the queue the ledger still holds (what lies below lost its records, not its handling)."""
    trimmed = {s.broker for s in streams if s.trimmed}
    if not trimmed:
        return {}
    lows = {r["qi"]: int(r["low"]) for r in folded.where(F.col("qi").isNotNull()).groupBy("qi")
            .agg(F.min("offset").alias("low")).collect()}
    return {q.index: lows.get(q.index, q.max_offset) for q in infos if q.broker in trimmed}


def _lane(ordering: str) -> Column:
    if ordering == "queue":
        return F.lit(None).cast("string")
    key = F.col("key")
    return F.when(key.isNotNull() & (key != ""), key)


def messages(folded: DataFrame, stored: DataFrame, dead: DataFrame | None, route: DataFrame,
             ordering: str, order_field: str | None) -> DataFrame:
    """Every message (stored, delivered, or both) with the flags the report counts."""
    m = stored.join(folded, ["qi", "offset"], "full")
    m = m.join(dead, ["qi", "offset"], "left") if dead is not None else m.withColumn("in_dlq", F.lit(None).cast("boolean"))
    m = (m.join(route.select("qi", "committed", "audit_from"), "qi", "left")
         .withColumn("key", F.coalesce("s_key", "d_key"))
         .withColumn("msg_id", F.coalesce("s_msg_id", "d_msg_id"))
         .withColumn("stored", F.coalesce("stored", F.lit(False)))
         .withColumn("successes", F.coalesce("successes", F.lit(0)))
         .withColumn("dlq_records", F.coalesce("dlq_records", F.lit(0)))
         .withColumn("lane", _lane(ordering)))

    was_delivered = F.col("first_start").isNotNull()
    earlier = (Window.partitionBy("qi", "lane").orderBy(F.col("first_start").asc_nulls_last(), F.col("offset"))
               .rowsBetween(Window.unboundedPreceding, -1))
    lane = Window.partitionBy("qi", "lane")
    m = (m.withColumn("after_offset", F.max(F.when(was_delivered, F.col("offset"))).over(earlier))
         .withColumn("violation", was_delivered & F.coalesce(F.col("offset") < F.col("after_offset"), F.lit(False)))
         .withColumn("lane_success", F.max(F.when(F.col("successes") > 0, F.col("offset"))).over(lane)))

    accounted = (F.col("successes") > 0) | (F.col("dlq_records") > 0) | F.coalesce("in_dlq", F.lit(False))
    unsettled = F.col("stored") & ~accounted
    below_commit = F.col("offset") < F.col("committed")
    passed = F.coalesce(F.col("offset") < F.col("lane_success"), F.lit(False))
    audited = F.col("offset") >= F.col("audit_from")
    m = (m.withColumn("gap", unsettled & audited & (below_commit | passed))
         .withColumn("gap_reason", F.when(below_commit, F.concat(F.lit("below the committed offset "), F.col("committed")))
                     .otherwise(F.concat(F.lit("offset "), F.col("lane_success"), F.lit(" of its "),
                                         F.when(F.col("lane").isNull(), "queue").otherwise("key"), F.lit(" succeeded"))))
         .withColumn("pending", unsettled & audited & ~(below_commit | passed))
         .withColumn("unaudited", unsettled & ~audited)
         .withColumn("dead", (F.col("dlq_records") > 0) | F.coalesce("in_dlq", F.lit(False)))
         .withColumn("dup_kind", F.when(F.col("successes") > 1,
                                        F.when(F.size("success_epochs") > 1, "epoch_change").otherwise("same_epoch")))
         .withColumn("latency_ms", F.col("settle_start") - F.col("born_ms")))
    if not order_field:
        return m.withColumn("domain_violation", F.lit(False)).withColumn("missing_field", F.lit(False))
    # Numbers compare as numbers, anything else as text: struct(num, str) orders exactly so.
    v = F.col("field_value")
    m = m.withColumn("field", F.when(v.isNotNull(), F.struct(v.cast("double").alias("num"), v.alias("str"),
                                                              F.col("offset").alias("off"))))
    m = m.withColumn("after_field", F.max(F.when(was_delivered, F.col("field"))).over(earlier))
    below = F.struct("field.num", "field.str") < F.struct("after_field.num", "after_field.str")
    return (m.withColumn("domain_violation", was_delivered & v.isNotNull() & F.coalesce(below, F.lit(False)))
            .withColumn("missing_field", F.col("stored") & v.isNull()))


# -- summary: per queue and overall in one job ----------------------------------------------------


def _n(c: Column) -> Column:
    return F.sum(c.cast("int"))


def _aggregates() -> list[Column]:
    lat = F.col("latency_ms")
    return [
        _n(F.col("stored")).alias("stored"),
        _n(F.col("first_start").isNotNull()).alias("delivered"),
        _n(F.col("successes") > 0).alias("succeeded"),
        _n(F.col("dead")).alias("dead_lettered"),
        _n(F.col("pending")).alias("pending"),
        _n(F.col("unaudited")).alias("unaudited"),
        _n(F.col("violation")).alias("violations"),
        _n(F.col("gap")).alias("gaps"),
        _n(F.col("dup_kind") == "epoch_change").alias("dup_epoch"),
        _n(F.col("dup_kind") == "same_epoch").alias("dup_other"),
        _n(F.col("domain_violation")).alias("domain_violations"),
        _n(F.col("missing_field")).alias("missing_field"),
        F.count(lat).alias("lat_n"),
        F.percentile_approx(lat, list(PERCENTILES), 10000).alias("lat_ps"),
        F.max(lat).alias("lat_max"),
        F.min(lat).alias("lat_min"),
        F.sum("records").alias("records"),
        F.min("success_end").alias("t0"),
        F.max("success_end").alias("t1"),
    ]


def _latency(r: Any) -> Latency:
    ps = r["lat_ps"] or [None] * len(PERCENTILES)
    return Latency(int(r["lat_n"] or 0), *(None if p is None else round(float(p), 3) for p in ps),
                   None if r["lat_max"] is None else round(float(r["lat_max"]), 3))


def _i(r: Any, name: str) -> int:
    return int(r[name] or 0) if r is not None else 0


def summary(m: DataFrame, infos: Sequence[QueueInfo], report: AuditReport) -> Any:
    """Fill the report's per-queue stats and totals; returns the overall row (ranges for ``series``).

    Rows with a null ``qi`` are records that match no queue of the route (malformed).
    """
    rows = m.rollup("qi").agg(*_aggregates(), F.grouping("qi").alias("total")).collect()
    by_queue = {r["qi"]: r for r in rows if not r["total"]}
    overall = next(r for r in rows if r["total"])
    report.malformed_records = _i(by_queue.get(None), "records")
    report.queues = []
    for q in infos:
        r = by_queue.get(q.index)
        report.queues.append(QueueStats(
            q.index, q.broker, q.queue_id, _i(r, "stored"), _i(r, "delivered"), _i(r, "succeeded"),
            _i(r, "dead_lettered"), _i(r, "pending"), _i(r, "unaudited"), q.max_offset, q.committed, q.lag,
            _i(r, "violations"), _i(r, "gaps"), _i(r, "dup_epoch"), _i(r, "dup_other"), _i(r, "domain_violations"),
            _latency(r) if r is not None else Latency(0, None, None, None, None)))
    qs = report.queues
    report.ledger_records = _i(overall, "records")
    report.messages_stored = sum(q.stored for q in qs)
    report.messages_delivered = sum(q.delivered for q in qs)
    report.messages_succeeded = sum(q.succeeded for q in qs)
    report.messages_dead_lettered = sum(q.dead_lettered for q in qs)
    report.pending = sum(q.pending for q in qs)
    report.unaudited = sum(q.unaudited for q in qs)
    report.violation_count = sum(q.violations for q in qs)
    report.gap_count = sum(q.gaps for q in qs)
    report.duplicates_epoch_change = sum(q.duplicates_epoch_change for q in qs)
    report.duplicates_other = sum(q.duplicates_other for q in qs)
    report.domain_violation_count = sum(q.domain_violations for q in qs)
    report.missing_order_field = _i(overall, "missing_field")
    # Percentiles do not add up over queues: the overall ones come from the rollup's total row,
    # which also counts the malformed group (it has no latency, so it changes nothing there).
    report.latency = _latency(overall)
    return overall


# -- series: latency histogram and throughput in one job ------------------------------------------


def series(m: DataFrame, overall: Any, report: AuditReport) -> None:
    """Latency bins (log-spaced, min to max) and messages per throughput bucket (first SUCCESS end)."""
    parts = []
    lo = hi = a = step = None
    if overall["lat_min"] is not None:
        lo, hi = max(float(overall["lat_min"]), 0.01), max(float(overall["lat_max"]), 0.02)
        hi = hi if hi > lo else lo * 2
        a, step = math.log10(lo), (math.log10(hi) - math.log10(lo)) / LATENCY_BINS
        lat = F.greatest(F.col("latency_ms"), F.lit(lo))
        b = F.least(F.floor((F.log10(lat) - F.lit(a)) / F.lit(step)), F.lit(LATENCY_BINS - 1)).cast("long")
        parts.append(m.where(F.col("latency_ms").isNotNull()).groupBy(F.lit("lat").alias("kind"), b.alias("k")).count())
    width = 1000
    if overall["t0"] is not None:
        span_s = max(1.0, (float(overall["t1"]) - float(overall["t0"])) / 1000)
        report.throughput_bucket_s = max(1, math.ceil(span_s / THROUGHPUT_BUCKETS))
        width = report.throughput_bucket_s * 1000
        t = (F.floor(F.col("success_end") / F.lit(width)) * F.lit(width)).cast("long")
        parts.append(m.where(F.col("success_end").isNotNull()).groupBy(F.lit("tp").alias("kind"), t.alias("k")).count())
    if not parts:
        return
    union = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])
    rows = union.collect()
    if a is not None and step is not None:
        counts = {r["k"]: r["count"] for r in rows if r["kind"] == "lat"}
        report.latency_histogram = [(round(10 ** (a + i * step), 3), round(10 ** (a + (i + 1) * step), 3),
                                     int(counts.get(i, 0))) for i in range(LATENCY_BINS)]
    report.throughput = sorted((int(r["k"]), int(r["count"])) for r in rows if r["kind"] == "tp")


# -- listed: every kind of finding in one job -----------------------------------------------------


def listed(m: DataFrame, report: AuditReport, limit: int) -> None:
    """The first ``limit`` cases of each kind, by queue and offset."""
    kinds = {"violation": report.violation_count, "gap": report.gap_count,
             "dup": report.duplicates_epoch_change + report.duplicates_other,
             "domain": report.domain_violation_count}
    flags = {"violation": F.col("violation"), "gap": F.col("gap"), "dup": F.col("dup_kind").isNotNull(),
             "domain": F.col("domain_violation")}
    wanted = [k for k, n in kinds.items() if n]
    if not wanted:
        return
    cols = ["key", "qi", "offset", "after_offset", "first_start", "msg_id", "gap_reason", "successes",
            "success_epochs", "dup_kind"]
    if report.order_field:
        cols += ["field_value", "after_field"]
    tagged = m.where(reduce(operator.or_, (flags[k] for k in wanted))).select(
        *cols, F.explode(F.array_compact(F.array(*(F.when(flags[k], F.lit(k)) for k in wanted)))).alias("kind"))
    rank = F.row_number().over(Window.partitionBy("kind").orderBy("qi", "offset"))
    rows = tagged.withColumn("rank", rank).where(F.col("rank") <= limit).orderBy("kind", "qi", "offset").collect()
    for r in rows:
        if r.kind == "violation":
            report.violations.append(OrderViolation(r.key, r.qi, r.offset, r.after_offset, round(r.first_start, 3)))
        elif r.kind == "gap":
            report.gaps.append(Gap(r.key, r.qi, r.offset, r.msg_id, r.gap_reason))
        elif r.kind == "dup":
            report.duplicates.append(Duplicate(r.key, r.qi, r.offset, r.successes, list(r.success_epochs), r.dup_kind))
        else:
            report.domain_violations.append(DomainViolation(r.key, r.qi, r.offset, r.field_value, r.after_field.off,
                                                            r.after_field.str))

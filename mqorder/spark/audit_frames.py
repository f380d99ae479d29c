"""The audit's Spark side: one row per message, window functions per lane, and the report's numbers.

A *lane* is what must stay in order: a sharding key within its queue (``ordering="key"``; the
keyless messages of a queue form one lane) or the whole queue (``ordering="queue"``). Within a lane
messages are ranked by their first delivery (its ``start_ms``; the offset breaks ties, as the
messages of one batched call share a start).

Built for a million records on two cores, where every Python row, shuffle, sort and job counts:

- **phase 1 reads only the ledger.** Stored messages are offsets ``[earliest, next)`` per queue,
  so those the ledger never mentions are *counted* by subtraction (``unseen``): how many lie below
  the committed offset (gaps), between delivered offsets (holes: a gap or pending, by their key),
  or past the last delivered one (pending). A healthy audit ends here;
- **phase 2** (only when something must be named, or for a body field) also reads the stored
  messages (``stored_index``) and folds them in, so each one is classified by its lane;
- ledger records (and stored messages) are shuffled **once**, by lane; the fold to one row per
  message groups by (lane, offset) and the windows partition by lane, so neither shuffles again.
  Every aggregate has a fixed-width buffer (counts, sums, min/max of numbers), which keeps Spark on
  its hash aggregation (a string ``max`` or a ``collect_set`` would make it sort);
- percentiles come from log-spaced latency bins 1 % wide (``BIN_RATIO``), counted per queue in the
  same job as the per-queue totals and the throughput buckets (``summary``, one ``groupingSets``);
  ``listed`` runs only if something was found (phase 2 caches the message table for it; phase 1
  does not: a clean ledger is then read once, and one with findings twice).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame, Window
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
#: Latency bins are ``[BIN_RATIO**i, BIN_RATIO**(i+1))`` ms: a percentile is exact to 1 %.
BIN_RATIO = 1.01
#: Latencies below this (or negative: a producer clock ahead of the consumer's) count in its bin.
MIN_LATENCY_MS = 0.001
#: Bars of the latency histogram plot (the fine bins merged).
PLOT_BINS = 40
PERCENTILES = (0.5, 0.95, 0.99)
#: The ledger columns the audit reads (the reader then parses and ships only these).
LEDGER_COLUMNS = ("broker STRING, queue INT, offset BIGINT, key STRING, born_ms BIGINT, start_ms DOUBLE, "
                  "end_ms DOUBLE, epoch BIGINT, outcome STRING")


@dataclass(frozen=True)
class Route:
    """The topic's queues as literal SQL expressions: a queue index from (broker, queue id), and each
    queue's committed, first stored, next offset and audit start from its index. Literals, not a
    joined table: a small DataFrame costs a ``createDataFrame`` and a broadcast job per use."""

    infos: tuple[QueueInfo, ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, infos: Sequence[QueueInfo], starts: dict[int, int] | None = None) -> Route:
        return cls(tuple(infos), tuple((starts or {}).get(q.index, q.earliest) for q in infos))

    def index(self, broker: Column, queue_id: Column) -> Column:
        """``qi`` of a (broker, queue id) pair, null for a queue the topic does not have."""
        pairs = [x for q in self.infos for x in (F.lit(f"{q.broker}\x00{q.queue_id}"), F.lit(q.index))]
        return F.element_at(F.create_map(*pairs), F.concat_ws("\x00", broker, queue_id.cast("string")))

    def _by_index(self, values: Sequence[int]) -> Column:
        # One SQL expression (one py4j call), not a lit and a cast per queue: offsets are integers.
        return F.expr(f"element_at(array({', '.join(f'CAST({int(v)} AS BIGINT)' for v in values)}), qi + 1)")

    def committed(self) -> Column:
        return self._by_index([q.committed for q in self.infos])

    def earliest(self) -> Column:
        return self._by_index([q.earliest for q in self.infos])

    def next_offset(self) -> Column:
        return self._by_index([q.max_offset for q in self.infos])

    def audit_from(self) -> Column:
        return self._by_index(self.starts)


def records(ledger: DataFrame, route: Route) -> DataFrame:
    """Ledger records with their queue index; a record that is not the engine's (or of a queue not
    in the route) keeps a null ``qi`` and ``offset``: counted as malformed, checked for nothing."""
    located = ledger.withColumn("qi", route.index(F.col("broker"), F.col("queue")))
    bad = F.col("outcome").isNull() | F.col("offset").isNull() | F.col("qi").isNull()
    return located.select(
        F.when(~bad, F.col("qi")).alias("qi"),
        F.when(~bad, F.col("offset")).alias("offset"),
        F.when(~bad, F.coalesce("key", F.lit(""))).otherwise(F.lit("")).alias("key"),
        F.lit(1).alias("record"),
        F.lit(0).alias("is_stored"),
        (F.col("outcome") == "SUCCESS").cast("int").alias("ok"),
        (F.col("outcome") == "DLQ").cast("int").alias("dlq"),
        "start_ms", "end_ms", "epoch", "born_ms",
        F.lit(None).cast("string").alias("field_value"),
    )


def stored_rows(stored: DataFrame) -> DataFrame:
    """Stored messages in the shape of ``records`` (no delivery, ``is_stored`` = 1)."""
    return stored.select(
        "qi", "offset", F.coalesce("key", F.lit("")).alias("key"), F.lit(0).alias("record"),
        F.lit(1).alias("is_stored"), F.lit(0).alias("ok"), F.lit(0).alias("dlq"),
        F.lit(None).cast("double").alias("start_ms"), F.lit(None).cast("double").alias("end_ms"),
        F.lit(None).cast("long").alias("epoch"), F.lit(None).cast("long").alias("born_ms"), "field_value",
    )


def _lane_columns(ordering: str) -> list[str]:
    return ["qi"] if ordering == "queue" else ["qi", "key"]


def lane_partitions(spark_parallelism: int, records: int, limit: int) -> int:
    """How many partitions the lane shuffle makes: enough for the cores and for ~200k rows each,
    at most ``spark.sql.shuffle.partitions``. Set explicitly because adaptive execution does not
    coalesce the partitions of a cached plan: 200 tasks of a few rows each cost seconds each stage."""
    return max(1, min(limit, max(2 * spark_parallelism, math.ceil(records / 200_000))))


def _fold(rows: DataFrame, ordering: str, order_field: str | None, partitions: int) -> DataFrame:
    """One row per message. Grouping by (qi, key, offset) after partitioning by the lane keeps the
    lane partitioning (no second shuffle): a message's records and its stored row share its key."""
    ok, dlq = F.col("ok") == 1, F.col("dlq") == 1
    aggs = [
        F.sum("record").alias("records"),
        F.max("is_stored").alias("is_stored"),
        F.min("start_ms").alias("first_start"),
        F.sum("ok").alias("successes"),
        F.sum("dlq").alias("dlq_records"),
        F.min(F.when(ok, F.col("epoch"))).alias("epoch_lo"),
        F.max(F.when(ok, F.col("epoch"))).alias("epoch_hi"),
        F.min(F.when(ok | dlq, F.col("start_ms"))).alias("settle_start"),
        F.min(F.when(ok, F.col("end_ms"))).alias("success_end"),
        F.max("born_ms").alias("born_ms"),
    ]
    if order_field:
        aggs.append(F.max("field_value").alias("field_value"))  # a string buffer: only when asked
    return rows.repartition(partitions, *_lane_columns(ordering)).groupBy("qi", "key", "offset").agg(*aggs)


def messages(recs: DataFrame, stored: DataFrame | None, dead: DataFrame | None, route: Route, ordering: str,
             order_field: str | None, bucket_ms: int, partitions: int) -> DataFrame:
    """Every message with the flags and bins the report counts: the delivered ones only (phase 1,
    ``stored`` None: whether each is still stored is judged from its queue's offset range), or the
    delivered and the stored ones (phase 2, the stored messages read)."""
    rows = recs if stored is None else recs.unionByName(stored_rows(stored))
    m = _fold(rows, ordering, order_field, partitions)
    # Broadcast joins keep the lane partitioning the windows below rely on.
    m = m.join(dead, ["qi", "offset"], "left") if dead is not None else m.withColumn("in_dlq", F.lit(None).cast("boolean"))
    in_range = (F.col("offset") >= route.earliest()) & (F.col("offset") < route.next_offset())
    # Columns are added a stage at a time with withColumns (one projection, one analysis of the
    # plan each), not one withColumn per column: each call costs the driver a py4j round trip and a
    # re-analysis of the whole growing plan, which was a fifth of a 200,000-record audit.
    m = m.withColumns({"committed": route.committed(), "audit_from": route.audit_from(),
                       "stored": (F.col("is_stored") == 1) if stored is not None else F.coalesce(in_range, F.lit(False))})

    lane_cols = _lane_columns(ordering)
    was_delivered = F.col("first_start").isNotNull()
    earlier = (Window.partitionBy(*lane_cols).orderBy(F.col("first_start").asc_nulls_last(), F.col("offset"))
               .rowsBetween(Window.unboundedPreceding, -1))
    lane = Window.partitionBy(*lane_cols)
    m = m.withColumns({"after_offset": F.max(F.when(was_delivered, F.col("offset"))).over(earlier),
                       "lane_success": F.max(F.when(F.col("successes") > 0, F.col("offset"))).over(lane)})

    dead_ = (F.col("dlq_records") > 0) | F.coalesce("in_dlq", F.lit(False))
    unsettled = F.col("stored") & ~((F.col("successes") > 0) | dead_)
    below_commit = F.col("offset") < F.col("committed")
    passed = F.coalesce(F.col("offset") < F.col("lane_success"), F.lit(False))
    audited = F.col("offset") >= F.col("audit_from")
    lane_name = F.lit("queue") if ordering == "queue" else F.when(F.col("key") == "", "queue").otherwise("key")
    latency = F.col("settle_start") - F.col("born_ms")
    m = m.withColumns({
        "violation": was_delivered & F.coalesce(F.col("offset") < F.col("after_offset"), F.lit(False)),
        "gap": unsettled & audited & (below_commit | passed),
        "gap_reason": F.when(below_commit, F.concat(F.lit("below the committed offset "), F.col("committed")))
                       .otherwise(F.concat(F.lit("offset "), F.col("lane_success"), F.lit(" of its "), lane_name,
                                           F.lit(" succeeded"))),
        "pending": unsettled & audited & ~(below_commit | passed),
        "unaudited": unsettled & ~audited,
        "dead": dead_,
        "dup_kind": F.when(F.col("successes") > 1, F.when(F.col("epoch_hi") > F.col("epoch_lo"),
                                                          "epoch_change").otherwise("same_epoch")),
        "latency_ms": latency,
        # greatest() skips nulls: a message without a latency must get no bin, hence the when().
        "lat_bin": F.when(latency.isNotNull(), F.floor(
            F.log(F.greatest(latency, F.lit(MIN_LATENCY_MS))) / math.log(BIN_RATIO)).cast("int")),
        "tp_bucket": F.floor(F.col("success_end") / F.lit(bucket_ms)).cast("long"),
    })
    if not order_field:
        return m.withColumns({"domain_violation": F.lit(False), "missing_field": F.lit(False)})
    # Numbers compare as numbers, anything else as text: struct(num, str) orders exactly so.
    v = F.col("field_value")
    m = m.withColumn("field", F.when(v.isNotNull(), F.struct(v.cast("double").alias("num"), v.alias("str"),
                                                              F.col("offset").alias("off"))))
    m = m.withColumn("after_field", F.max(F.when(was_delivered, F.col("field"))).over(earlier))
    below = F.struct("field.num", "field.str") < F.struct("after_field.num", "after_field.str")
    return m.withColumns({"domain_violation": was_delivered & v.isNotNull() & F.coalesce(below, F.lit(False)),
                          "missing_field": F.col("stored") & v.isNull()})


def throughput_bucket_ms(streams: Sequence[LedgerStream]) -> int:
    """Bucket width for about ``THROUGHPUT_BUCKETS`` buckets, from the ledger's entry ids (the
    records' write times): known before any job, so throughput is counted with everything else."""
    t0 = min(int(s.first_id.split("-")[0]) for s in streams)
    t1 = max(int(s.last_id.split("-")[0]) for s in streams)
    return max(1, math.ceil((t1 - t0) / 1000 / THROUGHPUT_BUCKETS)) * 1000


@dataclass(frozen=True)
class Extent:
    """What phase 1 saw of one queue: delivered stored messages below / from the committed offset,
    and the lowest delivered and highest delivered stored offsets."""

    below: int = 0
    above: int = 0
    low: int | None = None
    high: int | None = None

    def add(self, r: Any) -> Extent:
        return Extent(self.below + int(r["d_below"] or 0), self.above + int(r["d_above"] or 0),
                      _opt(min, self.low, r["d_min"]), _opt(max, self.high, r["d_max"]))


def _opt(f: Any, a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else f(a, b)


@dataclass(frozen=True)
class Unseen:
    """Stored messages of one queue the ledger has no record of, by what they must be."""

    gaps: int  # below the committed offset, from the audit start
    holes: int  # from the committed offset, below a delivered offset: gap or pending, by their key
    pending: int  # beyond every delivered offset, from the committed offset
    unaudited: int  # below the audit start and the committed offset


def audit_start(q: QueueInfo, e: Extent, start: str) -> int:
    """The first offset the gap check covers: the first stored one, or (``ledger``) the first one
    the ledger records (everything stored, for a queue it has no record of)."""
    if start == "stored":
        return q.earliest
    return min(max(q.earliest, e.low if e.low is not None else q.max_offset), q.max_offset)


def unseen(q: QueueInfo, e: Extent, start: str) -> Unseen:
    """Count, without reading them, the stored messages ``[earliest, next)`` with no record: the
    ledger gives how many of each range were delivered, so the rest is subtraction."""
    a = audit_start(q, e, start)
    c = min(max(q.committed, q.earliest), q.max_offset)
    unaudited = max(0, min(a, c) - q.earliest)
    gaps = max(0, c - max(a, q.earliest) - e.below)
    f = max(c, a)
    early = max(0, a - c)  # from the committed offset up to the audit start: not reached yet
    if e.high is None or e.high < f:
        return Unseen(gaps, 0, early + max(0, q.max_offset - f), unaudited)
    return Unseen(gaps, max(0, e.high - f + 1 - e.above), early + max(0, q.max_offset - e.high - 1), unaudited)


def settle_unseen(report: AuditReport, infos: Sequence[QueueInfo], counts: dict[int, Unseen]) -> None:
    """Phase 1 found nothing to name: add the stored messages it did not read (pending, unaudited)."""
    by_index = {q.index: q for q in infos}
    report.queues = [replace(s, stored=by_index[s.queue].max_offset - by_index[s.queue].earliest,
                             pending=s.pending + counts[s.queue].pending,
                             unaudited=s.unaudited + counts[s.queue].unaudited) for s in report.queues]
    _totals(report)


# -- summary: per queue, latency bins and throughput in one job -----------------------------------


def _n(c: Column) -> Column:
    return F.sum(c.cast("int"))


#: What ``summary`` counts per queue (and latency bin), each a condition on a message row.
_COUNTED = ("stored", "delivered", "succeeded", "dead_lettered", "pending", "unaudited", "violations", "gaps",
            "dup_epoch", "dup_other", "domain_violations", "missing_field")


def _conditions() -> dict[str, Column]:
    # Built per call: a Column needs the active SparkContext, which import time may not have.
    c = F.col
    return {
        "stored": c("stored"), "delivered": c("first_start").isNotNull(), "succeeded": c("successes") > 0,
        "dead_lettered": c("dead"), "pending": c("pending"), "unaudited": c("unaudited"),
        "violations": c("violation"), "gaps": c("gap"), "dup_epoch": c("dup_kind") == "epoch_change",
        "dup_other": c("dup_kind") == "same_epoch", "domain_violations": c("domain_violation"),
        "missing_field": c("missing_field"),
    }


def summary(m: DataFrame, infos: Sequence[QueueInfo], report: AuditReport, bucket_ms: int) -> dict[int, Extent]:
    """Per-queue stats and totals, latency percentiles and histogram, throughput: one job.

    Grouping sets: (qi, lat_bin) gives every count per queue and latency bin (summed per queue
    here), (tp_bucket) the messages per throughput bucket.
    """
    aggs = [_n(c).alias(n) for n, c in _conditions().items()]
    seen = F.col("first_start").isNotNull() & F.col("stored")
    aggs += [F.count(F.lit(1)).alias("n"), F.sum("records").alias("records"), F.max("latency_ms").alias("lat_max"),
             _n(seen & (F.col("offset") < F.col("committed"))).alias("d_below"),
             _n(seen & (F.col("offset") >= F.col("committed"))).alias("d_above"),
             F.min(F.when(F.col("first_start").isNotNull(), F.col("offset"))).alias("d_min"),
             F.max(F.when(seen, F.col("offset"))).alias("d_max"),
             F.grouping("tp_bucket").alias("g_tp")]
    collected = m.groupingSets([["qi", "lat_bin"], ["tp_bucket"]], "qi", "lat_bin", "tp_bucket").agg(*aggs).collect()
    # As dicts, each built once: a Row looks a name up in its field list on every access, and the
    # ~30 accesses to each of the ~8,000 rows (16 queues x latency bins) of a 200,000-record audit
    # cost the driver ~0.3 s, on the critical path.
    names = list(collected[0].__fields__) if collected else []
    rows = [dict(zip(names, r, strict=True)) for r in collected]
    per_queue: dict[int | None, dict[str, int]] = {}
    extents: dict[int, Extent] = {}
    bins: dict[int | None, dict[int, int]] = {}
    lat_max: dict[int | None, float] = {}
    for r in rows:
        if not r["g_tp"]:
            if r["tp_bucket"] is not None:
                report.throughput.append((int(r["tp_bucket"]) * bucket_ms, int(r["n"])))
            continue
        acc = per_queue.setdefault(r["qi"], dict.fromkeys([*_COUNTED, "records"], 0))
        for name in (*_COUNTED, "records"):
            acc[name] += int(r[name] or 0)
        if r["qi"] is not None:
            extents[r["qi"]] = extents.get(r["qi"], Extent()).add(r)
        if r["lat_bin"] is not None:
            bins.setdefault(r["qi"], {})[r["lat_bin"]] = int(r["n"])
            lat_max[r["qi"]] = max(lat_max.get(r["qi"], -math.inf), float(r["lat_max"]))
    report.throughput.sort()
    report.throughput_bucket_s = bucket_ms // 1000
    report.malformed_records = per_queue.get(None, {}).get("records", 0)
    report.ledger_records = sum(acc["records"] for acc in per_queue.values())
    report.queues = [_queue_stats(q, per_queue.get(q.index), bins.get(q.index, {}), lat_max.get(q.index)) for q in infos]
    _totals(report)
    report.missing_order_field = sum(acc["missing_field"] for qi, acc in per_queue.items() if qi is not None)
    every: dict[int, int] = {}
    for qb in (bins.get(q.index, {}) for q in infos):
        for b, n in qb.items():
            every[b] = every.get(b, 0) + n
    highest = max((lat_max[q.index] for q in infos if q.index in lat_max), default=None)
    report.latency = _latency(every, highest)
    report.latency_histogram = _plot_bins(every)
    return extents


def _queue_stats(q: QueueInfo, acc: dict[str, int] | None, bins: dict[int, int], lat_max: float | None) -> QueueStats:
    a = acc or dict.fromkeys(_COUNTED, 0)
    return QueueStats(
        q.index, q.broker, q.queue_id, a["stored"], a["delivered"], a["succeeded"], a["dead_lettered"], a["pending"],
        a["unaudited"], q.max_offset, q.committed, q.lag, a["violations"], a["gaps"], a["dup_epoch"], a["dup_other"],
        a["domain_violations"], _latency(bins, lat_max))


def _totals(report: AuditReport) -> None:
    qs = report.queues
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


def _bin_value(b: int) -> float:
    """A bin's geometric middle: within half a bin (0.5 %) of any latency in it."""
    return BIN_RATIO ** (b + 0.5)


def _latency(bins: dict[int, int], lat_max: float | None) -> Latency:
    count = sum(bins.values())
    if not count:
        return Latency(0, None, None, None, None)
    order = sorted(bins)
    cum, acc = [], 0
    for b in order:
        acc += bins[b]
        cum.append(acc)
    def at(p: float) -> float:
        value = _bin_value(order[min(bisect.bisect_left(cum, math.ceil(p * count)), len(order) - 1)])
        return round(min(value, lat_max) if lat_max is not None else value, 3)

    p50, p95, p99 = (at(p) for p in PERCENTILES)
    return Latency(count, p50, p95, p99, None if lat_max is None else round(lat_max, 3))


def _plot_bins(bins: dict[int, int]) -> list[tuple[float, float, int]]:
    """The fine bins merged into at most ``PLOT_BINS`` bars: (low ms, high ms, messages)."""
    if not bins:
        return []
    lo, hi = min(bins), max(bins) + 1
    step = max(1, math.ceil((hi - lo) / PLOT_BINS))
    bars: dict[int, int] = {}
    for b, n in bins.items():
        bars[(b - lo) // step] = bars.get((b - lo) // step, 0) + n
    return [(round(BIN_RATIO ** (lo + i * step), 3), round(BIN_RATIO ** (lo + (i + 1) * step), 3), bars.get(i, 0))
            for i in range((hi - lo + step - 1) // step)]


# -- listed: every kind of finding in one job -----------------------------------------------------


def listed(m: DataFrame, report: AuditReport, limit: int) -> None:
    """The first ``limit`` cases of each kind, by queue and offset (message ids are added by the caller)."""
    kinds = {"violation": report.violation_count, "gap": report.gap_count,
             "dup": report.duplicates_epoch_change + report.duplicates_other,
             "domain": report.domain_violation_count}
    flags = {"violation": F.col("violation"), "gap": F.col("gap"), "dup": F.col("dup_kind").isNotNull(),
             "domain": F.col("domain_violation")}
    wanted = [k for k, n in kinds.items() if n]
    if not wanted:
        return
    cols = ["key", "qi", "offset", "after_offset", "first_start", "gap_reason", "successes", "epoch_lo",
            "epoch_hi", "dup_kind"]
    if report.order_field:
        cols += ["field_value", "after_field"]
    tagged = m.where(reduce(operator.or_, (flags[k] for k in wanted))).select(
        *cols, F.explode(F.array_compact(F.array(*(F.when(flags[k], F.lit(k)) for k in wanted)))).alias("kind"))
    rank = F.row_number().over(Window.partitionBy("kind").orderBy("qi", "offset"))
    rows = tagged.withColumn("rank", rank).where(F.col("rank") <= limit).orderBy("kind", "qi", "offset").collect()
    for r in rows:
        key = r.key or None
        if r.kind == "violation":
            report.violations.append(OrderViolation(key, r.qi, r.offset, r.after_offset, round(r.first_start, 3)))
        elif r.kind == "gap":
            report.gaps.append(Gap(key, r.qi, r.offset, None, r.gap_reason))
        elif r.kind == "dup":
            epochs = sorted({r.epoch_lo, r.epoch_hi})
            report.duplicates.append(Duplicate(key, r.qi, r.offset, r.successes, epochs, r.dup_kind))
        else:
            report.domain_violations.append(DomainViolation(key, r.qi, r.offset, r.field_value, r.after_field.off,
                                                            r.after_field.str))

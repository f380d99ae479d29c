"""The audit's Spark side: one row per message, window functions per lane, and the report's numbers.

A *lane* is what must stay in order: a sharding key within its queue (``ordering="key"``; the
keyless messages of a queue form one lane) or the whole queue (``ordering="queue"``). A key lane is
the hash of the sharding key a message was sent with (its header ``h``, the ledger's ``key_hash``):
what a key-ordered listener orders and serialises by, whether or not the message carries the key
itself (``send_orderly`` stores none; ``KEY_LANES``). Within a lane
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

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from mqorder import keys
from mqorder.consumer.key_lanes import NO_KEY  # a message sent without a sharding key
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
LEDGER_COLUMNS = ("broker STRING, queue INT, offset BIGINT, key STRING, key_hash BIGINT, born_ms BIGINT, "
                  "start_ms DOUBLE, end_ms DOUBLE, epoch BIGINT, outcome STRING")
#: Where key lanes come from: ``key_hash`` (the records' ``key_hash``, the stored headers' ``h``), or
#: ``first_key`` for a ledger an engine wrote before it recorded key hashes (the hash of each
#: message's first key, which ``send_orderly_batch`` and the Spark writer set to the sharding key;
#: messages without one form their queue's lane). Records and stored messages take the same rule,
#: or a message would fall in two lanes.
KEY_LANES = ("key_hash", "first_key")
_FIRST_KEY_LANE = f"CASE WHEN coalesce(`key`, '') = '' THEN {NO_KEY} ELSE crc32(`key`) END"


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

    def _pairs_sql(self) -> str:
        """``map('<broker>:<queue id>', qi, ...)``: broker names hold only ``[%|a-zA-Z0-9_.@-]``
        (``keys.BROKER_RE``), so they are SQL string literals as they are, and ``:`` separates."""
        for q in self.infos:
            if not keys.BROKER_RE.fullmatch(q.broker):
                raise ValueError(f"invalid broker name {q.broker!r} in the topic's route")
        pairs = ", ".join(f"'{q.broker}:{int(q.queue_id)}', {int(q.index)}" for q in self.infos)
        return f"map({pairs})" if pairs else "map()"

    def index_sql(self, broker: str, queue_id: str) -> str:
        """``qi`` of a (broker, queue id) pair as SQL over the expressions ``broker`` and ``queue_id``,
        null for a queue the topic does not have."""
        # concat, not concat_ws: a null queue id must give a null key (concat_ws would skip it and
        # look the broker name up alone).
        return f"element_at({self._pairs_sql()}, concat({broker}, ':', CAST({queue_id} AS STRING)))"

    def _by_index(self, values: Sequence[int]) -> str:
        # One SQL expression (one py4j call), not a lit and a cast per queue: offsets are integers.
        return f"element_at(array({', '.join(f'CAST({int(v)} AS BIGINT)' for v in values)}), qi + 1)"

    def committed(self) -> str:
        return self._by_index([q.committed for q in self.infos])

    def earliest(self) -> str:
        return self._by_index([q.earliest for q in self.infos])

    def next_offset(self) -> str:
        return self._by_index([q.max_offset for q in self.infos])

    def audit_from(self) -> str:
        return self._by_index(self.starts)


def records(ledger: DataFrame, route: Route, key_lanes: str = "key_hash") -> DataFrame:
    """Ledger records with their queue index and lane; a record that is not the engine's (or of a
    queue not in the route) keeps a null ``qi`` and ``offset``: counted as malformed, checked for
    nothing. A record without ``key_hash`` (an older engine's, during an upgrade) takes its first
    key's lane."""
    located = ledger.selectExpr("*", f"{route.index_sql('broker', '`queue`')} AS qi")
    good = "NOT (outcome IS NULL OR `offset` IS NULL OR qi IS NULL)"
    lane = _FIRST_KEY_LANE if key_lanes == "first_key" else f"coalesce(key_hash, {_FIRST_KEY_LANE})"
    return located.selectExpr(
        f"CASE WHEN {good} THEN qi END AS qi",
        f"CASE WHEN {good} THEN `offset` END AS `offset`",
        f"CASE WHEN {good} THEN {lane} ELSE {NO_KEY} END AS lane",
        f"CASE WHEN {good} THEN coalesce(`key`, '') ELSE '' END AS `key`",
        "1 AS record",
        "0 AS is_stored",
        "CAST(outcome = 'SUCCESS' AS INT) AS ok",
        "CAST(outcome = 'DLQ' AS INT) AS dlq",
        "start_ms", "end_ms", "epoch", "born_ms",
        "CAST(NULL AS STRING) AS field_value",
    )


def stored_rows(stored: DataFrame, key_lanes: str = "key_hash") -> DataFrame:
    """Stored messages in the shape of ``records`` (no delivery, ``is_stored`` = 1)."""
    lane = _FIRST_KEY_LANE if key_lanes == "first_key" else f"coalesce(key_hash, {NO_KEY})"
    return stored.selectExpr(
        "qi", "`offset`", f"{lane} AS lane", "coalesce(`key`, '') AS `key`", "0 AS record", "1 AS is_stored", "0 AS ok", "0 AS dlq",
        "CAST(NULL AS DOUBLE) AS start_ms", "CAST(NULL AS DOUBLE) AS end_ms", "CAST(NULL AS BIGINT) AS epoch",
        "CAST(NULL AS BIGINT) AS born_ms", "field_value",
    )


def _lane_columns(ordering: str) -> list[str]:
    return ["qi"] if ordering == "queue" else ["qi", "lane"]


def lane_partitions(spark_parallelism: int, records: int, limit: int) -> int:
    """How many partitions the lane shuffle makes: enough for the cores and for ~200k rows each,
    at most ``spark.sql.shuffle.partitions``. Set explicitly because adaptive execution does not
    coalesce the partitions of a cached plan: 200 tasks of a few rows each cost seconds each stage."""
    return max(1, min(limit, max(2 * spark_parallelism, math.ceil(records / 200_000))))


def _fold(rows: DataFrame, ordering: str, order_field: str | None, partitions: int) -> DataFrame:
    """One row per message. Grouping by (qi, lane, key, offset) after partitioning by the lane keeps
    the lane partitioning (no second shuffle): a message's records and its stored row share its
    lane and its first key (which is grouped by, not aggregated: a string buffer would make Spark sort)."""
    # SQL text: one py4j call per aggregate (a Column built from functions costs a dozen).
    ok, settled = "ok = 1", "(ok = 1 OR dlq = 1)"
    aggs = [
        "sum(record) AS records",
        "max(is_stored) AS is_stored",
        "min(start_ms) AS first_start",
        "sum(ok) AS successes",
        "sum(dlq) AS dlq_records",
        f"min(CASE WHEN {ok} THEN epoch END) AS epoch_lo",
        f"max(CASE WHEN {ok} THEN epoch END) AS epoch_hi",
        f"min(CASE WHEN {settled} THEN start_ms END) AS settle_start",
        f"min(CASE WHEN {ok} THEN end_ms END) AS success_end",
        "max(born_ms) AS born_ms",
    ]
    if order_field:
        aggs.append("max(field_value) AS field_value")  # a string buffer: only when asked
    return (rows.repartition(partitions, *_lane_columns(ordering)).groupBy("qi", "lane", "key", "offset")
            .agg(*(F.expr(a) for a in aggs)))



def messages(recs: DataFrame, stored: DataFrame | None, dead: DataFrame | None, route: Route, ordering: str,
             order_field: str | None, bucket_ms: int, partitions: int, key_lanes: str = "key_hash") -> DataFrame:
    """Every message with the flags and bins the report counts: the delivered ones only (phase 1,
    ``stored`` None: whether each is still stored is judged from its queue's offset range), or the
    delivered and the stored ones (phase 2, the stored messages read)."""
    rows = recs if stored is None else recs.unionByName(stored_rows(stored, key_lanes))
    m = _fold(rows, ordering, order_field, partitions)
    # Broadcast joins keep the lane partitioning the windows below rely on.
    m = m.join(dead, ["qi", "offset"], "left") if dead is not None else m.selectExpr("*", "CAST(NULL AS BOOLEAN) AS in_dlq")
    # Columns are added a stage at a time, each stage one projection written in SQL (one py4j call,
    # one analysis of the plan), not built from Column functions: each of those costs the driver
    # py4j round trips, and building the plan that way was a fifth of a 200,000-record audit.
    in_range = f"(`offset` >= {route.earliest()} AND `offset` < {route.next_offset()})"
    m = m.selectExpr("*", f"{route.committed()} AS committed", f"{route.audit_from()} AS audit_from",
                     "is_stored = 1 AS stored" if stored is not None else f"coalesce({in_range}, false) AS stored")

    lanes = ", ".join(f"`{c}`" for c in _lane_columns(ordering))
    earlier = (f"OVER (PARTITION BY {lanes} ORDER BY first_start ASC NULLS LAST, `offset` ASC "
               "ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)")
    m = m.selectExpr("*", f"max(CASE WHEN first_start IS NOT NULL THEN `offset` END) {earlier} AS after_offset",
                     f"max(CASE WHEN successes > 0 THEN `offset` END) OVER (PARTITION BY {lanes}) AS lane_success")

    dead_ = "(dlq_records > 0 OR coalesce(in_dlq, false))"
    unsettled = f"(stored AND NOT (successes > 0 OR {dead_}))"
    below_commit = "(`offset` < committed)"
    passed = "coalesce(`offset` < lane_success, false)"
    audited = "(`offset` >= audit_from)"
    lane_name = "'queue'" if ordering == "queue" else f"CASE WHEN lane = {NO_KEY} THEN 'queue' ELSE 'key' END"
    latency = "(settle_start - born_ms)"
    # greatest() skips nulls: a message without a latency must get no bin, hence the CASE.
    lat_bin = (f"CASE WHEN {latency} IS NOT NULL THEN CAST(floor(ln(greatest({latency}, {MIN_LATENCY_MS!r}D)) / "
               f"{math.log(BIN_RATIO)!r}D) AS INT) END")
    m = m.selectExpr(
        "*",
        "(first_start IS NOT NULL AND coalesce(`offset` < after_offset, false)) AS violation",
        f"({unsettled} AND {audited} AND ({below_commit} OR {passed})) AS gap",
        f"CASE WHEN {below_commit} THEN concat('below the committed offset ', committed) "
        f"ELSE concat('offset ', lane_success, ' of its ', {lane_name}, ' succeeded') END AS gap_reason",
        f"({unsettled} AND {audited} AND NOT ({below_commit} OR {passed})) AS pending",
        f"({unsettled} AND NOT {audited}) AS unaudited",
        f"{dead_} AS dead",
        "CASE WHEN successes > 1 THEN CASE WHEN epoch_hi > epoch_lo THEN 'epoch_change' ELSE 'same_epoch' END END "
        "AS dup_kind",
        f"{latency} AS latency_ms",
        f"{lat_bin} AS lat_bin",
        f"CAST(floor(success_end / {int(bucket_ms)}) AS BIGINT) AS tp_bucket",
    )
    if not order_field:
        return m.selectExpr("*", "false AS domain_violation", "false AS missing_field")
    was_delivered = F.col("first_start").isNotNull()
    earlier_w = (Window.partitionBy(*_lane_columns(ordering)).orderBy(F.col("first_start").asc_nulls_last(),
                                                                      F.col("offset"))
                 .rowsBetween(Window.unboundedPreceding, -1))
    # Numbers compare as numbers, anything else as text: struct(num, str) orders exactly so.
    v = F.col("field_value")
    m = m.withColumn("field", F.when(v.isNotNull(), F.struct(v.cast("double").alias("num"), v.alias("str"),
                                                              F.col("offset").alias("off"))))
    m = m.withColumn("after_field", F.max(F.when(was_delivered, F.col("field"))).over(earlier_w))
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


#: What ``summary`` counts per queue (and latency bin), each a condition on a message row (SQL).
_CONDITIONS = {
    "stored": "stored", "delivered": "first_start IS NOT NULL", "succeeded": "successes > 0",
    "dead_lettered": "dead", "pending": "pending", "unaudited": "unaudited", "violations": "violation",
    "gaps": "gap", "dup_epoch": "dup_kind = 'epoch_change'", "dup_other": "dup_kind = 'same_epoch'",
    "domain_violations": "domain_violation", "missing_field": "missing_field",
}
_COUNTED = tuple(_CONDITIONS)
_SEEN = "(first_start IS NOT NULL AND stored)"
#: Every condition ``summary`` counts, as one bit of a row's ``flags``: the counted ones, then the
#: delivered stored messages below and from the committed offset (``Extent``).
_FLAGS = (*_CONDITIONS.items(), ("d_below", f"{_SEEN} AND `offset` < committed"),
          ("d_above", f"{_SEEN} AND `offset` >= committed"))
_BELOW, _ABOVE = 1 << len(_CONDITIONS), 1 << (len(_CONDITIONS) + 1)


def summary(m: DataFrame, infos: Sequence[QueueInfo], report: AuditReport, bucket_ms: int) -> dict[int, Extent]:
    """Per-queue stats and totals, latency percentiles and histogram, throughput: one job.

    Each message's conditions are one integer, ``flags`` (a bit per condition of ``_FLAGS``), and
    the rows are counted per (qi, lat_bin, flags): a few aggregates per row where a sum per
    condition made ~20, over twice the rows (the grouping sets' ``Expand``): that aggregation was
    the largest metered part of an audit's main stage (0.87 -> 0.73 s for the whole job over
    200,000 records, warm, medians of 7). The counts are summed per queue here, by bit.
    Grouping sets: (qi, lat_bin, flags), and (tp_bucket) for the messages per throughput bucket.
    """
    flags = " + ".join(f"(CASE WHEN {cond} THEN {1 << i} ELSE 0 END)" for i, (_, cond) in enumerate(_FLAGS))
    rows_in = m.selectExpr("qi", "lat_bin", "tp_bucket", f"{flags} AS flags", "records", "latency_ms",
                           "CASE WHEN first_start IS NOT NULL THEN `offset` END AS delivered_offset",
                           f"CASE WHEN {_SEEN} THEN `offset` END AS seen_offset")
    aggs = ["count(1) AS n", "sum(records) AS records", "max(latency_ms) AS lat_max",
            "min(delivered_offset) AS d_min", "max(seen_offset) AS d_max", "grouping(tp_bucket) AS g_tp"]
    grouped = rows_in.groupingSets([["qi", "lat_bin", "flags"], ["tp_bucket"]], "qi", "lat_bin", "flags", "tp_bucket")
    # Collected as Arrow and read as dicts: ~8,000 rows (16 queues x latency bins) for a
    # 200,000-record audit, which as pickled Rows cost the driver ~0.3 s on the critical path.
    rows = grouped.agg(*(F.expr(a) for a in aggs)).toArrow().to_pylist()
    per_queue: dict[int | None, dict[str, int]] = {}
    extents: dict[int, Extent] = {}
    bins: dict[int | None, dict[int, int]] = {}
    lat_max: dict[int | None, float] = {}
    names = [name for name, _ in _FLAGS]
    for r in rows:
        if not r["g_tp"]:
            if r["tp_bucket"] is not None:
                report.throughput.append((int(r["tp_bucket"]) * bucket_ms, int(r["n"])))
            continue
        n, qi = int(r["n"]), r["qi"]
        acc = per_queue.setdefault(qi, dict.fromkeys([*names, "records"], 0))
        acc["records"] += int(r["records"] or 0)
        flag = bits = int(r["flags"])
        while bits:
            low = bits & -bits
            acc[names[low.bit_length() - 1]] += n
            bits ^= low
        if qi is not None:
            extents[qi] = extents.get(qi, Extent()).add({
                "d_below": n if flag & _BELOW else 0, "d_above": n if flag & _ABOVE else 0,
                "d_min": r["d_min"], "d_max": r["d_max"]})
        if r["lat_bin"] is not None:
            queue_bins = bins.setdefault(qi, {})
            queue_bins[r["lat_bin"]] = queue_bins.get(r["lat_bin"], 0) + n
            lat_max[qi] = max(lat_max.get(qi, -math.inf), float(r["lat_max"]))
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
    cols = ["key", "lane", "qi", "offset", "after_offset", "first_start", "gap_reason", "successes", "epoch_lo",
            "epoch_hi", "dup_kind"]
    if report.order_field:
        cols += ["field_value", "after_field"]
    tagged = m.where(reduce(operator.or_, (flags[k] for k in wanted))).select(
        *cols, F.explode(F.array_compact(F.array(*(F.when(flags[k], F.lit(k)) for k in wanted)))).alias("kind"))
    rank = F.row_number().over(Window.partitionBy("kind").orderBy("qi", "offset"))
    rows = tagged.withColumn("rank", rank).where(F.col("rank") <= limit).orderBy("kind", "qi", "offset").collect()
    for r in rows:
        key, h = r.key or None, None if r.lane == NO_KEY else r.lane
        if r.kind == "violation":
            report.violations.append(OrderViolation(key, r.qi, r.offset, r.after_offset, round(r.first_start, 3), h))
        elif r.kind == "gap":
            report.gaps.append(Gap(key, r.qi, r.offset, None, r.gap_reason, h))
        elif r.kind == "dup":
            epochs = sorted({r.epoch_lo, r.epoch_hi})
            report.duplicates.append(Duplicate(key, r.qi, r.offset, r.successes, epochs, r.dup_kind, h))
        else:
            report.domain_violations.append(DomainViolation(key, r.qi, r.offset, r.field_value, r.after_field.off,
                                                            r.after_field.str, h))

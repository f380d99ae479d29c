"""The benchmark's targets: one row each in ``TARGETS``, with its threshold written once.

A row says what is promised (the text of the report's Targets table, the threshold shown in it
from the row's own number), how the measured value is compared with the threshold, and how that
value is read from the run's ``Figures``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from bench.common import Summary, percentile, summarize
from bench.figures import Figures, fmt_paired, fmt_ratio, fmt_summary, fmt_verdict


class Comparison(StrEnum):
    """How a measured figure must relate to its threshold (the value is the sign the report prints)."""

    AT_LEAST = "≥"
    AT_MOST = "≤"

    def holds(self, value: float, threshold: float) -> bool:
        return value >= threshold if self is Comparison.AT_LEAST else value <= threshold


@dataclass(frozen=True)
class Reading:
    """What a target reads from one run's figures."""

    #: The figure judged against the threshold; None when the run did not measure it ("n/a").
    value: float | None
    #: The "measured" column.
    shown: str
    #: Which configuration was judged, named after the verdict: "**met** (threads pool -c 8)".
    judged: str = ""
    #: Further figures judged against the same threshold, after the verdict: "(batch 1: **met**)".
    also: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Target:
    """One row of the report's Targets table."""

    id: str
    #: The "target" column: ``{bound}`` is the comparison and threshold ("≥ 1.0x"), ``{f.<name>}`` a figure.
    description: str
    threshold: float
    comparison: Comparison
    #: How the threshold is printed: the unit after it, and its decimals.
    unit: str
    digits: int
    #: How to read the measured value from the run's figures.
    read: Callable[[Figures], Reading]

    def bound(self) -> str:
        return f"{self.comparison} {self.threshold:.{self.digits}f}{self.unit}"

    def met(self, value: float | None) -> str:
        return fmt_verdict(None if value is None else self.comparison.holds(value, self.threshold))

    def row(self, f: Figures) -> list[str]:
        """The target, what was measured, and the verdict."""
        reading = self.read(f)
        verdict = self.met(reading.value) + (f" ({reading.judged})" if reading.judged else "")
        verdict += "".join(f" ({name}: {self.met(v)})" for name, v in reading.also)
        return [self.description.format(bound=self.bound(), f=f), reading.shown, verdict]


def _of_paired(s: Summary | None) -> Reading:
    """The median of the per-run ratios to the paired raw-ceiling runs."""
    return Reading(None if s is None else s.median, fmt_paired(s))


def _of_ratio(r: tuple[float, float, float] | None) -> Reading:
    """A ratio of medians, judged on its value (the envelope is shown beside it)."""
    return Reading(None if r is None else r[0], fmt_ratio(r))


def _of_median(s: Summary | None, unit: str) -> Reading:
    return Reading(None if s is None else s.median, fmt_summary(s, 1, unit))


def _of_worst(s: Summary | None, unit: str) -> Reading:
    """The highest run's value: for a ceiling that every run must stay under."""
    return Reading(None if s is None else s.hi, fmt_summary(s, 1, unit))


def _of_ratios(b32: tuple[float, float, float] | None, b1: tuple[float, float, float] | None) -> Reading:
    """Ratios of medians at consume batch 32 (judged) and batch 1 (judged too, after the verdict)."""
    return Reading(None if b32 is None else b32[0], f"batch 32: {fmt_ratio(b32)}; batch 1: {fmt_ratio(b1)}",
                   also=() if b1 is None else (("batch 1", b1[0]),))


def _of_latency(f: Figures) -> Reading:
    """The median p99 of the stock configuration (older runs: of the one with the lowest); the
    others are shown beside it."""
    if not f.p99s:
        return Reading(None, "n/a")
    best = f.lat_judged or min(f.p99s, key=lambda k: f.p99s[k].median)
    others = "; ".join(f"{f.lat_short[k]}: {f.p99s[k].fmt(1, 'ms')}" for k in f.p99s if k != best)
    return Reading(f.p99s[best].median, f"**{f.lat_short[best]}: {f.p99s[best].fmt(1, 'ms')}**"
                   + (f"; other configurations: {others}" if others else ""), judged=f.lat_short[best])


def _of_failover(f: Figures) -> Reading:
    """The p99 over kills (nearest rank: with 10 kills, the worst)."""
    if not f.fo_t:
        return Reading(None, "n/a")
    p99 = percentile(f.fo_t, 99)
    return Reading(p99, f"p99 {p99:.2f} s (p50 {percentile(f.fo_t, 50):.2f} s)")


def _of_retention_memory(f: Figures) -> Reading:
    s = f.ret_steady
    if f.ret_ratio is None:
        return Reading(None, "n/a")
    mib = 1048576
    return Reading(f.ret_ratio, f"{f.ret_ratio:.2f}x (peak {s['peak_excess'] / mib:.0f} MiB above the start, working set "
                   f"{s['working_set'] / mib:.0f} MiB; {s['send_rate']:,.0f} msg/s for {s['elapsed_s']:.0f} s)")


def _of_audit(f: Figures) -> Reading:
    """The audit's own time (the Spark session start is reported apart)."""
    a = f.audit
    if not a.get("audit_s"):
        return Reading(None, "n/a")
    return Reading(a["audit_s"], f"{a['audit_s']:.1f} s ({a['records_per_s']:,} records/s; session start "
                   f"{a['session_start_s']:.1f} s apart; audit {'passed' if a.get('audit_ok') else 'FAILED'})")


def _of_keys(f: Figures, which: int) -> Reading:
    """Key order (``bench.keys``): the lower pool's ratio is judged; both are shown."""
    from bench.keys import ratios

    rs = ratios(f.keys)
    if not rs:
        return Reading(None, "n/a")
    worst = min(rs, key=lambda p: rs[p][which])
    return Reading(rs[worst][which], "; ".join(f"{p}: {v[which]:.2f}x" for p, v in rs.items()), judged=worst)


def _of_cluster_cpu(f: Figures) -> Reading:
    """Redis CPU per message, 3-shard cluster / single node: the median of the per-run ratios."""
    from bench.cluster_report import cpu_ratios

    rs = cpu_ratios(f.cluster)
    if not rs:
        return Reading(None, "n/a")
    s = summarize(rs)
    return Reading(s.median, f"{s.median:.2f}x ({s.lo:.2f}–{s.hi:.2f}, {s.n} paired runs)")


def _of_idle(f: Figures) -> Reading:
    """Workers + Redis of an idle deployment, share of one core: the costlier of the two queue layouts."""
    from bench.idle import shares, worst_share

    worst = worst_share(f.idle)
    if worst is None:
        return Reading(None, "n/a")
    each = "; ".join(f"{lay['topics']}×{lay['queues']}: {shares(lay)['workers_redis'] * 100:.2f} %"
                     for lay in f.idle["layouts"])
    return Reading(worst * 100, f"{worst * 100:.2f} % of one core ({each})")


def _of_batching(f: Figures, figure: str) -> Reading:
    """``bench.batching``, the configuration the issue names (``linger_ms=2``); with ``batch_size=32``
    judged too, after the verdict."""
    from bench import batching

    read = {"speedup": batching.speedups, "cpu": batching.cpu_per_msg, "p99": batching.paced_p99}[figure]
    unit = {"speedup": "x", "cpu": " µs", "p99": " ms"}[figure]
    judged, other = read(f.batching), read(f.batching, "async_b32")
    if judged is None:
        return Reading(None, "n/a")

    def shown(s: Summary) -> str:
        return f"{s.median:.2f}{unit} ({s.lo:.2f}–{s.hi:.2f}, {s.n} runs)" if s.n > 1 else f"{s.median:.2f}{unit} (1 run)"

    text = f"linger_ms=2: {shown(judged)}" + (f"; with batch_size=32: {shown(other)}" if other else "")
    floor = batching.cpu_per_msg(f.batching, "floor")
    base = batching.rate(f.batching, "sync")
    if figure == "speedup" and floor and base:
        text += (f"; the handoff alone costs {floor.median:.1f} µs of the {1e6 / (5 * base.median):.1f} µs "
                 "of CPU per message that 5x leaves one process (see the Batching producer section)")
    elif figure == "cpu" and floor:
        text += (f"; the handoff alone (no Redis, no encoding) costs {floor.median:.1f} µs per message "
                 "(see the Batching producer section)")
    return Reading(judged.median, text, judged="linger_ms=2",
                   also=(("batch_size=32", other.median),) if other else ())


def _of_cluster_commands(f: Figures) -> Reading:
    """Commands per message, 3-shard cluster (sum over shards) / single node: the median of the per-run ratios."""
    from bench.cluster_report import command_ratios

    rs = command_ratios(f.cluster)
    if not rs:
        return Reading(None, "n/a")
    s = summarize(rs)
    return Reading(s.median, f"{s.median:.2f}x ({s.lo:.2f}–{s.hi:.2f}, {s.n} paired runs)")


AT_LEAST, AT_MOST = Comparison.AT_LEAST, Comparison.AT_MOST

#: Every target of the benchmark. Per row: id; description (the report's text, ``{bound}`` standing
#: for comparison and threshold); threshold, comparison, the threshold's unit and decimals as printed;
#: how to read the measured value from the run's figures.
TARGETS: tuple[Target, ...] = (
    Target("raw_ceiling_b32", "mqorder no-op, 2 workers -c {f.best}, pull 32, consume batch 32 {bound} raw ceiling",
           1.0, AT_LEAST, "x", 1, lambda f: _of_paired(f.p_raw32)),
    Target("raw_ceiling_b1", "mqorder, consume batch 1 {bound} raw ceiling",
           0.6, AT_LEAST, "x", 1, lambda f: _of_paired(f.p_raw1)),
    Target("naive", "mqorder {bound} naive Celery",
           50, AT_LEAST, "x", 0, lambda f: _of_ratios(f.r_nv32, f.r_nv1)),
    Target("single_lane", "mqorder {bound} Celery single-lane",
           10, AT_LEAST, "x", 0, lambda f: _of_ratios(f.r_ln32, f.r_ln1)),
    Target("latency_p99", "p99 send→handle {bound} at 1,000 msg/s ({f.latency_scope})",
           10, AT_MOST, " ms", 0, _of_latency),
    Target("produce", "send_orderly_batch {bound} raw pipelined XADD",
           0.5, AT_LEAST, "x", 1, lambda f: _of_ratio(f.r_prod)),
    Target("failover_p99", "failover p99 {bound} ({f.kills} kills)",
           5.0, AT_MOST, " s", 0, _of_failover),
    Target("rebalance", "rebalance + lock of 1,024 queues over 8 clients {bound}",
           50, AT_MOST, " ms", 0, lambda f: _of_median(f.s_rb, "ms")),
    Target("memory_peak", "worker peak RSS draining a {f.mem_n:,}-message backlog {bound}",
           200, AT_MOST, " MiB", 0, lambda f: _of_worst(f.s_mem, "MiB")),
    Target("retention_memory", "Redis `used_memory` at 5,000 msg/s of 1 KiB with a 30 s retention {bound} its "
           "30-second working set", 2.0, AT_MOST, "x", 1, _of_retention_memory),
    Target("retention_drain", "no-op drain with trimming right behind the consumers {bound} trimming off",
           0.9, AT_LEAST, "x", 1, lambda f: _of_ratio(f.r_ret)),
    Target("spark_publish", "Spark publish of {f.spark_rows:,} rows (exactly once, `local[2]`) {bound} "
           "`send_orderly_batch` on the same data", 0.7, AT_LEAST, "x", 1, lambda f: _of_paired(f.s_spark_batch)),
    Target("spark_one_by_one", "Spark publish {bound} a one-by-one `send_orderly` loop",
           5, AT_LEAST, "x", 0, lambda f: _of_paired(f.s_spark_one)),
    Target("audit", "audit of a {f.audit_records:,}-record ledger on `local[2]` {bound}",
           60, AT_MOST, " s", 0, _of_audit),
    Target("keys_speedup", "key order {bound} queue order, 10 ms listener, 16 queues, 2,000 keys "
           "(threads -c 128, gevent -c 256)", 8, AT_LEAST, "x", 0, lambda f: _of_keys(f, 0)),
    Target("keys_failing_key", "key order, one key always failing: other keys' throughput {bound} the run "
           "without it", 0.9, AT_LEAST, "x", 1, lambda f: _of_keys(f, 1)),
    Target("cluster_redis_cpu", "Redis CPU per message on a 3-shard Redis Cluster (sum over shards) {bound} a "
           "single node's", 1.2, AT_MOST, "x", 1, _of_cluster_cpu),
    Target("cluster_commands", "no command on every shard per message: commands per message on the 3-shard "
           "cluster (sum over shards) {bound} the single node's (one such command adds 2 per message)",
           1.2, AT_MOST, "x", 1, _of_cluster_commands),
    Target("idle", "idle: 2 stock workers + beat over 1,024 idle queues, workers + Redis CPU {bound} of one core",
           2, AT_MOST, " %", 0, _of_idle),
    Target("batching_throughput", "`send_orderly_async` from 32 threads, one message each at a time, "
           "`linger_ms=2`: messages/s {bound} the same threads with `send_orderly`", 5, AT_LEAST, "x", 0,
           lambda f: _of_batching(f, "speedup")),
    Target("batching_cpu", "`send_orderly_async`, same run: producer CPU per message {bound}",
           25, AT_MOST, " µs", 0, lambda f: _of_batching(f, "cpu")),
    Target("batching_p99", "`send_orderly_async` at a paced 1,000 msg/s from 32 threads: p99 send→ack {bound}",
           5, AT_MOST, " ms", 0, lambda f: _of_batching(f, "p99")),
)


def threshold(target_id: str) -> float:
    """The threshold of one target, for a section that prints its own verdict next to its figures."""
    return next(t.threshold for t in TARGETS if t.id == target_id)

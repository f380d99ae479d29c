"""The audit's PNG plots: latency histogram, throughput over time, lag per queue.

matplotlib with the Agg backend (no display, safe in workers and CI), one figure per function, each
drawn from numbers the audit already computed in Spark: nothing here touches a DataFrame, so a
plot costs the same for a million records as for ten.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from mqorder.spark.audit_model import Latency, QueueStats

SIZE = (8, 4.2)
DPI = 110


def latency_histogram(bins: Sequence[tuple[float, float, int]], overall: Latency, title: str, out: Path) -> Path:
    """Log-spaced bins of born → handled latency, with p50/p95/p99 marked."""
    fig, ax = plt.subplots(figsize=SIZE)
    if bins:
        lefts = [b[0] for b in bins]
        widths = [b[1] - b[0] for b in bins]
        ax.bar(lefts, [b[2] for b in bins], width=widths, align="edge", color="#4c72b0", edgecolor="white",
               linewidth=0.3)
        ax.set_xscale("log")
        for name, value, style in (("p50", overall.p50_ms, "-"), ("p95", overall.p95_ms, "--"),
                                   ("p99", overall.p99_ms, ":")):
            if value is not None and value > 0:
                ax.axvline(value, color="#c44e52", linestyle=style, linewidth=1.2, label=f"{name} {value:,.1f} ms")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    else:
        _empty(ax)
    ax.set_xlabel("latency born → handled (ms, log scale)")
    ax.set_ylabel("messages")
    ax.set_title(title, fontsize=10)
    return _save(fig, out)


def throughput(series: Sequence[tuple[int, int]], bucket_s: int, title: str, out: Path) -> Path:
    """Messages handled (first SUCCESS) per second, per bucket of ``bucket_s`` seconds."""
    fig, ax = plt.subplots(figsize=SIZE)
    if series:
        t0 = series[0][0]
        xs = [(t - t0) / 1000 for t, _ in series]
        ys = [n / bucket_s for _, n in series]
        ax.step(xs, ys, where="post", color="#55a868")
        ax.fill_between(xs, ys, step="post", alpha=0.25, color="#55a868")
        start = datetime.fromtimestamp(t0 / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        ax.set_xlabel(f"seconds since {start} (buckets of {bucket_s} s)")
    else:
        _empty(ax)
        ax.set_xlabel("seconds")
    ax.set_ylabel("messages / s")
    ax.set_title(title, fontsize=10)
    return _save(fig, out)


def lag_per_queue(queues: Sequence[QueueStats], title: str, out: Path) -> Path:
    """Stored but not yet committed, per queue, as the audit found it."""
    fig, ax = plt.subplots(figsize=SIZE)
    if queues:
        labels = [str(q.queue) for q in queues]
        lags = [q.lag for q in queues]
        colors = ["#c44e52" if q.gaps or q.violations else "#8172b2" for q in queues]
        ax.bar(labels, lags, color=colors)
        if len(labels) > 32:
            ax.set_xticks(labels[:: max(1, len(labels) // 32)])
        if not any(lags):
            ax.set_ylim(0, 1)
            ax.text(0.5, 0.5, "no lag: every stored message is committed", transform=ax.transAxes,
                    ha="center", va="center", color="#555555")
    else:
        _empty(ax)
    ax.set_xlabel("queue (red: has a gap or an order violation)")
    ax.set_ylabel("messages not committed")
    ax.set_title(title, fontsize=10)
    return _save(fig, out)


def _empty(ax: plt.Axes) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#555555")


def _save(fig: plt.Figure, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out

"""Writing an ``AuditReport`` to a directory: ``report.json``, ``report.md`` and the PNG plots.

``report.json`` is the whole report (every count, every listed case); ``report.md`` is what a
person reads first, one function per section, each case named by key, queue and offset so it can
be looked up with ``mqorder status`` or a batch read of the topic.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from mqorder.spark import plots
from mqorder.spark.audit_model import AuditReport, DomainViolation, Duplicate, Gap, Latency, OrderViolation

JSON_NAME, MD_NAME = "report.json", "report.md"
LATENCY_PNG, THROUGHPUT_PNG, LAG_PNG = "latency.png", "throughput.png", "lag.png"
#: Cases of each kind shown in report.md (report.json lists up to the audit's ``max_listed``).
MD_LISTED = 20


def write_report(report: AuditReport, out: Path) -> list[Path]:
    """Write every file of ``report`` into ``out`` (created if needed); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    what = f"{report.group} on {report.topic}"
    files = [
        plots.latency_histogram(report.latency_histogram, report.latency, f"Latency, {what}", out / LATENCY_PNG),
        plots.throughput(report.throughput, report.throughput_bucket_s, f"Throughput, {what}", out / THROUGHPUT_PNG),
        plots.lag_per_queue(report.queues, f"Lag per queue, {what}", out / LAG_PNG),
    ]
    (out / JSON_NAME).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (out / MD_NAME).write_text(render_markdown(report))
    return [out / JSON_NAME, out / MD_NAME, *files]


def render_markdown(report: AuditReport) -> str:
    sections: list[Callable[[AuditReport], list[str]]] = [
        _verdict, _totals, _latency, _queues, _violations, _gaps, _duplicates, _domain, _plots,
    ]
    lines: list[str] = []
    for section in sections:
        part = section(report)
        if part:
            lines.extend([*part, ""])
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _verdict(r: AuditReport) -> list[str]:
    when = datetime.fromtimestamp(r.started_at_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    head = [f"# Ordering audit: group `{r.group}` on topic `{r.topic}`", "",
            f"Audited {when} in {r.seconds:.1f} s; order checked per {r.ordering}"
            + (" (key lanes by first key: a ledger that records no key hashes)"
               if r.ordering == "key" and r.key_lanes == "first_key" else "")
            + (f", domain order by body field `{r.order_field}`" if r.order_field else "") + ".", ""]
    if r.ok:
        return [*head, "**PASS**: no order violation, no gap."]
    return [*head, "**FAIL**:", "", *(f"- {f}" for f in r.failures())]


def _totals(r: AuditReport) -> list[str]:
    rows = [
        ("ledger records", r.ledger_records), ("messages stored", r.messages_stored),
        ("delivered", r.messages_delivered), ("succeeded", r.messages_succeeded),
        ("dead-lettered", r.messages_dead_lettered), ("pending (not consumed yet)", r.pending),
        ("order violations", r.violation_count), ("gaps", r.gap_count),
        ("duplicates after an epoch change", r.duplicates_epoch_change), ("other duplicates", r.duplicates_other),
    ]
    if r.order_field:
        rows += [(f"`{r.order_field}` order violations", r.domain_violation_count),
                 (f"messages without `{r.order_field}`", r.missing_order_field)]
    if r.malformed_records:
        rows.append(("malformed ledger records (skipped)", r.malformed_records))
    if r.ledger_trimmed:
        rows += [("ledger records trimmed by Redis", r.ledger_trimmed),
                 ("messages below the ledger's oldest record (not gap-checked)", r.unaudited)]
    return ["## Totals", "", "| | count |", "|---|---:|", *(f"| {k} | {v:,} |" for k, v in rows)]


def _latency(r: AuditReport) -> list[str]:
    lat: Latency = r.latency
    return ["## Latency born → handled", "", "| | p50 | p95 | p99 | max | messages |", "|---|---:|---:|---:|---:|---:|",
            f"| all queues | {_ms(lat.p50_ms)} ms | {_ms(lat.p95_ms)} ms | {_ms(lat.p99_ms)} ms | {_ms(lat.max_ms)} ms "
            f"| {lat.count:,} |"]


def _queues(r: AuditReport) -> list[str]:
    out = ["## Per queue", "",
           "| queue | broker:id | stored | succeeded | DLQ | lag | violations | gaps | dup (epoch / other) "
           "| p50 ms | p95 ms | p99 ms |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for q in r.queues:
        out.append(f"| {q.queue} | {q.broker}:{q.queue_id} | {q.stored:,} | {q.succeeded:,} | {q.dead_lettered:,} "
                   f"| {q.lag:,} | {q.violations:,} | {q.gaps:,} | {q.duplicates_epoch_change:,} / "
                   f"{q.duplicates_other:,} | {_ms(q.latency.p50_ms)} | {_ms(q.latency.p95_ms)} "
                   f"| {_ms(q.latency.p99_ms)} |")
    return out


def _key_cell(finding: OrderViolation | Gap | Duplicate | DomainViolation) -> str:
    """A finding's key; a message sent with ``send_orderly`` stores none: then its key hash."""
    if finding.key is not None:
        return f"`{finding.key}`"
    return f"hash {finding.key_hash}" if finding.key_hash is not None else "(none)"


def _more(listed: int, total: int) -> list[str]:
    return [f"({total - listed:,} more in report.json or beyond its listing)"] if total > listed else []


def _violations(r: AuditReport) -> list[str]:
    if not r.violation_count:
        return []
    shown = r.violations[:MD_LISTED]
    return ["## Order violations", "", "A message first delivered after a later offset of its key had been.", "",
            "| key | queue | offset | first delivered after offset |", "|---|---:|---:|---:|",
            *(f"| {_key_cell(v)} | {v.queue} | {v.offset} | {v.after_offset} |" for v in shown),
            *_more(len(shown), r.violation_count)]


def _gaps(r: AuditReport) -> list[str]:
    if not r.gap_count:
        return []
    shown = r.gaps[:MD_LISTED]
    return ["## Gaps", "", "Stored, never handled with SUCCESS nor dead-lettered, and passed over.", "",
            "| key | queue | offset | msg id | why it is a gap |", "|---|---:|---:|---|---|",
            *(f"| {_key_cell(g)} | {g.queue} | {g.offset} | `{g.msg_id}` | {g.reason} |" for g in shown),
            *_more(len(shown), r.gap_count)]


def _duplicates(r: AuditReport) -> list[str]:
    total = r.duplicates_epoch_change + r.duplicates_other
    if not total:
        return []
    shown = r.duplicates[:MD_LISTED]
    return ["## Duplicates", "",
            "Handled with SUCCESS more than once. `epoch_change`: redelivered after a change of owner "
            "(at-least-once across a failover); `same_epoch`: under one owner.", "",
            "| key | queue | offset | successes | epochs | kind |", "|---|---:|---:|---:|---|---|",
            *(f"| {_key_cell(d)} | {d.queue} | {d.offset} | {d.successes} | {', '.join(map(str, d.epochs))} | {d.kind} |"
              for d in shown),
            *_more(len(shown), total)]


def _domain(r: AuditReport) -> list[str]:
    if not r.domain_violation_count:
        return []
    shown = r.domain_violations[:MD_LISTED]
    return [f"## `{r.order_field}` order violations", "",
            f"| key | queue | offset | {r.order_field} | after offset | its {r.order_field} |",
            "|---|---:|---:|---|---:|---|",
            *(f"| {_key_cell(d)} | {d.queue} | {d.offset} | {d.value} | {d.after_offset} | {d.after_value} |" for d in shown),
            *_more(len(shown), r.domain_violation_count)]


def _plots(r: AuditReport) -> list[str]:
    return ["## Plots", "", f"![latency]({LATENCY_PNG})", "", f"![throughput]({THROUGHPUT_PNG})", "",
            f"![lag per queue]({LAG_PNG})"]

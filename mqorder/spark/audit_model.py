"""What an ordering audit finds (``mqorder.spark.audit``): plain dataclasses, no Spark.

Counts are always exact; the lists name each case (key, queue index, offset) up to the audit's
``max_listed``. ``AuditReport.ok`` is what ``mqorder pipeline audit``'s exit code says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class QueueInfo:
    """One queue of the topic as Redis had it when the audit started."""

    index: int
    broker: str
    queue_id: int
    max_offset: int
    committed: int
    #: The first offset still stored (retention may have trimmed below it).
    earliest: int = 0

    @property
    def lag(self) -> int:
        return max(0, self.max_offset - self.committed)


@dataclass(frozen=True)
class OrderViolation:
    key: str | None
    queue: int
    offset: int
    after_offset: int
    first_delivery_ms: float
    #: The lane's sharding key hash (None: the queue's keyless lane, or ``ordering="queue"``).
    key_hash: int | None = None


@dataclass(frozen=True)
class Gap:
    key: str | None
    queue: int
    offset: int
    msg_id: str | None
    reason: str
    key_hash: int | None = None


@dataclass(frozen=True)
class Duplicate:
    key: str | None
    queue: int
    offset: int
    successes: int
    epochs: list[int]
    kind: str  # "epoch_change" | "same_epoch"
    key_hash: int | None = None


@dataclass(frozen=True)
class DomainViolation:
    key: str | None
    queue: int
    offset: int
    value: str
    after_offset: int
    after_value: str
    key_hash: int | None = None


@dataclass(frozen=True)
class Latency:
    count: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None


@dataclass(frozen=True)
class QueueStats:
    queue: int
    broker: str
    queue_id: int
    stored: int
    delivered: int
    succeeded: int
    dead_lettered: int
    pending: int
    unaudited: int
    max_offset: int
    committed: int
    lag: int
    violations: int
    gaps: int
    duplicates_epoch_change: int
    duplicates_other: int
    domain_violations: int
    latency: Latency


def _lane(finding: OrderViolation | Gap | Duplicate | DomainViolation) -> str:
    """How a report line names a finding's lane: its key, else its key hash (``send_orderly`` stores
    no key), else the queue's keyless lane."""
    if finding.key is not None:
        return f"key {finding.key!r}"
    return f"key hash {finding.key_hash}" if finding.key_hash is not None else "keyless"


@dataclass
class AuditReport:
    """Every finding of one audit; ``ok`` is what the CLI's exit code says."""

    topic: str
    group: str
    ordering: str
    order_field: str | None
    started_at_ms: int
    #: Where the gap check starts per queue: ``stored`` (its first stored offset) or ``ledger``
    #: (the first offset its ledger records; forced when Redis trimmed the ledger).
    start: str = "stored"
    #: Whether the stored messages themselves were read (phase 2: something to name, or a body field).
    read_stored: bool = False
    #: Where key lanes came from (``audit_frames.KEY_LANES``): ``key_hash``, or ``first_key`` for a
    #: ledger written by an engine that recorded no key hashes.
    key_lanes: str = "key_hash"
    seconds: float = 0.0
    ledger_records: int = 0
    ledger_trimmed: int = 0
    malformed_records: int = 0
    messages_stored: int = 0
    messages_delivered: int = 0
    messages_succeeded: int = 0
    messages_dead_lettered: int = 0
    pending: int = 0
    unaudited: int = 0
    violation_count: int = 0
    gap_count: int = 0
    duplicates_epoch_change: int = 0
    duplicates_other: int = 0
    domain_violation_count: int = 0
    missing_order_field: int = 0
    latency: Latency = field(default_factory=lambda: Latency(0, None, None, None, None))
    latency_histogram: list[tuple[float, float, int]] = field(default_factory=list)
    throughput_bucket_s: int = 1
    throughput: list[tuple[int, int]] = field(default_factory=list)
    queues: list[QueueStats] = field(default_factory=list)
    violations: list[OrderViolation] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    duplicates: list[Duplicate] = field(default_factory=list)
    domain_violations: list[DomainViolation] = field(default_factory=list)

    @property
    def order_field_unused(self) -> bool:
        """An ``order_field`` no stored message has: the domain-order check checked nothing (a
        misspelt ``--order-field sequ`` passed, its only trace a count in the report)."""
        return bool(self.order_field) and self.messages_stored > 0 and self.missing_order_field >= self.messages_stored

    @property
    def ok(self) -> bool:
        return (self.violation_count == 0 and self.gap_count == 0 and self.domain_violation_count == 0
                and not self.order_field_unused)

    def failures(self) -> list[str]:
        """One line per kind of failure, naming the first few cases (empty when ``ok``)."""
        out = []
        if self.violation_count:
            first = "; ".join(f"{_lane(v)} queue {v.queue} offset {v.offset} first handled after offset "
                              f"{v.after_offset}" for v in self.violations[:3])
            out.append(f"{self.violation_count} order violation(s): {first}")
        if self.gap_count:
            first = "; ".join(f"{_lane(g)} queue {g.queue} offset {g.offset} ({g.reason})" for g in self.gaps[:3])
            out.append(f"{self.gap_count} gap(s), stored but never handled nor dead-lettered: {first}")
            if self.start == "stored" and any(g.reason.startswith("below the committed offset") for g in self.gaps):
                out.append("if the ledger was switched on after this group began consuming, audit from the "
                           "ledger's first records instead: --start ledger (start='ledger')")
        if self.domain_violation_count:
            first = "; ".join(f"{_lane(d)} queue {d.queue} offset {d.offset}: {self.order_field}={d.value} after "
                              f"{d.after_value} (offset {d.after_offset})" for d in self.domain_violations[:3])
            out.append(f"{self.domain_violation_count} {self.order_field} order violation(s): {first}")
        if self.order_field_unused:
            out.append(f"no stored message has a body field {self.order_field!r} ({self.missing_order_field:,} "
                       "without it), so its order was not checked: check the name (--order-field / order_field)")
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["failures"] = self.failures()
        return d

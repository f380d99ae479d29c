"""``mqorder txn TOPIC``: the topic's transactions still half-way, and how recent ones ended.

The check-back (``mqorder.client.transaction_check``) records every end in its queue's outcome log
(``keys.txn_log``): COMMIT at which offset, or ROLLBACK, by the producer or the check-back, and why
(``still UNKNOWN after 15 check-backs ...``). This is where an operator reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from mqorder.admin.common import Admin
from mqorder.rebalance.membership import redis_now_ms
from mqorder.store.append import QueueAppender
from mqorder.store.transactions import HalfStore, Outcome


@dataclass(frozen=True)
class HalfRow:
    queue: str
    txid: str
    age_s: float
    checks: int
    next_check_in_s: float


@dataclass
class TxnReport:
    topic: str
    half: list[HalfRow] = field(default_factory=list)
    ended: list[tuple[str, Outcome]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"topic": self.topic, "half": [asdict(h) for h in self.half],
                "ended": [{"queue": q, **asdict(o)} for q, o in self.ended]}


def txn_report(admin: Admin, topic: str, last: int = 20) -> TxnReport:
    """Half messages of every queue of ``topic``, and the ``last`` outcomes of each queue."""
    route = admin.route(topic)
    store = HalfStore(admin.brokers, QueueAppender(admin.brokers, pending_ttl_ms=0, timeout=3.0), timeout=3.0)
    now = redis_now_ms(admin.brokers.meta)
    report = TxnReport(topic)
    for mq in route.message_queues:
        q = f"{mq.broker_name}:{mq.queue_id}"
        for txid, prepared, checks, next_ms in store.pending_details(mq):
            report.half.append(HalfRow(q, txid, (now - prepared) / 1000, checks, max(0, next_ms - now) / 1000))
        report.ended += [(q, o) for o in store.outcomes(mq)[-last:] if last]
    return report


def render(console: Console, report: TxnReport) -> None:
    half = Table(title=f"{report.topic}: {len(report.half)} transaction(s) half-way")
    for col in ("queue", "txid", "age", "checks", "next check in"):
        half.add_column(col)
    for h in report.half:
        half.add_row(h.queue, h.txid, f"{h.age_s:.1f}s", str(h.checks), f"{h.next_check_in_s:.1f}s")
    console.print(half)
    ended = Table(title="recent ends")
    for col in ("queue", "txid", "outcome", "offset", "by", "checks", "reason"):
        ended.add_column(col)
    for q, o in report.ended:
        ended.add_row(q, o.txid, o.outcome, str(o.offset) if o.offset >= 0 else "-", o.by, str(o.checks), o.reason)
    console.print(ended)

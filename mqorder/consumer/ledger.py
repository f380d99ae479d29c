"""The consumption ledger: one record per handled message, for audits (opt-in).

A record says which message (group, topic, queue, offset, msg id, key, born time) was handled, in
which lane (``key_hash``: the sharding key's hash a key-ordered listener orders by, -1 for none),
when (handle start and end, ms since the epoch), at which attempt, under which fencing epoch, by
which client and run, and how it ended: ``SUCCESS``, ``SUSPEND`` (to be retried) or ``DLQ``. An
audit (``mqorder.spark.audit``) rebuilds from these what the consumer really did: order per key,
gaps, duplicates after a failover, latency.

Records are buffered per ConsumeRequest run and written with ``ledger.lua`` pipelined behind the
batch's fenced commit (``LedgerBuffer.queue_in``): one extra ``EVALSHA`` per pulled batch. A
record is written even when the commit was refused: the listener *was* called, and a redelivery to
the new owner is exactly what an audit must be able to see.

The records of a batch are taken out of the buffer once (``take``), before the round trip, so that
the commit pipeline (``ConsumeRequest._commit_pipelined``) can send them again after a ``NOSCRIPT``
only if they were refused too: a commit that ran is never sent twice, records that were written
are never written twice, and records refused with it are not lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from mqorder import keys
from mqorder.consumer.key_lanes import lane_key
from mqorder.model import MessageExt
from mqorder.store.raw_pipe import ConnectionLease
from mqorder.store.scripts import Scripts


class LedgerOutcome(StrEnum):
    SUCCESS = "SUCCESS"
    SUSPEND = "SUSPEND"
    DLQ = "DLQ"
    #: A concurrent listener did not acknowledge it: sent back to ``%RETRY%<group>``, finished here.
    RETRY = "RETRY"


#: The fields of one record, in the order a reader should show them.
FIELDS = (
    "group", "topic", "broker", "queue", "offset", "msg_id", "key", "key_hash", "born_ms", "start_ms",
    "end_ms", "attempt", "epoch", "client", "run", "outcome",
)



def message_key(msg: MessageExt) -> str:
    """The key a ledger records for a message: its first key (``send_orderly_batch`` and the Spark
    writer store the sharding key there), else ``""``."""
    return msg.keys[0] if isinstance(msg.keys, list) and msg.keys and isinstance(msg.keys[0], str) else ""


@dataclass
class LedgerBuffer:
    """Records of one run not yet written; flushed with the next fenced commit."""

    group: str
    client_id: str
    run_id: str
    max_len: int
    records: list[bytes] = field(default_factory=list)

    def note(
        self, msgs: list[MessageExt], outcome: LedgerOutcome, start_ms: float, end_ms: float, epoch: int
    ) -> None:
        for m in msgs:
            self.records.append(orjson.dumps({
                "group": self.group, "topic": m.topic, "broker": m.broker_name, "queue": m.queue_id,
                "offset": m.queue_offset, "msg_id": m.msg_id if isinstance(m.msg_id, str) else "",
                "key": message_key(m),
                "key_hash": lane_key(m), "born_ms": m.born_timestamp, "start_ms": round(start_ms, 3),
                "end_ms": round(end_ms, 3), "attempt": m.reconsume_times, "epoch": epoch,
                "client": self.client_id, "run": self.run_id, "outcome": outcome.value,
            }))

    def take(self) -> list[bytes]:
        """The buffered records, which the buffer forgets: the caller writes them."""
        records, self.records = self.records, []
        return records

    def queue_in(self, pipe: Any, scripts: Scripts, records: list[bytes]) -> None:
        """Queue ``EVALSHA`` of ``ledger.lua`` writing ``records`` on ``pipe`` (the caller handles a
        ``NOSCRIPT`` reply: ``ConsumeRequest._commit_pipelined``)."""
        scripts.queue_in(pipe, "ledger", [keys.ledger(self.group)], [self.max_len, *records])

    def write(self, scripts: Scripts, records: list[bytes], via: ConnectionLease | None = None) -> None:
        """Write ``records`` in a round trip of their own (``Scripts.call`` reloads on NOSCRIPT)."""
        if records:
            scripts.call("ledger", [keys.ledger(self.group)], [self.max_len, *records], via=via)

    def flush(self, scripts: Scripts) -> None:
        """Write what is left at the end of a run (a run that stopped without a last commit)."""
        self.write(scripts, self.take())


def decode_record(raw: bytes) -> dict[str, Any]:
    """One stored record as a dict with every field of ``FIELDS``."""
    rec = orjson.loads(raw)
    return {f: rec.get(f) for f in FIELDS}

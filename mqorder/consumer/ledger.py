"""The consumption ledger: one record per handled message, for audits (opt-in).

A record says which message (group, topic, queue, offset, msg id, key, born time) was handled,
when (handle start and end, ms since the epoch), at which attempt, under which fencing epoch, by
which client and run, and how it ended: ``SUCCESS``, ``SUSPEND`` (to be retried) or ``DLQ``. An
audit (``mqorder.spark.audit``) rebuilds from these what the consumer really did: order per key,
gaps, duplicates after a failover, latency.

Records are buffered per ConsumeRequest run and written with ``ledger.lua`` pipelined behind the
batch's fenced commit (``LedgerBuffer.queue_in``): one extra command per pulled batch. A record is
written even when the commit was refused: the listener *was* called, and a redelivery to the new
owner is exactly what an audit must be able to see.

Behind the commit it is still sent with ``EVAL``, not ``EVALSHA``: the commit pipeline
(``ConsumeRequest._commit_pipelined``) answers ``NOSCRIPT`` by loading the *commit* script and
sending everything again, which is safe only because the records cannot be refused: a refused
``EVALSHA`` of the ledger would lose the batch's records after a Redis restart, or, where the commit
script was loaded and the ledger's not, send a commit that ran a second time. ``ledger.lua``
includes no prelude, so that ``EVAL`` carries 0.7 KB, not the 12 KB it did when every script
carried every prelude. ``flush``, a round trip of its own, runs it by SHA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson
import redis

from mqorder import keys
from mqorder.model import MessageExt
from mqorder.store.scripts import source


class LedgerOutcome(StrEnum):
    SUCCESS = "SUCCESS"
    SUSPEND = "SUSPEND"
    DLQ = "DLQ"
    #: A concurrent listener did not acknowledge it: sent back to ``%RETRY%<group>``, finished here.
    RETRY = "RETRY"


#: The fields of one record, in the order a reader should show them.
FIELDS = (
    "group", "topic", "broker", "queue", "offset", "msg_id", "key", "born_ms", "start_ms", "end_ms",
    "attempt", "epoch", "client", "run", "outcome",
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
                "key": message_key(m), "born_ms": m.born_timestamp, "start_ms": round(start_ms, 3),
                "end_ms": round(end_ms, 3), "attempt": m.reconsume_times, "epoch": epoch,
                "client": self.client_id, "run": self.run_id, "outcome": outcome.value,
            }))

    def queue_in(self, pipe: Any) -> None:
        """Queue the buffered records on ``pipe`` (one command, if there are any) and forget them."""
        if self.records:
            pipe.execute_command("EVAL", source("ledger"), 1, keys.ledger(self.group), self.max_len, *self.records)
            self.records = []

    def flush(self, client: redis.Redis) -> None:
        """Write what is left at the end of a run (a run that stopped without a last commit).

        By SHA: redis-py's ``Script`` loads it on ``NOSCRIPT`` and sends it again, which is safe
        here because nothing else rides in this round trip.
        """
        if self.records:
            script = client.register_script(source("ledger"))
            script(keys=[keys.ledger(self.group)], args=[self.max_len, *self.records])
            self.records = []


def decode_record(raw: bytes) -> dict[str, Any]:
    """One stored record as a dict with every field of ``FIELDS``."""
    rec = orjson.loads(raw)
    return {f: rec.get(f) for f in FIELDS}

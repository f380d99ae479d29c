"""``HalfStore``: the half messages of transactional sends, and their end (commit or rollback).

The shape is the Spark writer's all-or-nothing staging (``mqorder.spark.staging``): what is not
decided yet lives beside the queue's log, in the queue's hash tag, where no consumer reads; one
script moves it into the log through the one append path, or drops it. Step by step:

1. ``prepare`` (``txn_prepare.lua``): the half message is stored with a check-back deadline of
   now + ``transaction_timeout_ms``; the topic is recorded in ``mqorder:txn:topics`` *first*, so the
   check-back can never miss a half message.
2. ``end`` (``txn_end.lua``): COMMIT appends it to the log at the next offset (the position of the
   commit, so committed messages of a key are in commit order) and wakes the queue's owner;
   ROLLBACK drops it. Either way the outcome and its reason go to the queue's capped outcome log
   in the same step, and a second end (the producer and the check-back racing) is ``GONE``.
3. ``due`` (``txn_due.lua``): the check-back claims the half messages whose deadline passed,
   counting each check, and pushes their next check back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from mqorder import keys
from mqorder.codec import decode_entries
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.failures import translated
from mqorder.store.indexed import run_indexed
from mqorder.store.replies import text

#: About how many outcomes each queue's outcome log keeps.
OUTCOME_LOG_LEN = 10_000


class TxnEnd(enum.Enum):
    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    #: Somebody ended it first (the producer, or the check-back): nothing changed.
    GONE = "GONE"


@dataclass(frozen=True)
class EndReply:
    verdict: TxnEnd
    offset: int = -1
    store_ms: int = 0


@dataclass(frozen=True)
class HalfMessage:
    """A half message the check-back claimed: ``checks`` counts this check too."""

    mq: MessageQueue
    txid: str
    message: MessageExt
    checks: int
    prepared_ms: int


@dataclass(frozen=True)
class Outcome:
    """One line of a queue's outcome log: how a transaction ended, by whom and why."""

    txid: str
    outcome: str
    reason: str
    by: str
    checks: int
    offset: int


class HalfStore:
    def __init__(self, brokers: BrokerRegistry, appender: QueueAppender, *, timeout: float) -> None:
        self.brokers = brokers
        self.appender = appender
        self.timeout = timeout

    def prepare(self, mq: MessageQueue, txid: str, header: bytes, body: bytes, transaction_timeout_ms: int) -> int:
        """Phase one: store the half message; returns when it was prepared (ms, Redis clock)."""
        broker = self.brokers.get(mq.broker_name)
        with translated(broker.name, broker.safe_url, self.timeout, "prepare"):
            self.appender.check_capacity(broker, "prepare")
            reply = run_indexed(self.brokers, keys.txn_topics(), mq.topic, broker, "txn_prepare",
                                [keys.txn_index(mq.tag), keys.txn_half(mq.tag)],
                                [txid, header, body, transaction_timeout_ms])
        return int(reply[0])

    def end(self, mq: MessageQueue, txid: str, verdict: TxnEnd, reason: str, by: str) -> EndReply:
        """Phase two: commit (append at the next offset) or roll back, exactly once."""
        broker = self.brokers.get(mq.broker_name)
        tag = mq.tag
        state_keys, wake_args = self.appender.wake_tail(mq)
        kl = [keys.queue_log(tag), keys.queue_next(tag), keys.txn_index(tag), keys.txn_half(tag), keys.txn_log(tag),
              *state_keys]
        args: list[Any] = [txid, verdict.value, reason, by, OUTCOME_LOG_LEN, self.appender.pending_ttl_ms,
                           keys.wake_channel(""), *wake_args]
        with translated(broker.name, broker.safe_url, self.timeout, "end transaction"):
            reply = broker.scripts.txn_end(keys=kl, args=args)
        got = TxnEnd(text(reply[0]))
        if got is TxnEnd.COMMIT:
            return EndReply(got, int(reply[1]), int(reply[2]))
        return EndReply(got)

    def due(self, mq: MessageQueue, limit: int, recheck_ms: int, max_message_size: int) -> list[HalfMessage]:
        """Claim the half messages of ``mq`` due for a check-back (each check counted)."""
        broker = self.brokers.get(mq.broker_name)
        raw = broker.scripts.txn_due(keys=[keys.txn_index(mq.tag), keys.txn_half(mq.tag)], args=[limit, recheck_ms])
        out = []
        for i in range(0, len(raw), 5):
            txid, header, body, checks, prepared = raw[i : i + 5]
            (msg,) = decode_entries(mq, [(b"0-1", [b"h", header, b"b", body, b"s", b"0"])],
                                    max_message_size=max_message_size)
            msg.queue_offset = -1
            out.append(HalfMessage(mq, text(txid), msg, int(checks), int(prepared)))
        return out

    def pending_details(self, mq: MessageQueue) -> list[tuple[str, int, int, int]]:
        """(txid, prepared ms, checks so far, next check ms) of each half message of ``mq``."""
        client = self.brokers.get(mq.broker_name).client
        due: Any = client.zrange(keys.txn_index(mq.tag), 0, -1, withscores=True)
        if not due:
            return []
        fields = [f"{text(t)}:{x}" for t, _ in due for x in ("t", "n")]
        raw: Any = client.hmget(keys.txn_half(mq.tag), fields)
        return [(text(t), int(raw[2 * i] or 0), int(raw[2 * i + 1] or 0), int(score))
                for i, (t, score) in enumerate(due)]

    def pending(self, mq: MessageQueue) -> list[str]:
        """Txids of the half messages of ``mq`` not ended yet."""
        client = self.brokers.get(mq.broker_name).client
        return [text(t) for t in client.zrange(keys.txn_index(mq.tag), 0, -1)]

    def outcomes(self, mq: MessageQueue) -> list[Outcome]:
        """The outcome log of ``mq``, oldest first."""
        client = self.brokers.get(mq.broker_name).client
        out = []
        raw: Any = client.xrange(keys.txn_log(mq.tag))
        for _, fields in raw:
            pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2], strict=False)
            f = {text(k): text(v) for k, v in pairs}
            out.append(Outcome(f["txid"], f["outcome"], f["reason"], f["by"], int(f["checks"]), int(f["offset"])))
        return out

    def topics(self) -> list[str]:
        return sorted(text(t) for t in self.brokers.meta.smembers(keys.txn_topics()))

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

Durable transactions (a ``SendWait``, ``mqorder.store.durable``): Redis replicates asynchronously,
so a prepare or a commit the primary acknowledged may be on no replica when Sentinel promotes one.
With a wait, the script is followed in its round trip, on its connection, by the fence write
(``INCRBY <queue's next offset> 0``: a retried prepare or a second end writes nothing, and ``WAIT``
counts only its own connection's writes) and ``WAIT``, exactly as a durable send:

* ``prepare`` first checks the connected replicas (``NotEnoughReplicasError``, nothing stored). If
  fewer acknowledge in time, the half message is rolled back at once (recorded in the outcome log)
  and ``ReplicasBehindError`` raised: the local transaction must not run on a prepare a failover
  could lose (RocketMQ rolls back on ``SLAVE_NOT_AVAILABLE`` / ``FLUSH_SLAVE_TIMEOUT`` the same way).
  When the queue is on another broker than the check-back's index (``keys.txn_topics``, on the
  default broker), the index entry is waited for too, in the round trip it takes anyway: a half
  message the check-back cannot find after a failover would stay half for good.
* a COMMIT is never refused for missing replicas (the local transaction has committed: refusing
  would only hand it to the check-back, which would meet the same replicas); it is applied and
  waited for, and a shortfall raises ``ReplicasBehindError`` saying the commit IS applied.
* a ROLLBACK does not wait. One lost in a failover leaves the half message on the promoted replica
  (its prepare was replicated); the check-back finds it and asks the topic's checker, whose
  ROLLBACK (or, after ``transaction_check_max`` UNKNOWNs, the check-back itself) ends it again.
  Nothing becomes visible that the local transaction did not commit, so the round trip is spared.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mqorder import keys
from mqorder.codec import decode_entries
from mqorder.errors import MQOrderError
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import Broker, BrokerRegistry
from mqorder.store.durable import SendWait, behind_error
from mqorder.store.failures import translated
from mqorder.store.indexed import run_indexed
from mqorder.store.raw_pipe import RawPipeline
from mqorder.store.replies import text

#: About how many outcomes each queue's outcome log keeps.
OUTCOME_LOG_LEN = 10_000

#: What ``ReplicasBehindError`` of a prepare says happened next, and what to do.
PREPARE_BEHIND = (
    "The half message {undone}, and the local transaction was NOT run (as RocketMQ does when a half "
    "message is not replicated): nothing of it becomes visible, and send_in_transaction again is safe (a "
    "new transaction). Should a failover bring the half message back, the check-back asks the topic's "
    "@transaction_checker about it, which must answer ROLLBACK for a transaction that never ran"
)
#: What ``ReplicasBehindError`` of a commit says: it is applied, and what a failover would do to it.
COMMIT_BEHIND = (
    "Do not send the message again (a second send_in_transaction is a second message); "
    "end_transaction(COMMIT) for this transaction again is safe: it changes nothing and waits for the "
    "replicas again. Should a failover lose the commit, the promoted replica still has the half message "
    "if its prepare reached it (a prepare with wait_replicas did), and the check-back asks the topic's "
    "@transaction_checker again: its COMMIT commits it again, at a new offset (a consumer of the old "
    "primary may then see it twice)"
)


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


def _outcome(fields: Any) -> Outcome:
    """One entry of the outcome log (``txn_end.lua``'s XADD), as read by redis-py."""
    pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2], strict=False)
    f = {text(k): text(v) for k, v in pairs}
    return Outcome(f["txid"], f["outcome"], f["reason"], f["by"], int(f["checks"]), int(f["offset"]))


def _end_reply(reply: Any) -> EndReply:
    got = TxnEnd(text(reply[0]))
    if got is TxnEnd.COMMIT:
        return EndReply(got, int(reply[1]), int(reply[2]))
    return EndReply(got)


class HalfStore:
    def __init__(self, brokers: BrokerRegistry, appender: QueueAppender, *, timeout: float) -> None:
        self.brokers = brokers
        self.appender = appender
        self.timeout = timeout

    def prepare(self, mq: MessageQueue, txid: str, header: bytes, body: bytes, transaction_timeout_ms: int,
                *, wait: SendWait | None = None, by: str = "producer") -> int:
        """Phase one: store the half message; returns when it was prepared (ms, Redis clock).

        With ``wait`` it returns only once ``wait.replicas`` replicas have it (module docstring):
        ``NotEnoughReplicasError`` before anything is stored, or ``ReplicasBehindError`` after the
        half message was rolled back again (``by`` is recorded as who rolled it back).
        """
        broker = self.brokers.get(mq.broker_name)
        kl = [keys.txn_index(mq.tag), keys.txn_half(mq.tag)]
        args: list[Any] = [txid, header, body, transaction_timeout_ms]
        if wait is None or wait.replicas <= 0:
            with translated(broker.name, broker.safe_url, self.timeout, "prepare"):
                self.appender.check_capacity(broker, "prepare")
                reply = run_indexed(self.brokers, keys.txn_topics(), mq.topic, broker, "txn_prepare", kl, args)
            return int(reply[0])
        action = f"prepare of transaction {txid}"
        gate = self.appender.replicas
        index = self.brokers.default
        sadd = ("SADD", keys.txn_topics(), mq.topic)
        with translated(broker.name, broker.safe_url, self.timeout, "prepare"):
            self.appender.check_capacity(broker, "prepare")
            gate.before_write(broker, wait, action)
        behind: list[str] = []
        if index is not broker:
            with translated(index.name, index.safe_url, self.timeout, "prepare"):
                gate.before_write(index, wait, action)
                # The index entry first (the check-back must never miss a half message), waited
                # for behind a fence on the default broker's topology counter (a string every
                # topic's creation bumped; adding 0 changes nothing a worker watches).
                acked = int(self._round_trip(index, [sadd], None, (), (),
                                             wait.commands(keys.topology_version()))[-1])
            if acked < wait.replicas:
                behind.append(gate.behind(index, wait, acked, 1, action,
                                          what=f"the check-back's index entry of topic {mq.topic!r} IS stored"))
        before = [sadd] if index is broker else []
        with translated(broker.name, broker.safe_url, self.timeout, "prepare"):
            out = self._round_trip(broker, before, "txn_prepare", kl, args, wait.commands(keys.queue_next(mq.tag)))
        prepared_ms, acked = int(out[len(before)][0]), int(out[-1])
        if acked < wait.replicas:
            behind.append(gate.behind(broker, wait, acked, 1, action, what="the half message IS stored"))
        if not behind:
            return prepared_ms
        reason = (f"prepare: the half message was not on {wait.replicas} replica(s) within {wait.timeout_ms} ms "
                  "(wait_replicas); rolled back before the local transaction ran")
        try:
            self.end(mq, txid, TxnEnd.ROLLBACK, reason, by)
            undone = "was then rolled back on the primary (the queue's outcome log says why)"
        except (MQOrderError, redis.RedisError) as exc:
            undone = (f"could not be rolled back now ({exc}): it stays half, and the check-back asks the topic's "
                      "@transaction_checker about it")
        raise behind_error(behind, PREPARE_BEHIND.format(undone=undone))

    @staticmethod
    def _round_trip(broker: Broker, before: Sequence[tuple[Any, ...]], script: str | None, kl: Sequence[Any],
                    args: Sequence[Any], then: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``before``, the script (if any), then ``then``, in one pipeline on one connection: the
        replies of all. ``WAIT`` in ``then`` counts this connection's writes (``mqorder.store.durable``).

        ``NOSCRIPT`` means the script did not run: it is loaded and everything is sent again (each
        of ``before`` must be idempotent, as the index's ``SADD`` is; the fence and ``WAIT`` are).
        """
        for attempt in (0, 1):
            pipe = RawPipeline(broker.client)
            for cmd in before:
                pipe.execute_command(*cmd)
            if script is not None:
                broker.scripts.queue_in(pipe, script, kl, args)
            for cmd in then:
                pipe.execute_command(*cmd)
            try:
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt or script is None:
                    raise
                broker.scripts.load(script)
        raise AssertionError("unreachable")  # pragma: no cover

    def end(self, mq: MessageQueue, txid: str, verdict: TxnEnd, reason: str, by: str,
            *, wait: SendWait | None = None, uncounted: int = 0) -> EndReply:
        """Phase two: commit (append at the next offset) or roll back, exactly once.

        With ``wait`` a COMMIT returns only once ``wait.replicas`` replicas have it: fence and
        ``WAIT`` behind the script, in its round trip. Fewer in time: ``ReplicasBehindError``, the
        commit IS applied on the primary (the message visible in its queue). A ROLLBACK does not
        wait (module docstring: one lost in a failover is checked back and rolled back again).
        """
        broker = self.brokers.get(mq.broker_name)
        tag = mq.tag
        state_keys, wake_args = self.appender.wake_tail(mq)
        kl = [keys.queue_log(tag), keys.queue_next(tag), keys.txn_index(tag), keys.txn_half(tag), keys.txn_log(tag),
              *state_keys]
        args: list[Any] = [txid, verdict.value, reason, by, OUTCOME_LOG_LEN, self.appender.pending_ttl_ms,
                           self.appender.wake_prefix(mq), uncounted, *wake_args]
        if verdict is not TxnEnd.COMMIT or wait is None or wait.replicas <= 0:
            with translated(broker.name, broker.safe_url, self.timeout, "end transaction"):
                reply = broker.scripts.txn_end(keys=kl, args=args)
            return _end_reply(reply)
        # A commit already made (GONE: by the check-back, or an earlier end) writes nothing now:
        # the fence makes this WAIT cover it all the same.
        with translated(broker.name, broker.safe_url, self.timeout, "end transaction"):
            raw, tail = broker.scripts.run_many_then([("txn_end", kl, args)], wait.commands(keys.queue_next(tag)))
        got = _end_reply(raw[0])
        acked = int(tail[-1])
        if acked < wait.replicas:
            if got.verdict is TxnEnd.COMMIT:
                what = f"the commit IS applied (the message is visible in {mq.key} at offset {got.offset})"
            else:
                ended = self.outcome_of(mq, txid)
                how = (f" as {ended.outcome} by {ended.by} ({ended.reason})" if ended is not None
                       else " (by the check-back or an earlier end)")
                # A ROLLBACK there means this COMMIT stored nothing: said here, or the caller read
                # "IS applied" as its commit (a review's finding).
                what = f"the transaction was already ended{how}, and that end IS applied"
            raise behind_error([self.appender.replicas.behind(broker, wait, acked, 1, f"commit of transaction {txid}",
                                                              what=what)], COMMIT_BEHIND)
        return got

    def due(self, mq: MessageQueue, limit: int, recheck_ms: int, max_message_size: int) -> list[HalfMessage]:
        """Claim the half messages of ``mq`` due for a check-back (each check counted)."""
        broker = self.brokers.get(mq.broker_name)
        with translated(broker.name, broker.safe_url, self.timeout, "claim half messages"):
            raw = broker.scripts.txn_due(keys=[keys.txn_index(mq.tag), keys.txn_half(mq.tag)],
                                         args=[limit, recheck_ms])
        out = []
        for i in range(0, len(raw), 5):
            txid, header, body, checks, prepared = raw[i : i + 5]
            (msg,) = decode_entries(mq, [(b"0-1", [b"h", header, b"b", body, b"s", b"0"])],
                                    max_message_size=max_message_size)
            msg.queue_offset = -1
            out.append(HalfMessage(mq, text(txid), msg, int(checks), int(prepared)))
        return out

    def give_back(self, mq: MessageQueue, txids: list[str]) -> int:
        """Undo ``due``'s claim of ``txids`` that were not asked about (their check count back,
        due again at once); those ended meanwhile are left alone. Returns how many were given back."""
        if not txids:
            return 0
        broker = self.brokers.get(mq.broker_name)
        with translated(broker.name, broker.safe_url, self.timeout, "give back half messages"):
            return int(broker.scripts.txn_unclaim(keys=[keys.txn_index(mq.tag), keys.txn_half(mq.tag)], args=txids))

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
        raw: Any = client.xrange(keys.txn_log(mq.tag))
        return [_outcome(fields) for _, fields in raw]

    def outcome_of(self, mq: MessageQueue, txid: str, page: int = 500) -> Outcome | None:
        """How ``txid`` ended, from ``mq``'s outcome log read newest first (None: not in the
        capped log, or never ended). Read only after an end was ``GONE``: who ended it first."""
        client = self.brokers.get(mq.broker_name).client
        top: Any = "+"
        while True:
            raw: Any = client.xrevrange(keys.txn_log(mq.tag), max=top, min="-", count=page)
            for entry_id, fields in raw:
                got = _outcome(fields)
                if got.txid == txid:
                    return got
                top = "(" + text(entry_id)
            if len(raw) < page:
                return None

    def topics(self) -> list[str]:
        """The topics that ever had half messages (``prepare`` records each first)."""
        meta = self.brokers.default
        with translated(meta.name, meta.safe_url, self.timeout, "list transaction topics", write=False):
            return sorted(text(t) for t in meta.client.smembers(keys.txn_topics()))

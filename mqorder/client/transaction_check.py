"""The check-back of transactional messages: ``@transaction_checker`` and ``TransactionCheckService``.

RocketMQ's broker scans its half messages every ``transactionCheckInterval`` and asks a producer of
the group (``checkLocalTransaction``) about each one older than ``transactionTimeout`` (6 s), at
most ``transactionCheckMax`` (15) times, then discards it. Here a beat task of the Celery adapter
(``mqorder.transaction_check``) runs ``TransactionCheckService.check_once`` on some worker, which
asks the checker registered for the message's topic (import it through ``MQORDER_LISTENERS``):

    @transaction_checker(topic="orders")
    def check(msg: MessageExt) -> LocalTransactionState:
        return COMMIT if db.has_debit(msg.msg_id) else UNKNOWN

COMMIT and ROLLBACK end the transaction (``txn_end.lua``, exactly once even if the producer ends
it at the same moment); UNKNOWN, an exception or no checker at all leave it for the next check;
the check after the last allowed one rolls it back and records why, in the queue's outcome log.

A COMMIT of the check-back is durable as a producer's is: with ``MQORDER_SEND_WAIT_REPLICAS=n``
(the worker's setting) it waits for ``n`` replicas (``mqorder.store.transactions``). Short of them
the commit IS applied; the pass logs it, lists it in ``CheckReport.unreplicated`` and goes on with
the other half messages (raising would leave them to the next pass for no gain). Should a failover
then lose the commit, the half message is back on the promoted replica and is simply checked again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from mqorder.client.transaction import LocalTransactionState, as_state, check_callback
from mqorder.errors import BrokerUnavailableError, ListenerError, ReplicasBehindError
from mqorder.model import MessageExt, MessageQueue
from mqorder.names import check_topic
from mqorder.settings import Settings
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.durable import SendWait
from mqorder.store.topics import TopicManager
from mqorder.store.transactions import EndReply, HalfMessage, HalfStore, TxnEnd

log = logging.getLogger(__name__)

#: ``checker(msg) -> LocalTransactionState``
TransactionChecker = Callable[[MessageExt], "LocalTransactionState | None"]
#: Half messages claimed per queue per check (the rest wait for the next run).
CHECK_BATCH = 100

_checkers: dict[str, TransactionChecker] = {}


def transaction_checker(*, topic: str) -> Callable[[TransactionChecker], TransactionChecker]:
    """Register the function that tells the check-back the state of ``topic``'s transactions."""
    check_topic(topic)

    def register(fn: TransactionChecker) -> TransactionChecker:
        check_callback(fn, 1, f"@transaction_checker(topic={topic!r})", "(msg) -> LocalTransactionState",
                       ListenerError)
        known = _checkers.get(topic)
        if known is not None and known is not fn and _qualname(known) != _qualname(fn):
            raise ListenerError(
                f"topic {topic!r} already has a transaction checker ({_qualname(known)}); register one per topic"
            )
        _checkers[topic] = fn
        return fn

    return register


def get_transaction_checker(topic: str) -> TransactionChecker | None:
    return _checkers.get(topic)


def transaction_checker_topics() -> list[str]:
    """The topics this process has a ``@transaction_checker`` for."""
    return sorted(_checkers)


def _qualname(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass
class CheckReport:
    checked: int = 0
    committed: int = 0
    rolled_back: int = 0
    unknown: int = 0
    gave_up: list[str] = field(default_factory=list)
    #: Transactions committed whose replicas fell short of ``MQORDER_SEND_WAIT_REPLICAS`` in time.
    unreplicated: list[str] = field(default_factory=list)
    #: Queues whose turn a broker error ended (claiming, or ending a transaction): left to the next pass.
    failed_queues: list[str] = field(default_factory=list)
    #: Transactions ended by someone else (the producer's own end) while this pass asked about them:
    #: this pass's end changed nothing, and is counted here, not as a commit or a rollback.
    ended_elsewhere: list[str] = field(default_factory=list)


class TransactionCheckService:
    """One check-back pass over every queue of every topic that had half messages."""

    def __init__(self, brokers: BrokerRegistry, settings: Settings) -> None:
        self.brokers = brokers
        self.settings = settings
        self.topics = TopicManager(brokers)
        appender = QueueAppender(brokers, pending_ttl_ms=settings.pending_ttl_ms,
                                 timeout=settings.send_msg_timeout_ms / 1000, topics=self.topics)
        self.store = HalfStore(brokers, appender, timeout=settings.send_msg_timeout_ms / 1000)
        #: What a commit of the check-back waits for (the settings validated the pair already).
        self.wait = (SendWait(settings.send_wait_replicas, settings.send_wait_timeout_ms)
                     if settings.send_wait_replicas else None)

    def check_once(self) -> CheckReport:
        report = CheckReport()
        # Claimed ones are not asked again for half an interval: the next pass finds them due.
        recheck_ms = max(1, self.settings.transaction_check_interval_ms // 2)
        for topic in self.store.topics():
            try:
                queues = self.topics.describe_topic(topic).message_queues
            except LookupError:
                continue
            for mq in queues:
                self._check_queue(mq, recheck_ms, report)
        return report

    def _check_queue(self, mq: MessageQueue, recheck_ms: int, report: CheckReport) -> None:
        """Claim ``mq``'s due half messages and check each. A broker error ends this queue's turn,
        not the pass (the other queues, maybe on other brokers, go on); the claims not asked about
        are given back, or each would count a check nobody made toward ``transaction_check_max``."""
        try:
            halves = self.store.due(mq, CHECK_BATCH, recheck_ms, self.settings.max_message_size)
        except BrokerUnavailableError as exc:
            log.warning("check-back of %s skipped this pass: %s", mq.key, exc)
            report.failed_queues.append(mq.key)
            return
        for n, half in enumerate(halves):
            try:
                self._check(half, report)
            except BrokerUnavailableError as exc:
                rest = [h.txid for h in halves[n + 1:]]
                report.failed_queues.append(mq.key)
                try:
                    given = self.store.give_back(mq, rest)
                except BrokerUnavailableError as again:
                    log.warning("check-back of %s: ending transaction %s failed (%s), and giving back the %d "
                                "claimed after it failed too (%s): each counted one check it did not get",
                                mq.key, half.txid, exc, len(rest), again)
                else:
                    log.warning("check-back of %s: ending transaction %s failed (%s); it is asked again next pass, "
                                "and the %d claimed after it (%d still half) are due again", mq.key, half.txid, exc,
                                len(rest), given)
                return

    def _check(self, half: HalfMessage, report: CheckReport) -> None:
        report.checked += 1
        limit = self.settings.transaction_check_max
        if half.checks > limit:
            reason = f"still UNKNOWN after {limit} check-backs (transaction_check_max); rolled back"
            # This claim asks nobody: the outcome's check count is the checker's calls (once one more).
            if self._ended_elsewhere(self.store.end(half.mq, half.txid, TxnEnd.ROLLBACK, reason, "check-back",
                                                    uncounted=1), half, report):
                return
            report.rolled_back += 1
            report.gave_up.append(half.txid)
            log.warning("transaction %s on %s: %s", half.txid, half.mq.key, reason)
            return
        checker = get_transaction_checker(half.mq.topic)
        if checker is None:
            log.warning("no @transaction_checker for topic %r on this worker (MQORDER_LISTENERS); transaction %s "
                        "stays half (check %d of %d)", half.mq.topic, half.txid, half.checks, limit)
            report.unknown += 1
            return
        try:
            state = as_state(checker(half.message), f"transaction checker of {half.mq.topic!r}")
        except Exception:
            log.exception("transaction checker of %r raised for %s; counted as UNKNOWN", half.mq.topic, half.txid)
            state = LocalTransactionState.UNKNOWN
        if state is LocalTransactionState.UNKNOWN:
            report.unknown += 1
            return
        verdict = TxnEnd.COMMIT if state is LocalTransactionState.COMMIT else TxnEnd.ROLLBACK
        try:
            reply = self.store.end(half.mq, half.txid, verdict, f"check-back {half.checks} answered {state.value}",
                                   "check-back", wait=self.wait)
        except ReplicasBehindError as exc:  # committed all the same: see the module docstring
            log.warning("transaction %s on %s: %s", half.txid, half.mq.key, exc)
            report.unreplicated.append(half.txid)
        else:
            if self._ended_elsewhere(reply, half, report):
                return
        if verdict is TxnEnd.COMMIT:
            report.committed += 1
        else:
            report.rolled_back += 1

    @staticmethod
    def _ended_elsewhere(reply: EndReply, half: HalfMessage, report: CheckReport) -> bool:
        """Whether the end found the transaction ended already (``GONE``: the producer ended it
        while its checker was asked); then it is counted and logged as such."""
        if reply.verdict is not TxnEnd.GONE:
            return False
        report.ended_elsewhere.append(half.txid)
        log.info("transaction %s on %s was ended by its producer while the check-back asked; nothing changed",
                 half.txid, half.mq.key)
        return True

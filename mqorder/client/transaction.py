"""``TransactionProducer``: RocketMQ's transactional messages (two phases, with check-back).

    producer = TransactionProducer()
    result = producer.send_in_transaction("orders", body, sharding_key="42", executor=debit)

1. Phase one stores a *half* message beside its queue's log (``HalfStore.prepare``): no consumer
   can see it.
2. The local transaction runs: ``executor(msg, arg)`` returns ``LocalTransactionState``.
3. Phase two: COMMIT appends the message to its queue *now*, at the position of the commit (so the
   committed messages of a key are in commit order); ROLLBACK discards it; UNKNOWN (or an
   executor that raised, or a producer that died) leaves it to the check-back.
4. Check-back (``mqorder.client.transaction_check``, a beat task in the Celery adapter): a half
   message older than ``transaction_timeout_ms`` is shown to the ``@transaction_checker`` of its
   topic, at most ``transaction_check_max`` times, then rolled back with that reason recorded.

So a producer killed between the phases leaves a half message that ends visible or rolled back,
never stuck. Orderly topics are fine: the message waits in its key's queue's half store, and its
place among the key's messages is decided by when it commits.

Durable, as a send (``wait_replicas=n``, default ``MQORDER_SEND_WAIT_REPLICAS``): the prepare and
the commit each return only once ``n`` replicas have them (``WAIT`` in the script's round trip,
``mqorder.store.durable``), so a failover cannot lose a half message the executor acted on, nor a
commit the caller was told about. Too few replicas connected: ``NotEnoughReplicasError`` before
anything is stored. A prepare they do not acknowledge in time is rolled back, the executor not run,
and ``ReplicasBehindError`` raised; a commit they do not acknowledge IS applied, and
``ReplicasBehindError`` says so. A rollback does not wait: lost in a failover, it is checked back and
rolled back again (``mqorder.store.transactions``).
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mqorder.client.producer import Producer, closed_error
from mqorder.client.selector import Selector, key_hash
from mqorder.codec import decode_entries
from mqorder.errors import MessageError, TransactionEndedError
from mqorder.model import MessageExt, MessageQueue
from mqorder.store.durable import SendWait
from mqorder.store.transactions import OUTCOME_LOG_LEN, HalfStore, TxnEnd

log = logging.getLogger(__name__)

#: Property names RocketMQ sets on a transactional message.
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"


class LocalTransactionState(enum.Enum):
    """What the local transaction (or the checker) says (RocketMQ's ``LocalTransactionState``)."""

    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"  # RocketMQ's spelling

    # Short names as in the issue (COMMIT / ROLLBACK / UNKNOWN), the same members.
    COMMIT = "COMMIT_MESSAGE"
    ROLLBACK = "ROLLBACK_MESSAGE"
    UNKNOWN = "UNKNOW"


#: ``executor(msg, arg) -> LocalTransactionState``: the local transaction, run between the phases.
LocalTransactionExecutor = Callable[[MessageExt, Any], "LocalTransactionState | None"]


@dataclass(frozen=True)
class TransactionSendResult:
    """RocketMQ's ``TransactionSendResult``: the local state, and where the message went.

    ``queue_offset`` is the committed message's offset, or -1 while it is not committed (rolled
    back, or left to the check-back).
    """

    msg_id: str
    transaction_id: str
    message_queue: MessageQueue
    local_transaction_state: LocalTransactionState
    queue_offset: int = -1
    store_timestamp: int = 0


def check_callback(fn: object, nargs: int, what: str, signature: str, error: type[Exception]) -> None:
    """Refuse, before anything is stored or registered, a transaction callback that cannot answer.

    Its answer decides whether a half message is committed or rolled back, and a callback called
    with the wrong arguments raises on every call, which the check-back takes as UNKNOWN: after
    ``transaction_check_max`` checks every half message of the topic was rolled back, committed
    local transactions included (a checker written ``def check(msg, extra)`` once did exactly that).
    An ``async def`` returns a coroutine nobody awaits, the same UNKNOWN."""
    if not callable(fn):
        raise error(f"{what} must be a callable {signature}, got {fn!r}")
    call = getattr(fn, "__call__", None)  # noqa: B004 - an instance with an async __call__ is async too
    is_async = inspect.iscoroutinefunction(fn) or (not inspect.isfunction(fn) and inspect.iscoroutinefunction(call))
    if is_async or inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise error(f"{what} {fn!r} must be a plain function {signature}: an 'async def' or a generator "
                    "returns an object nobody awaits, taken for UNKNOWN, so its transactions would be rolled back")
    try:
        inspect.signature(fn).bind(*([object()] * nargs))
    except TypeError:
        raise error(f"{what} {fn!r} must accept {nargs} argument{'s' if nargs > 1 else ''}: {signature}") from None
    except ValueError:  # no signature to read (some builtins): its first call says
        pass


def as_state(value: object, who: str) -> LocalTransactionState:
    """An executor's or checker's answer. A state's exact name or value as a string
    (``"COMMIT_MESSAGE"``, RocketMQ's spelling, or ``"COMMIT"``) is that state: a callback's answer
    cannot be refused to its author as ``end_transaction`` refuses one, and taken for UNKNOWN a
    checker's "COMMIT" ended, after ``transaction_check_max`` checks, as a rollback. Anything else
    (None, an exception) is UNKNOWN, as in RocketMQ: the check-back asks again later."""
    if isinstance(value, LocalTransactionState):
        return value
    if isinstance(value, str):
        named = LocalTransactionState.__members__.get(value) or next(
            (s for s in LocalTransactionState if s.value == value), None)
        if named is not None:
            return named
    if value is not None:
        log.error("%s returned %r, not a LocalTransactionState (COMMIT, ROLLBACK or UNKNOWN); treated as UNKNOWN: "
                  "the check-back asks again, and rolls back after transaction_check_max checks", who, value)
    return LocalTransactionState.UNKNOWN


class TransactionProducer(Producer):
    """A ``Producer`` that can also send in a transaction (RocketMQ's ``TransactionMQProducer``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.half_store = HalfStore(self.brokers, self.appender, timeout=self.settings.send_msg_timeout_ms / 1000)

    def send_in_transaction(
        self,
        topic: str,
        body: bytes,
        *,
        executor: LocalTransactionExecutor,
        sharding_key: object = None,
        arg: Any = None,
        selector: Selector | None = None,
        keys: str | list[str] | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        wait_replicas: int | None = None,
    ) -> TransactionSendResult:
        """Store a half message, run ``executor(msg, arg)``, then commit or roll back.

        With a ``sharding_key`` the queue is the one ``send_orderly`` picks for it; without, the
        next one round-robin. An executor that raises leaves the message to the check-back (the
        exception propagates after phase two is skipped), as does an UNKNOWN answer.

        ``wait_replicas=n`` (default ``MQORDER_SEND_WAIT_REPLICAS``; 0: do not wait): the executor
        runs only once ``n`` replicas have the half message, and a COMMIT returns only once they
        have the commit, so neither is lost by a failover to one of them. ``NotEnoughReplicasError``
        (fewer connected) before anything is stored; ``ReplicasBehindError`` if the prepare's
        replicas fall short (rolled back, executor not run: sending again is safe) or the commit's
        (the commit IS applied on the primary: do not send again). A ROLLBACK does not wait.
        """
        check_callback(executor, 2, "executor", "(msg, arg) -> LocalTransactionState", MessageError)
        wait = self._wait(wait_replicas)
        if self._closed:
            raise closed_error("send_in_transaction")
        _, queues = self._route(topic)
        props = dict(properties or {})
        props[PROPERTY_TRANSACTION_PREPARED] = "true"
        props[PROPERTY_PRODUCER_GROUP] = self.producer_group
        # The key's hash is stored as for send_orderly: without it a key-ordered listener put the
        # committed message in no key's lane, beside the key's later messages (order broken).
        hash_ = None if sharding_key is None else key_hash(sharding_key)
        header, msg_id, body = self._prepare(body, keys, tags, props, hash_)
        if sharding_key is None:
            mq = self._select_round_robin(queues, None)
        else:
            mq = self._select(queues, sharding_key, body, selector)
        by = f"producer {self.producer_group}"
        prepared_ms = self.half_store.prepare(mq, msg_id, header, body, self.settings.transaction_timeout_ms,
                                              wait=wait, by=by)
        (msg,) = decode_entries(mq, [(b"0-1", [b"h", header, b"b", body, b"s", str(prepared_ms).encode()])])
        msg.queue_offset = -1
        try:
            state = as_state(executor(msg, arg), "the local transaction executor")
        except Exception:
            log.exception("local transaction of %s raised; left to the check-back", msg_id)
            raise
        return self._end(mq, msg_id, state, by, "", wait)

    def end_transaction(
        self, mq: MessageQueue, txid: str, state: LocalTransactionState, *, by: str, reason: str = "",
        wait_replicas: int | None = None,
    ) -> TransactionSendResult:
        """Phase two for ``state`` (UNKNOWN: nothing now; the check-back will ask).

        ``wait_replicas`` (default ``MQORDER_SEND_WAIT_REPLICAS``): a COMMIT returns once that many
        replicas have it, as in ``send_in_transaction``. A transaction already ended the same way
        changes nothing and returns that end's offset, and with a wait that end is waited for too: calling this again after a
        ``ReplicasBehindError`` of a commit is safe. One already ended the other way (the
        check-back's answer) raises ``TransactionEndedError`` saying how, as does one that is not a
        half message of ``mq`` and no longer in its outcome log (or never was: a wrong queue or
        id), whose ``outcome`` is ``"UNKNOWN"``. ``state`` must be a
        ``LocalTransactionState`` (``MessageError`` otherwise, nothing ended).
        """
        if not isinstance(state, LocalTransactionState):
            # Once 'COMMIT' (a str) ended as a ROLLBACK and was reported as committed.
            raise MessageError(f"state must be a LocalTransactionState (COMMIT, ROLLBACK or UNKNOWN), got {state!r}; "
                               "nothing was ended")
        return self._end(mq, txid, state, by, reason, self._wait(wait_replicas))

    def _end(self, mq: MessageQueue, txid: str, state: LocalTransactionState, by: str, reason: str,
             wait: SendWait | None) -> TransactionSendResult:
        if state is LocalTransactionState.UNKNOWN:
            return TransactionSendResult(txid, txid, mq, state)
        verdict = TxnEnd.COMMIT if state is LocalTransactionState.COMMIT else TxnEnd.ROLLBACK
        reply = self.half_store.end(mq, txid, verdict, reason or f"local transaction answered {state.value}", by,
                                    wait=wait)
        if reply.verdict is TxnEnd.GONE:
            # Ended already: by the check-back (an executor that ran past transaction_timeout_ms
            # while the checker answered), or by an earlier end. The same way: its offset. The
            # other way: an error, or a COMMIT of a rolled-back message was reported as committed.
            ended = self.half_store.outcome_of(mq, txid)
            if ended is None:
                # Not a half message there, and no end of it in the outcome log (capped to the last
                # OUTCOME_LOG_LEN ends per queue): reporting the caller's way, a COMMIT of a
                # rolled-back or unknown transaction came back as a commit.
                raise TransactionEndedError(
                    f"transaction {txid} is not a half message on {mq.key}, and {mq.key}'s outcome log (its last "
                    f"{OUTCOME_LOG_LEN:,} ends) does not say how it ended: this {verdict.value} changed nothing. "
                    "Check the queue and the transaction id; whether the message is stored, its msg id (the "
                    "transaction id) in the topic says", "UNKNOWN")
            if ended.outcome != verdict.value:
                raise TransactionEndedError(
                    f"transaction {txid} on {mq.key} was already ended as {ended.outcome} by {ended.by} "
                    f"({ended.reason}); this {verdict.value} changed nothing: "
                    + ("the message was not stored" if ended.outcome != "COMMIT" else
                       f"the message is stored at offset {ended.offset}")
                    + ". Make the checker agree with the local transaction (answer UNKNOWN while it runs), "
                      "or raise transaction_timeout_ms past the executor's longest run", ended.outcome,
                )
            return TransactionSendResult(txid, txid, mq, state, ended.offset, reply.store_ms)
        return TransactionSendResult(txid, txid, mq, state, reply.offset, reply.store_ms)

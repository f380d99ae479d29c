"""Durable transactional sends (``send_in_transaction(..., wait_replicas=n)``, the check-back's
commit under ``MQORDER_SEND_WAIT_REPLICAS``) on a real primary with two real replicas.

What is held: the executor runs only once the replicas have the half message, and a COMMIT returns
only once they have the commit; a prepare they do not acknowledge is rolled back and the executor
not run; a commit they do not acknowledge IS applied and the error says so; asking for more
replicas than are connected stores nothing; a ROLLBACK does not wait, and one lost in a failover
is checked back and rolled back again.

As in tests/test_durable_send.py: plain ``redis://`` URLs to the primary, replicas started with
``--replicaof``, and a replica "that does not answer" SIGSTOPped (``SentinelDeployment.pause``:
still connected, acknowledging nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from mqorder import keys
from mqorder.client.transaction import LocalTransactionState, TransactionProducer
from mqorder.client.transaction_check import TransactionCheckService, _checkers, transaction_checker
from mqorder.errors import BrokerUnavailableError, ConfigError, NotEnoughReplicasError, ReplicasBehindError
from mqorder.model import MessageExt, MessageQueue
from mqorder.settings import get_settings, load_settings
from mqorder.testing.embedded import RedisServer, wait_online_replicas
from mqorder.testing.sentinel import SentinelDeployment

COMMIT, ROLLBACK, UNKNOWN = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK, LocalTransactionState.UNKNOWN
#: The WAIT timeout of these tests (ms), as in tests/test_durable_send.py.
WAIT_MS = 400
TOPIC = "tx"


def _client(srv: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=srv.port, socket_timeout=5)


def _start(replicas: int) -> tuple[RedisServer, list[RedisServer]]:
    # No diskless-sync delay (Redis 7.0 waits 5 s for more replicas before a full sync).
    primary = RedisServer(extra_args=["--repl-diskless-sync-delay", "0"]).start()
    reps = [RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start() for _ in range(replicas)]
    wait_online_replicas(primary, replicas)
    c = _client(primary)
    try:
        # "online" comes before a fresh replica acknowledges anything (INFO shows its offset 0 for
        # a while): a test's first WAIT could fall short (measured: 1 in 10 fresh pairs, both WAITs
        # of a first prepare). A write (FLUSHALL: nothing is stored yet) then WAIT on this connection.
        c.flushall()
        assert c.execute_command("WAIT", replicas, 10_000) == replicas
    finally:
        c.close()
    return primary, reps


def _stop(*nodes: RedisServer) -> None:
    for srv in nodes:
        if srv.proc is not None and srv.proc.poll() is None:
            SentinelDeployment.resume(srv)
        srv.stop()


@dataclass
class Deployment:
    """Broker ``broker-a`` (the default: topics, the check-back's index) with two replicas, and
    ``broker-b`` with one."""

    primary: RedisServer
    replicas: list[RedisServer]
    b_primary: RedisServer
    b_replica: RedisServer


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    primary, replicas = _start(2)
    try:
        b_primary, (b_replica,) = _start(1)
    except BaseException:
        _stop(*replicas, primary)
        raise
    try:
        yield Deployment(primary, replicas, b_primary, b_replica)
    finally:
        _stop(*replicas, primary, b_replica, b_primary)


@pytest.fixture
def dep(deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployment]:
    """Both brokers emptied (FLUSHALL reaches the replicas too), every replica answering, and the
    settings pointing at them with a short WAIT timeout."""
    for srv, n in ((deployment.primary, 2), (deployment.b_primary, 1)):
        c = _client(srv)
        c.flushall()
        assert c.execute_command("WAIT", n, 10_000) == n
        c.close()
    monkeypatch.setenv("MQORDER_REDIS_URL", deployment.primary.url)
    monkeypatch.setenv("MQORDER_BROKERS", f'{{"broker-b": "{deployment.b_primary.url}"}}')
    monkeypatch.setenv("MQORDER_SEND_WAIT_TIMEOUT_MS", str(WAIT_MS))
    monkeypatch.setenv("MQORDER_TRANSACTION_TIMEOUT_MS", "200")
    monkeypatch.delenv("MQORDER_SEND_WAIT_REPLICAS", raising=False)
    get_settings.cache_clear()
    yield deployment
    for srv in [*deployment.replicas, deployment.b_replica]:
        SentinelDeployment.resume(srv)  # a test that failed while they were paused
    get_settings.cache_clear()
    _checkers.pop(TOPIC, None)


@pytest.fixture
def tx(dep: Deployment) -> Iterator[TransactionProducer]:
    p = TransactionProducer()
    p.create_topic(TOPIC, queues=2, brokers=["broker-a"])
    yield p
    p.close()


def _log(srv: RedisServer, mq: MessageQueue) -> list[bytes]:
    """The bodies in ``mq``'s log as this node has them, in offset order."""
    c = _client(srv)
    try:
        raw: Any = c.xrange(keys.queue_log(mq.tag))
        return [fields[b"b"] for _, fields in raw]
    finally:
        c.close()


def _half(srv: RedisServer, mq: MessageQueue) -> list[bytes]:
    """The txids of ``mq``'s half messages as this node has them."""
    c = _client(srv)
    try:
        raw: Any = c.zrange(keys.txn_index(mq.tag), 0, -1)
        return list(raw)
    finally:
        c.close()


def _sismember(srv: RedisServer, key: str, member: str) -> bool:
    c = _client(srv)
    try:
        return bool(c.sismember(key, member))
    finally:
        c.close()


def _waits(srv: RedisServer) -> int:
    c = _client(srv)
    try:
        return int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    finally:
        c.close()


def _reset_stats(tx: TransactionProducer, srv: RedisServer) -> None:
    """Zero ``srv``'s command counts, with the transaction scripts loaded first: a script's first
    call on a Redis is refused (NOSCRIPT) and its round trip, WAIT included, sent again."""
    for script in ("txn_prepare", "txn_end"):
        tx.brokers.default.scripts.load(script)
    c = _client(srv)
    c.config_resetstat()
    c.close()


def _recorded(ids: list[str], state: LocalTransactionState) -> Callable[[MessageExt, object], LocalTransactionState]:
    """An executor answering ``state`` that appends each message id it is asked about to ``ids``."""

    def executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        ids.append(msg.msg_id)
        return state

    return executor


def _mq(tx: TransactionProducer, key: str = "k") -> MessageQueue:
    """The queue ``sharding_key=key`` goes to (the half message's queue is unknown before it exists)."""
    return tx.send_orderly(TOPIC, b"probe", sharding_key=key).message_queue


# -- acknowledged: on the replicas ----------------------------------------------------------------------


def test_the_executor_runs_once_the_replicas_have_the_half_message_and_the_commit_returns_once_they_have_it(
    dep: Deployment, tx: TransactionProducer
) -> None:
    seen: list[list[list[bytes]]] = []

    def executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        # Read on the replicas themselves, right away: wait_replicas=2 means both have it.
        seen.append([_half(srv, msg.message_queue) for srv in dep.replicas])
        return COMMIT

    _reset_stats(tx, dep.primary)
    res = tx.send_in_transaction(TOPIC, b"durable", sharding_key="k", executor=executor, wait_replicas=2)
    assert seen == [[[res.msg_id.encode()]] * 2]
    assert _waits(dep.primary) == 2  # one WAIT behind the prepare, one behind the commit
    for srv in dep.replicas:
        assert _log(srv, res.message_queue)[res.queue_offset] == b"durable"
        assert _half(srv, res.message_queue) == []
    assert res.local_transaction_state is COMMIT


def test_the_setting_makes_transactions_wait_and_an_argument_wins(dep: Deployment, monkeypatch) -> None:
    monkeypatch.setenv("MQORDER_SEND_WAIT_REPLICAS", "2")
    get_settings.cache_clear()
    p = TransactionProducer()
    try:
        p.create_topic(TOPIC, queues=1)
        _reset_stats(p, dep.primary)
        p.send_in_transaction(TOPIC, b"a", sharding_key="k", executor=lambda m, a: COMMIT)
        assert _waits(dep.primary) == 2
        p.send_in_transaction(TOPIC, b"b", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=0)
        assert _waits(dep.primary) == 2  # the argument wins: no WAIT
        with pytest.raises(NotEnoughReplicasError):
            p.send_in_transaction(TOPIC, b"c", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=3)
    finally:
        p.close()


def test_a_waited_prepare_survives_a_script_flush(dep: Deployment, tx: TransactionProducer) -> None:
    """The waited prepare sends the index, the script, the fence and WAIT in one pipeline; after
    NOSCRIPT the script is loaded and the pipeline sent again."""
    c = _client(dep.primary)
    c.script_flush()
    c.close()
    res = tx.send_in_transaction(TOPIC, b"a", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=2)
    for srv in dep.replicas:
        assert _log(srv, res.message_queue) == [b"a"]
        assert _sismember(srv, keys.txn_topics(), TOPIC)


# -- refused before anything is stored ---------------------------------------------------------------


def test_more_replicas_than_connected_is_refused_before_the_half_message_is_stored(
    dep: Deployment, tx: TransactionProducer
) -> None:
    mq = _mq(tx)
    ran: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(NotEnoughReplicasError) as err:
        tx.send_in_transaction(TOPIC, b"never", sharding_key="k", executor=_recorded(ran, COMMIT),
                               wait_replicas=3)
    assert time.monotonic() - t0 < WAIT_MS / 1000  # refused, not waited out
    assert isinstance(err.value, BrokerUnavailableError)
    text = str(err.value)
    assert text.startswith("prepare of transaction ") and "refused before anything was stored" in text
    assert "wait for 3 replicas" in text and "connected_slaves:2" in text
    assert ran == [] and tx.half_store.pending(mq) == [] and tx.half_store.outcomes(mq) == []
    assert _log(dep.primary, mq) == [b"probe"]


@pytest.mark.parametrize("bad", [-1, 1.5, "two", True])
def test_bad_wait_replicas_values_are_refused_before_sending(dep: Deployment, tx: TransactionProducer,
                                                             bad: object) -> None:
    mq = _mq(tx)
    ran: list[str] = []
    with pytest.raises(ConfigError, match=r"wait_replicas=.* must be a whole number of replicas.*nothing was sent"):
        tx.send_in_transaction(TOPIC, b"x", sharding_key="k", executor=_recorded(ran, COMMIT),
                               wait_replicas=bad)  # type: ignore[arg-type]
    assert ran == [] and tx.half_store.pending(mq) == []
    half = tx.send_in_transaction(TOPIC, b"y", sharding_key="k", executor=lambda m, a: UNKNOWN)
    with pytest.raises(ConfigError, match="must be a whole number of replicas"):
        tx.end_transaction(mq, half.transaction_id, COMMIT, by="test", wait_replicas=bad)  # type: ignore[arg-type]
    assert tx.half_store.pending(mq) == [half.transaction_id]  # phase two not sent


# -- the replicas fall short --------------------------------------------------------------------------


def test_a_prepare_the_replicas_do_not_acknowledge_is_rolled_back_and_the_executor_never_runs(
    dep: Deployment, tx: TransactionProducer
) -> None:
    mq = _mq(tx)
    ran: list[str] = []
    _reset_stats(tx, dep.primary)
    for srv in dep.replicas:
        SentinelDeployment.pause(srv)
    try:
        t0 = time.monotonic()
        with pytest.raises(ReplicasBehindError) as err:
            tx.send_in_transaction(TOPIC, b"unreplicated", sharding_key="k",
                                   executor=_recorded(ran, COMMIT), wait_replicas=1)
        took = time.monotonic() - t0
    finally:
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
    assert WAIT_MS / 1000 * 0.9 <= took < WAIT_MS / 1000 + 2.0, took
    assert ran == [] and _waits(dep.primary) == 1  # the prepare's: the rollback after it does not wait
    text = str(err.value)
    assert text.startswith("prepare of transaction ") and "the half message IS stored on the primary" in text
    assert f"only 0 of 1 replica acknowledged within {WAIT_MS} ms" in text and "connected_slaves:2" in text
    assert "rolled back on the primary" in text and "the local transaction was NOT run" in text
    assert "send_in_transaction again is safe" in text
    # On the primary: no half message left, the rollback and its reason recorded, nothing in the log.
    assert tx.half_store.pending(mq) == [] and _log(dep.primary, mq) == [b"probe"]
    (o,) = tx.half_store.outcomes(mq)
    assert o.outcome == "ROLLBACK" and "before the local transaction ran" in o.reason and o.by.startswith("producer")


def test_a_commit_the_replicas_do_not_acknowledge_is_applied_and_the_error_says_so(
    dep: Deployment, tx: TransactionProducer
) -> None:
    """The prepare is acknowledged, then the replicas stop answering while the local transaction
    runs: the commit IS applied on the primary. Ending it again, from another producer, while they
    are still silent must not be acknowledged either (the fence); once they answer it is."""
    txn: list[tuple[MessageQueue, str]] = []

    def executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        txn.append((msg.message_queue, msg.msg_id))
        for srv in dep.replicas:
            SentinelDeployment.pause(srv)
        return COMMIT

    other = TransactionProducer()
    try:
        with pytest.raises(ReplicasBehindError) as err:
            tx.send_in_transaction(TOPIC, b"committed", sharding_key="k", executor=executor, wait_replicas=1)
        ((mq, txid),) = txn
        text = str(err.value)
        assert text.startswith(f"commit of transaction {txid}: the commit IS applied (the message is visible in ")
        assert "at offset 0) on the primary" in text and "only 0 of 1 replica acknowledged" in text
        assert "a failover now could lose it" in text and "end_transaction(COMMIT) for this transaction again is safe" in text
        assert _log(dep.primary, mq) == [b"committed"] and tx.half_store.pending(mq) == []
        assert [o.outcome for o in tx.half_store.outcomes(mq)] == ["COMMIT"]
        with pytest.raises(ReplicasBehindError, match="the transaction was already ended as COMMIT by .* IS applied on the primary"):
            other.end_transaction(mq, txid, COMMIT, by="test", wait_replicas=1)
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
        again = other.end_transaction(mq, txid, COMMIT, by="test", wait_replicas=2)
    finally:
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
        other.close()
    assert again.queue_offset == 0  # already ended the same way: nothing changed, its offset said
    for srv in [dep.primary, *dep.replicas]:
        assert _log(srv, mq) == [b"committed"]
    assert [o.outcome for o in tx.half_store.outcomes(mq)] == ["COMMIT"]


def test_a_rollback_does_not_wait(dep: Deployment, tx: TransactionProducer) -> None:
    def executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        for srv in dep.replicas:
            SentinelDeployment.pause(srv)
        return ROLLBACK

    _reset_stats(tx, dep.primary)
    try:
        t0 = time.monotonic()
        res = tx.send_in_transaction(TOPIC, b"undone", sharding_key="k", executor=executor, wait_replicas=2)
        took = time.monotonic() - t0
    finally:
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
    assert took < WAIT_MS / 1000, took
    assert _waits(dep.primary) == 1  # the prepare's only
    assert res.local_transaction_state is ROLLBACK and tx.half_store.pending(res.message_queue) == []


# -- the check-back's commit ----------------------------------------------------------------------------


def test_the_check_back_commit_waits_and_reports_a_shortfall_without_stopping(dep: Deployment,
                                                                              tx: TransactionProducer) -> None:
    transaction_checker(topic=TOPIC)(lambda msg: COMMIT)
    first = tx.send_in_transaction(TOPIC, b"first", sharding_key="k", executor=lambda m, a: UNKNOWN, wait_replicas=2)
    mq = first.message_queue
    svc = TransactionCheckService(tx.brokers, load_settings(send_wait_replicas=2))
    time.sleep(0.25)  # past MQORDER_TRANSACTION_TIMEOUT_MS
    _reset_stats(tx, dep.primary)
    report = svc.check_once()
    assert (report.committed, report.unreplicated) == (1, [])
    assert _waits(dep.primary) == 1
    for srv in dep.replicas:
        assert _log(srv, mq) == [b"first"]

    second = tx.send_in_transaction(TOPIC, b"second", sharding_key="k", executor=lambda m, a: UNKNOWN, wait_replicas=2)
    third = tx.send_in_transaction(TOPIC, b"third", sharding_key="k", executor=lambda m, a: UNKNOWN, wait_replicas=2)
    time.sleep(0.25)
    SentinelDeployment.pause(dep.replicas[1])
    try:
        report = svc.check_once()
    finally:
        SentinelDeployment.resume(dep.replicas[1])
    # Both committed (the second's shortfall did not stop the pass), both reported as unreplicated.
    assert report.committed == 2 and sorted(report.unreplicated) == sorted([second.msg_id, third.msg_id])
    assert _log(dep.primary, mq) == [b"first", b"second", b"third"] and tx.half_store.pending(mq) == []


# -- the index of the check-back on another broker -----------------------------------------------------


def test_a_queue_on_another_broker_waits_for_the_check_back_index_too(dep: Deployment,
                                                                       tx: TransactionProducer) -> None:
    """The index (``mqorder:txn:topics``) is on the default broker: a half message on broker-b that
    the check-back cannot find after broker-a fails over would stay half for good."""
    tx.create_topic("txb", queues=1, brokers=["broker-b"])
    res = tx.send_in_transaction("txb", b"b-ok", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=1)
    assert res.message_queue.broker_name == "broker-b" and _log(dep.b_replica, res.message_queue) == [b"b-ok"]
    for srv in dep.replicas:
        assert _sismember(srv, keys.txn_topics(), "txb")
    with pytest.raises(NotEnoughReplicasError, match="broker .broker-b. .*connected_slaves:1"):  # its own replicas
        tx.send_in_transaction("txb", b"never", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=2)
    for srv in dep.replicas:
        SentinelDeployment.pause(srv)
    try:
        with pytest.raises(ReplicasBehindError) as err:
            tx.send_in_transaction("txb", b"b-late", sharding_key="k", executor=lambda m, a: COMMIT, wait_replicas=1)
    finally:
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
    text = str(err.value)
    assert "the check-back's index entry of topic 'txb' IS stored on the primary of broker 'broker-a'" in text
    assert "half message IS stored" not in text  # broker-b's replica answered
    assert "rolled back on the primary" in text
    assert tx.half_store.pending(res.message_queue) == [] and _log(dep.b_primary, res.message_queue) == [b"b-ok"]


def test_a_delayed_send_on_another_broker_waits_for_the_delay_index_too(dep: Deployment,
                                                                        tx: TransactionProducer) -> None:
    """The delay mover finds delayed messages through ``mqorder:delay:queues`` on the default
    broker: a delayed send on broker-b whose index entry a failover of broker-a lost would never be
    delivered. Once only broker-b's replicas were waited for (found by a review, by reading)."""
    tx.create_topic("delb", queues=1, brokers=["broker-b"])
    res = tx.send("delb", b"later", delay_time_level=3, wait_replicas=1)
    assert res.message_queue.broker_name == "broker-b"
    for srv in dep.replicas:
        assert _sismember(srv, keys.delay_queues(), res.message_queue.key)
    for srv in dep.replicas:
        SentinelDeployment.pause(srv)
    try:
        with pytest.raises(ReplicasBehindError) as err:
            tx.send("delb", b"later-2", delay_time_level=3, wait_replicas=1)
    finally:
        for srv in dep.replicas:
            SentinelDeployment.resume(srv)
    text = str(err.value)
    assert f"the delay mover's index entry of queue {res.message_queue.key} IS stored on the primary of broker " \
           "'broker-a'" in text
    assert "the message IS stored" not in text  # broker-b's replica answered


# -- a failover ---------------------------------------------------------------------------------------


def test_after_a_failover_a_waited_commit_is_there_and_a_lost_rollback_is_checked_back(monkeypatch) -> None:
    """A primary and one replica of their own (the failover ends them). Transaction A commits with
    wait_replicas=1. During transaction B's local transaction the replica is cut off and promoted
    (``REPLICAOF NO ONE``: a partition, then Sentinel's choice; a SIGSTOP would not do, the kernel
    would still hold what the primary sent), then B rolls back on the old primary, which dies. On
    the promoted replica A's message is at its offset, and B's half message is back: the check-back
    asks the checker and rolls it back again."""
    primary, (replica,) = _start(1)
    try:
        monkeypatch.setenv("MQORDER_REDIS_URL", primary.url)
        monkeypatch.delenv("MQORDER_BROKERS", raising=False)
        monkeypatch.setenv("MQORDER_SEND_WAIT_TIMEOUT_MS", str(WAIT_MS))
        get_settings.cache_clear()
        p = TransactionProducer(settings=load_settings(transaction_timeout_ms=200))
        try:
            p.create_topic(TOPIC, queues=1)
            a = p.send_in_transaction(TOPIC, b"A", sharding_key="k", executor=lambda m, _: COMMIT, wait_replicas=1)

            def promote_then_rollback(msg: MessageExt, arg: object) -> LocalTransactionState:
                promoted = _client(replica)
                promoted.execute_command("REPLICAOF", "NO", "ONE")
                promoted.close()
                return ROLLBACK

            b = p.send_in_transaction(TOPIC, b"B", sharding_key="k", executor=promote_then_rollback, wait_replicas=1)
            assert p.half_store.pending(b.message_queue) == []  # rolled back on the old primary
        finally:
            p.close()
        primary.kill()

        asked: list[str] = []
        transaction_checker(topic=TOPIC)(lambda msg: _recorded(asked, ROLLBACK)(msg, None))
        monkeypatch.setenv("MQORDER_REDIS_URL", replica.url)
        get_settings.cache_clear()
        q = TransactionProducer(settings=load_settings(transaction_timeout_ms=200))
        try:
            mq = a.message_queue
            assert _log(replica, mq) == [b"A"] and a.queue_offset == 0
            assert q.half_store.pending(mq) == [b.transaction_id]  # the rollback was lost, the prepare was not
            time.sleep(0.25)
            report = TransactionCheckService(q.brokers, q.settings).check_once()
            assert asked == [b.transaction_id] and report.rolled_back == 1
            assert q.half_store.pending(mq) == [] and _log(replica, mq) == [b"A"]
        finally:
            q.close()
    finally:
        _checkers.pop(TOPIC, None)
        get_settings.cache_clear()
        _stop(replica, primary)

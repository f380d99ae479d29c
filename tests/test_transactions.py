"""Transactional messages against a real redis-server: half messages nobody sees, commit at the
commit position, rollback with a reason, the check-back (UNKNOWN, check max), and, on real
workers and beat, producers killed -9 between the two phases."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from mqorder import Producer, keys
from mqorder.client.transaction import LocalTransactionState, TransactionProducer
from mqorder.client.transaction_check import TransactionCheckService, _checkers, transaction_checker
from mqorder.errors import MessageError, TransactionEndedError
from mqorder.model import MessageExt
from mqorder.settings import load_settings
from mqorder.store.log import MessageLog
from mqorder.testing.launcher import project_env
from tests.support import ROOT, body, ledger, wait_for

COMMIT, ROLLBACK, UNKNOWN = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK, LocalTransactionState.UNKNOWN


@pytest.fixture
def tx(redis_url: str):
    s = load_settings(redis_url=redis_url, transaction_timeout_ms=1000, transaction_check_interval_ms=200,
                      transaction_check_max=3)
    p = TransactionProducer(settings=s)
    p.create_topic("tx", queues=2)
    yield p
    p.close()
    _checkers.pop("tx", None)


def bodies(p: Producer, mq) -> list[bytes]:
    return [m.body for m in MessageLog(p.brokers).read(mq, 0, 100)]


def test_a_half_message_is_invisible_and_commits_at_the_commit_position(tx: TransactionProducer) -> None:
    seen_during: list[list[bytes]] = []

    def executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        seen_during.append(bodies(tx, msg.message_queue))  # phase one done: not in the log
        tx.send_orderly("tx", b"sent meanwhile", sharding_key="k")  # the same key, during the txn
        return COMMIT

    res = tx.send_in_transaction("tx", b"txn", sharding_key="k", executor=executor)
    assert seen_during == [[]]
    assert res.local_transaction_state is COMMIT and res.queue_offset == 1
    assert bodies(tx, res.message_queue) == [b"sent meanwhile", b"txn"]  # commit order, not prepare order
    (m,) = MessageLog(tx.brokers).read(res.message_queue, 1, 1)
    assert m.msg_id == res.msg_id and m.properties["TRAN_MSG"] == "true"
    assert tx.half_store.pending(res.message_queue) == []


def test_rollback_stores_nothing_and_records_why(tx: TransactionProducer) -> None:
    res = tx.send_in_transaction("tx", b"txn", sharding_key="k", executor=lambda m, a: ROLLBACK)
    assert res.queue_offset == -1 and bodies(tx, res.message_queue) == []
    (o,) = tx.half_store.outcomes(res.message_queue)
    assert (o.txid, o.outcome, o.offset) == (res.msg_id, "ROLLBACK", -1)
    assert "ROLLBACK_MESSAGE" in o.reason and o.by.startswith("producer")


def test_unknown_and_a_raising_executor_are_resolved_by_the_checker(tx: TransactionProducer) -> None:
    answers = {"txn-unknown": COMMIT, "txn-raised": ROLLBACK}
    transaction_checker(topic="tx")(lambda msg: answers[msg.body.decode()])
    r1 = tx.send_in_transaction("tx", b"txn-unknown", sharding_key="k", executor=lambda m, a: UNKNOWN)

    def boom(msg: MessageExt, arg: object) -> LocalTransactionState:
        raise RuntimeError("local database down")

    with pytest.raises(RuntimeError):
        tx.send_in_transaction("tx", b"txn-raised", sharding_key="k", executor=boom)
    mq = r1.message_queue
    assert len(tx.half_store.pending(mq)) == 2 and bodies(tx, mq) == []
    svc = TransactionCheckService(tx.brokers, tx.settings)
    assert svc.check_once().checked == 0  # younger than transaction_timeout_ms: not asked yet
    time.sleep(1.05)
    report = svc.check_once()
    assert (report.checked, report.committed, report.rolled_back) == (2, 1, 1)
    assert bodies(tx, mq) == [b"txn-unknown"] and tx.half_store.pending(mq) == []
    assert {o.outcome for o in tx.half_store.outcomes(mq)} == {"COMMIT", "ROLLBACK"}


def test_still_unknown_after_check_max_is_rolled_back_with_the_reason(tx: TransactionProducer) -> None:
    asked: list[str] = []
    transaction_checker(topic="tx")(lambda msg: asked.append(msg.msg_id) or UNKNOWN)
    res = tx.send_in_transaction("tx", b"txn", sharding_key="k", executor=lambda m, a: UNKNOWN)
    svc = TransactionCheckService(tx.brokers, tx.settings)
    deadline = time.monotonic() + 5
    while tx.half_store.pending(res.message_queue) and time.monotonic() < deadline:
        svc.check_once()
        time.sleep(0.05)
    assert asked == [res.msg_id] * 3  # transaction_check_max checks, then no more
    (o,) = tx.half_store.outcomes(res.message_queue)
    assert o.outcome == "ROLLBACK" and "transaction_check_max" in o.reason and o.by == "check-back"
    # The outcome counts the checker's calls: the claim that gave up asked nobody (it said 4, and
    # `mqorder txn` showed "checks 16" beside "still UNKNOWN after 15 check-backs").
    assert o.checks == len(asked) == 3 and "after 3 check-backs" in o.reason and bodies(tx, res.message_queue) == []


def test_a_failed_end_gives_back_the_rest_of_the_batch_and_other_queues_go_on(redis_url: str) -> None:
    """Ending one transaction failed (its reply lost: the broker went away for a moment): the
    exception left the pass, every other queue waited, and the rest of the queue's claimed batch
    had each counted a check nobody made (so transaction_check_max rolled them back sooner)."""
    from urllib.parse import urlsplit

    from tests.lossy_proxy import LossyProxy

    u = urlsplit(redis_url)
    proxy = LossyProxy(u.hostname or "127.0.0.1", u.port or 6379)
    s = load_settings(redis_url=proxy.url(), transaction_timeout_ms=50, send_msg_timeout_ms=300,
                      transaction_check_max=3)
    p = TransactionProducer(settings=s)
    p.create_topic("lossy", queues=2)
    q0, q1 = p.describe_topic("lossy").message_queues
    asked: list[bytes] = []

    def checker(msg: MessageExt) -> LocalTransactionState:
        asked.append(msg.body)
        if msg.body == b"q0-1":
            proxy.lose_next_replies(1)  # the reply to this commit (the subscriptions read is cached)
        return COMMIT

    _checkers["lossy"] = checker
    try:
        for mq in (q0, q1):
            for i in range(3):
                p.send_in_transaction("lossy", b"q%d-%d" % (mq.queue_id, i), sharding_key="k",
                                      selector=lambda queues, key, body, mq=mq: mq,
                                      executor=lambda m, a: UNKNOWN)
        time.sleep(0.1)
        report = TransactionCheckService(p.brokers, s).check_once()
        assert report.failed_queues == [q0.key]
        assert asked == [b"q0-0", b"q0-1", b"q1-0", b"q1-1", b"q1-2"]  # q1 went on after q0's failure
        assert (report.checked, report.committed) == (5, 4)
        # q0-1's commit was applied (only its reply was lost); q0-2 was not asked: its claim is
        # given back (no check counted) and it is due again at once.
        assert bodies(p, q0) == [b"q0-0", b"q0-1"]
        assert [(checks, due <= time.time() * 1000) for _, _, checks, due in p.half_store.pending_details(q0)] == [
            (0, True)]
        report = TransactionCheckService(p.brokers, s).check_once()
        assert (report.checked, report.committed, report.failed_queues) == (1, 1, [])
        assert bodies(p, q0) == [b"q0-0", b"q0-1", b"q0-2"] and bodies(p, q1) == [b"q1-0", b"q1-1", b"q1-2"]
    finally:
        p.close()
        proxy.close()
        _checkers.pop("lossy", None)


def test_producer_and_check_back_end_a_transaction_once(tx: TransactionProducer) -> None:
    res = tx.send_in_transaction("tx", b"txn", sharding_key="k", executor=lambda m, a: UNKNOWN)
    first = tx.end_transaction(res.message_queue, res.transaction_id, COMMIT, by="check-back")
    again = tx.end_transaction(res.message_queue, res.transaction_id, COMMIT, by="producer")
    assert first.queue_offset == 0 and again.queue_offset == 0  # the same end: its offset
    with pytest.raises(TransactionEndedError, match="already ended as COMMIT by check-back.*offset 0") as e:
        tx.end_transaction(res.message_queue, res.transaction_id, ROLLBACK, by="producer")
    assert e.value.outcome == "COMMIT"
    assert bodies(tx, res.message_queue) == [b"txn"]
    assert [o.outcome for o in tx.half_store.outcomes(res.message_queue)] == ["COMMIT"]


def test_a_commit_after_the_check_back_rolled_back_is_an_error_not_a_commit(redis_url: str) -> None:
    """The executor ran past ``transaction_timeout_ms``; the checker answered ROLLBACK (its database
    had not committed yet), then the executor committed. Once reported as a COMMIT (offset -1, no
    error): the database committed, the message gone, and nobody told."""
    from mqorder.client.transaction_check import TransactionCheckService

    s = load_settings(redis_url=redis_url, transaction_timeout_ms=50)
    p = TransactionProducer(settings=s)
    p.create_topic("late", queues=1)
    db: set[str] = set()
    _checkers["late"] = lambda msg: COMMIT if msg.msg_id in db else ROLLBACK

    def slow_executor(msg: MessageExt, arg: object) -> LocalTransactionState:
        time.sleep(0.2)  # longer than transaction_timeout_ms
        TransactionCheckService(p.brokers, s).check_once()  # a worker's beat runs meanwhile
        db.add(msg.msg_id)
        return COMMIT

    try:
        with pytest.raises(TransactionEndedError, match="already ended as ROLLBACK by check-back.*not stored"):
            p.send_in_transaction("late", b"paid", sharding_key="42", executor=slow_executor)
        assert bodies(p, p.describe_topic("late").message_queues[0]) == []
    finally:
        p.close()
        _checkers.pop("late", None)


def test_a_transactional_message_keeps_its_keys_order_for_key_ordered_listeners(tx: TransactionProducer) -> None:
    """Once sent without its sharding key's hash: a key-ordered listener put it in no key's lane,
    and the key's next message could run beside it."""
    from mqorder.client.selector import key_hash
    from mqorder.consumer.key_lanes import KeyLanes

    res = tx.send_in_transaction("tx", b"paid", sharding_key="42", executor=lambda m, a: COMMIT)
    tx.send_orderly("tx", b"shipped", sharding_key="42")
    msgs = MessageLog(tx.brokers).read(res.message_queue, 0, 10)
    assert [m.body for m in msgs] == [b"paid", b"shipped"]
    assert [m.key_hash for m in msgs] == [key_hash("42")] * 2
    lanes = KeyLanes()
    for m in msgs:
        lanes.put(m)
    assert lanes.take(10) is not None
    assert lanes.take(10) is None  # "shipped" waits while "paid" runs


def test_an_end_with_a_state_that_is_not_a_state_is_refused(tx: TransactionProducer) -> None:
    """Once the str 'COMMIT' ended the transaction as a ROLLBACK and was reported as committed."""
    res = tx.send_in_transaction("tx", b"paid", sharding_key="42", executor=lambda m, a: UNKNOWN)
    with pytest.raises(MessageError, match="state must be a LocalTransactionState.*'COMMIT'.*nothing was ended"):
        tx.end_transaction(res.message_queue, res.transaction_id, "COMMIT", by="app")  # type: ignore[arg-type]
    assert tx.half_store.pending(res.message_queue) == [res.transaction_id]


def test_phase_one_survives_a_script_flush(tx: TransactionProducer, r: redis.Redis) -> None:
    """Phase one pipelines the check-back index with its script: after a Redis restart (NOSCRIPT)
    the script is loaded and the pipeline sent again."""
    tx.send_in_transaction("tx", b"a", sharding_key="k", executor=lambda m, a: COMMIT)
    r.script_flush()
    res = tx.send_in_transaction("tx", b"b", sharding_key="k", executor=lambda m, a: COMMIT)
    assert res.queue_offset == 1 and r.sismember(keys.txn_topics(), "tx")


def test_mqorder_txn_shows_half_transactions_and_why_others_ended(tx: TransactionProducer) -> None:
    from typer.testing import CliRunner

    from mqorder.cli import app

    half = tx.send_in_transaction("tx", b"a", sharding_key="k", executor=lambda m, a: UNKNOWN)
    gone = tx.send_in_transaction("tx", b"b", sharding_key="k", executor=lambda m, a: ROLLBACK)
    res = CliRunner().invoke(app, ["txn", "tx", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.stdout
    out = json.loads(res.stdout)
    assert [(h["txid"], h["checks"]) for h in out["half"]] == [(half.msg_id, 0)]
    (ended,) = out["ended"]
    assert (ended["txid"], ended["outcome"]) == (gone.msg_id, "ROLLBACK") and "ROLLBACK_MESSAGE" in ended["reason"]
    human = CliRunner().invoke(app, ["txn", "tx"], catch_exceptions=False)
    assert "1 transaction(s) half-way" in human.stdout and half.msg_id in human.stdout
    assert CliRunner().invoke(app, ["txn", "nope"]).exit_code == 2


def test_bad_executor_is_refused_before_anything_is_stored(tx: TransactionProducer, r: redis.Redis) -> None:
    with pytest.raises(MessageError, match="executor must be a callable"):
        tx.send_in_transaction("tx", b"x", sharding_key="k", executor="commit")  # type: ignore[arg-type]
    # Callable, but it cannot answer: it used to store the half message first, then raise TypeError
    # (or, async, return a coroutine taken for UNKNOWN), leaving the message to the check-back.
    with pytest.raises(MessageError, match=r"must accept 2 arguments: \(msg, arg\)"):
        tx.send_in_transaction("tx", b"x", sharding_key="k", executor=lambda m: COMMIT)  # type: ignore[arg-type,misc]

    async def debit(msg: object, arg: object) -> LocalTransactionState:
        return COMMIT

    with pytest.raises(MessageError, match="must be a plain function"):
        tx.send_in_transaction("tx", b"x", sharding_key="k", executor=debit)  # type: ignore[arg-type]
    assert not r.exists(keys.txn_topics())


def test_a_checker_that_cannot_answer_is_refused_when_registered() -> None:
    """A checker that raises on every call answers UNKNOWN every time: after transaction_check_max
    checks every half message of its topic was rolled back, committed local transactions included.
    The decorator refuses it, as @orderly_listener refuses a listener of the wrong arity."""
    from mqorder.errors import ListenerError

    def two(msg: object, extra: object) -> LocalTransactionState:
        return COMMIT

    async def later(msg: object) -> LocalTransactionState:
        return COMMIT

    with pytest.raises(ListenerError, match=r"must accept 1 argument: \(msg\)"):
        transaction_checker(topic="tx-arity")(two)  # type: ignore[arg-type]
    with pytest.raises(ListenerError, match="must be a plain function"):
        transaction_checker(topic="tx-arity")(later)  # type: ignore[arg-type]

    class Later:
        async def __call__(self, msg: object) -> LocalTransactionState:
            return COMMIT

    with pytest.raises(ListenerError, match="must be a plain function"):
        transaction_checker(topic="tx-arity")(Later())  # type: ignore[arg-type]
    with pytest.raises(ListenerError, match="must be a callable"):
        transaction_checker(topic="tx-arity")("COMMIT")  # type: ignore[arg-type]
    assert "tx-arity" not in _checkers
    # One argument with more optional after it, or *args, can answer.
    transaction_checker(topic="tx-arity")(lambda msg, *rest: COMMIT)
    assert _checkers.pop("tx-arity") is not None


def _killed_mid_transaction(url: str, tmp: Path, key: str, seq: int, local: str) -> str:
    """Run tests.txn_proc until its local transaction is running, kill -9 it; return the msg id."""
    marker = tmp / f"marker-{key}-{seq}"
    proc = subprocess.Popen([sys.executable, "-m", "tests.txn_proc", "t-order", key, str(seq), local, str(marker)],
                            env=project_env(url), cwd=ROOT)
    try:
        wait_for(marker.exists, timeout=30, what="the producer to reach its local transaction")
    finally:
        proc.kill()
        proc.wait(10)
    return marker.read_text()


@pytest.mark.e2e
def test_producers_killed_between_the_phases_end_visible_or_rolled_back(cluster, r: redis.Redis, tmp_path: Path) -> None:
    # Check-backs begin 3 s after a half message: time enough to look at it before (three producers
    # killed in turn took longer than 1 s on a loaded machine, and a's was committed by then).
    txn_env = {"MQORDER_LISTENERS": "tests.listeners,tests.txn_checkers", "MQORDER_TRANSACTION_TIMEOUT_MS": "3000",
               "MQORDER_TRANSACTION_CHECK_INTERVAL_MS": "500", "MQORDER_TRANSACTION_CHECK_MAX": "5"}
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    cluster.start_worker("w1", **txn_env)
    cluster.start_beat(**txn_env)
    p.send_orderly("t-order", body("a", 1), sharding_key="a")
    route = p.describe_topic("t-order").message_queues
    log = MessageLog(p.brokers)

    def visible(key: str) -> list[dict]:
        return [b for mq in route for m in log.read(mq, 0, 100) if (b := json.loads(m.body))["k"] == key]

    committed = _killed_mid_transaction(cluster.url, tmp_path, "a", 2, "COMMIT")
    assert [b["s"] for b in visible("a")] == [1]  # a's half-way message is not visible
    unknown = _killed_mid_transaction(cluster.url, tmp_path, "b", 1, "-")
    late = _killed_mid_transaction(cluster.url, tmp_path, "c", 1, "-")
    p.send_orderly("t-order", body("a", 3), sharding_key="a")  # sent while a's txn hangs half-way
    assert visible("b") == [] and visible("c") == []  # nor theirs
    # c's checker answers UNKNOWN twice, then its local transaction is found committed.
    wait_for(lambda: int(r.get(f"checked:{late}") or 0) >= 2, timeout=60, what="two check-backs of c")
    r.set(f"local:{late}", "COMMIT")
    # The check-back commits a's transaction (its local state says COMMIT) and the worker consumes it.
    wait_for(lambda: any(e["key"] == "a" and e["seq"] == 2 for e in ledger(r, "g-order")), timeout=60,
             what="the committed transaction to be consumed")
    # b's checker never learns anything: rolled back after transaction_check_max, with the reason.
    from mqorder.store.transactions import HalfStore

    store = HalfStore(p.brokers, p.appender, timeout=3)
    wait_for(lambda: not any(store.pending(mq) for mq in route), timeout=60, what="no half message left")
    outcomes = {o.txid: o for mq in route for o in store.outcomes(mq)}
    assert outcomes[committed].outcome == "COMMIT" and outcomes[committed].by == "check-back"
    assert outcomes[unknown].outcome == "ROLLBACK" and "transaction_check_max" in outcomes[unknown].reason
    assert int(r.get(f"checked:{unknown}")) == 5  # transaction_check_max, then rolled back unasked
    assert outcomes[late].outcome == "COMMIT" and outcomes[late].checks >= 3
    wait_for(lambda: any(e["key"] == "c" for e in ledger(r, "g-order")), timeout=60, what="c to be consumed")
    a_seqs = [e["seq"] for e in ledger(r, "g-order") if e["key"] == "a" and e["ok"]]
    assert a_seqs == [1, 3, 2]  # the committed message took its place at the commit
    assert not any(e["key"] == "b" for e in ledger(r, "g-order"))
    p.close()


def test_the_check_back_against_an_unreachable_redis_says_so() -> None:
    """Once a raw redis ConnectionError from the topics read; now the project's error, which says
    that nothing was changed (a read), not that a message may be stored."""
    from mqorder.errors import BrokerUnavailableError
    from mqorder.store.brokers import BrokerRegistry

    s = load_settings(redis_url="redis://127.0.0.1:1/0", send_msg_timeout_ms=300)
    with pytest.raises(BrokerUnavailableError, match=r"list transaction topics failed.*Nothing was changed"):
        TransactionCheckService(BrokerRegistry(s.redis_url, s.brokers), s).check_once()


def test_an_end_of_a_transaction_that_is_not_half_there_and_not_in_the_outcome_log_is_an_error(
        tx: TransactionProducer) -> None:
    """GONE with no line in the (capped) outcome log: the end used to be reported the caller's way
    (a COMMIT, offset -1, no error) for a wrong queue, an unknown id, or a transaction rolled back
    more than OUTCOME_LOG_LEN ends ago; the message stayed half, or was never stored."""
    q0, q1 = tx.describe_topic("tx").message_queues
    res = tx.send_in_transaction("tx", b"paid", sharding_key="k", selector=lambda qs, k, b: q0,
                                 executor=lambda m, a: UNKNOWN)
    with pytest.raises(TransactionEndedError, match=f"transaction {res.transaction_id} is not a half message on "
                                                    f"{q1.key}.*this COMMIT changed nothing") as e:
        tx.end_transaction(q1, res.transaction_id, COMMIT, by="producer")
    assert e.value.outcome == "UNKNOWN"
    assert tx.half_store.pending(q0) == [res.transaction_id] and bodies(tx, q1) == []
    with pytest.raises(TransactionEndedError, match="no-such-id is not a half message"):
        tx.end_transaction(q0, "no-such-id", ROLLBACK, by="producer")


@pytest.mark.parametrize("answer", ["COMMIT_MESSAGE", "COMMIT"])
def test_a_checker_answering_a_states_name_is_taken_at_its_word(tx: TransactionProducer, answer: str) -> None:
    """RocketMQ spells it COMMIT_MESSAGE; a checker returning that string was UNKNOWN every time,
    and after transaction_check_max checks a commit it had confirmed ended as a rollback."""
    transaction_checker(topic="tx")(lambda msg: answer)
    res = tx.send_in_transaction("tx", b"paid", sharding_key="k", executor=lambda m, a: UNKNOWN)
    time.sleep(1.05)  # past transaction_timeout_ms
    report = TransactionCheckService(tx.brokers, tx.settings).check_once()
    assert (report.checked, report.committed, report.unknown) == (1, 1, 0)
    assert bodies(tx, res.message_queue) == [b"paid"]


def test_the_check_back_counts_an_end_the_producer_made_first_as_ended_elsewhere(redis_url: str) -> None:
    """The producer's own ROLLBACK landed while the checker was asked (COMMIT): the check-back's end
    found it GONE, changed nothing, and its report said committed."""
    s = load_settings(redis_url=redis_url, transaction_timeout_ms=50)
    p = TransactionProducer(settings=s)
    p.create_topic("race", queues=1)
    (mq,) = p.describe_topic("race").message_queues
    res = p.send_in_transaction("race", b"x", sharding_key="k", executor=lambda m, a: UNKNOWN)

    def checker(msg: MessageExt) -> LocalTransactionState:
        p.end_transaction(mq, res.transaction_id, ROLLBACK, by="producer")
        return COMMIT

    _checkers["race"] = checker
    try:
        time.sleep(0.1)
        report = TransactionCheckService(p.brokers, s).check_once()
        assert (report.committed, report.rolled_back, report.ended_elsewhere) == (0, 0, [res.transaction_id])
        assert bodies(p, mq) == []
    finally:
        p.close()
        _checkers.pop("race", None)


def test_a_worker_with_only_a_transaction_checker_is_not_told_it_has_no_listeners(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TRANSACTIONS.md puts the checker in a MQORDER_LISTENERS module and runs the check-back on
    a worker; such a worker was warned that it had no listeners and that the variable was unset."""
    from mqorder.celery.bootsteps import _say_what_it_serves
    from mqorder.consumer.client_instance import ClientInstance

    client = ClientInstance("w1@checks", load_settings(redis_url=redis_url), dispatch=lambda *a: True)
    client.subscriptions = []  # a worker whose modules define no listener
    saved = dict(_checkers)
    _checkers.clear()
    try:
        with caplog.at_level("INFO", logger="mqorder.celery.bootsteps"):
            _say_what_it_serves(client)
            transaction_checker(topic="t-only")(lambda msg: COMMIT)
            _say_what_it_serves(client)
    finally:
        _checkers.clear()
        _checkers.update(saved)
        client.brokers.close()
    first, second = caplog.records
    assert first.levelname == "WARNING" and "no listeners and no transaction checkers" in first.getMessage()
    assert second.levelname == "INFO" and "only transaction checkers (topics t-only)" in second.getMessage()

"""The Celery-free ConsumeRequest engine against a real redis-server (no workers needed here;
the end-to-end tests run the same engine inside real Celery workers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.hooks import ConsumeMessageHook
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.log import MessageLog

S = ConsumeOrderlyStatus




MQ = MessageQueue("t", "broker-a", 0)


def drain(eng: ConsumerEngine, spec: ListenerSpec, sub: str = "g", max_runs: int = 200) -> list[Outcome]:
    """Assign the queue to c1 and follow the outcomes as the Celery task would (with the request
    class of the listener's ordering: ``KeyConsumeRequest`` for ``ordering="key"``)."""
    locks = RebalanceLockManager(eng.brokers)
    res = locks.assign(sub, [(MQ, "c1", "tok0")])
    token = "tok0"
    if res[MQ] != "DISPATCH":
        return []
    outcomes = []
    for _ in range(max_runs):
        out = request_class(spec)(eng, spec, sub, MQ, token).run()
        outcomes.append(out)
        if not out.needs_dispatch or out.target != "c1":
            break
        time.sleep(out.countdown)
        token = out.token
    return outcomes


def test_messages_are_delivered_in_offset_order_and_committed(env) -> None:
    p, eng = env
    for i in range(100):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    seen: list[int] = []

    def listener(msgs, ctx):
        seen.extend(m.queue_offset for m in msgs)
        assert [int(m.body) for m in msgs] == [m.queue_offset for m in msgs]
        return S.SUCCESS

    outs = drain(eng, ListenerSpec(listener, "t", "g"))
    assert seen == list(range(100))
    assert outs[-1].verb == "IDLE"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 100


def test_suspended_message_blocks_later_offsets_until_it_succeeds(env) -> None:
    p, eng = env
    for i in range(5):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    calls: list[tuple[int, int]] = []
    fails = {2: 2}

    def listener(msgs, ctx):
        (m,) = msgs
        calls.append((m.queue_offset, m.reconsume_times))
        if fails.get(m.queue_offset, 0) > 0:
            fails[m.queue_offset] -= 1
            ctx.suspend_current_queue_time_millis = 50
            return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g"))
    assert calls == [(0, 0), (1, 0), (2, 0), (2, 1), (2, 2), (3, 0), (4, 0)]


def test_message_goes_to_dlq_after_max_reconsume_times_and_queue_moves_on(env) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k", keys=[f"key{i}"])
    calls: list[int] = []

    def listener(msgs, ctx):
        calls.append(msgs[0].queue_offset)
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT if msgs[0].queue_offset == 1 else S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", max_reconsume_times=2, suspend_current_queue_time_millis=10))
    assert calls == [0, 1, 1, 1, 2]  # first attempt + 2 reconsumes, then DLQ
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert len(dlq) == 1
    assert dlq[0].body == b"1" and dlq[0].keys == ["key1"]
    assert dlq[0].properties["ORIGIN_QUEUE_OFFSET"] == "1"
    assert dlq[0].properties["DLQ_REASON"] == "max reconsume times 2 reached (listener kept suspending)"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 3


def test_a_dead_letter_after_its_dlq_topic_was_deleted_goes_to_a_new_one(env, settings) -> None:
    """A review: deleting %DLQ%g marks its queue, and the worker, which had ensured the topic once,
    had every dead letter refused for 10 minutes. It now creates the topic again and sends."""
    from mqorder.admin.common import Admin
    from mqorder.admin.topics import delete

    p, eng = env
    p.send_orderly("t", b"first", sharding_key="k")
    spec = ListenerSpec(lambda msgs, ctx: S.SUSPEND_CURRENT_QUEUE_A_MOMENT, "t", "g", max_reconsume_times=0,
                        suspend_current_queue_time_millis=10)
    drain(eng, spec)
    admin = Admin.open(settings)
    delete(admin, keys.dlq_topic("g"), force=True)
    admin.brokers.close()
    p.send_orderly("t", b"second", sharding_key="k")
    eng.brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), mapping={"pending": "tok1", "pend_until": 2**50})
    request_class(spec)(eng, spec, "g", MQ, "tok1").run()
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert [m.body for m in dlq] == [b"second"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 2


def test_a_dead_letter_of_a_listener_that_raised_says_what_it_raised(env) -> None:
    """Two walk-throughs found every dead letter saying "listener kept suspending", also when each
    call raised: the exception was gone once the message left the queue."""
    p, eng = env
    p.send_orderly("t", b"poison", sharding_key="k")

    def listener(msgs, ctx):
        raise ValueError(f"boom on {msgs[0].body.decode()}")

    drain(eng, ListenerSpec(listener, "t", "g", max_reconsume_times=1, suspend_current_queue_time_millis=10))
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert [m.properties["DLQ_REASON"] for m in dlq] == [
        "max reconsume times 1 reached (the last call raised ValueError: boom on poison)"]


def test_listener_exception_and_none_count_as_suspend(env) -> None:
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="k")
    results = iter([RuntimeError("boom"), None, S.SUCCESS])
    calls = []

    def listener(msgs, ctx):
        calls.append(msgs[0].reconsume_times)
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    drain(eng, ListenerSpec(listener, "t", "g", suspend_current_queue_time_millis=10))
    assert calls == [0, 1, 2]


def test_undecodable_stored_message_goes_to_dlq_without_blocking(env) -> None:
    p, eng = env
    p.send_orderly("t", b"a", sharding_key="k")
    c = eng.brokers.default.client
    # A corrupt entry written behind the producer's back (offset 1).
    c.xadd(keys.queue_log(MQ.tag), {"h": b"\xff{not json", "b": b"?", "s": b"0"}, id="1-1")
    c.incr(keys.queue_next(MQ.tag))
    p.send_orderly("t", b"c", sharding_key="k")
    seen = []

    def listener(msgs, ctx):
        seen.extend(m.body for m in msgs)
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", consume_message_batch_max_size=8))
    assert seen == [b"a", b"c"]
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert len(dlq) == 1 and "undecodable" in dlq[0].properties["DLQ_REASON"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 3


def test_manual_commit_and_rollback(env) -> None:
    p, eng = env
    for i in range(4):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    calls: list[int] = []
    rolled = {"done": False}

    def listener(msgs, ctx):
        ctx.auto_commit = False
        ctx.suspend_current_queue_time_millis = 10
        off = msgs[0].queue_offset
        calls.append(off)
        if off == 1:
            return S.COMMIT
        if off == 2 and not rolled["done"]:
            rolled["done"] = True
            return S.ROLLBACK
        return S.SUCCESS if off != 3 else S.COMMIT

    drain(eng, ListenerSpec(listener, "t", "g"))
    # 0 (uncommitted), 1 COMMIT (commits 0..1), 2 ROLLBACK -> 2 again, 3 COMMIT (commits 2..3)
    assert calls == [0, 1, 2, 2, 3]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 4


def test_commit_of_a_replaced_holder_is_fenced_and_ctx_sees_it(env) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    observed = []
    locks = RebalanceLockManager(eng.brokers)

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 1:
            # Another client takes the queue while this call runs (a pause past the lease).
            locks.assign("g", [(MQ, "c2", "other")], dead_clients=["c1"])
            observed.append(ctx.still_owner())
        return S.SUCCESS

    outs = drain(eng, ListenerSpec(listener, "t", "g"))
    assert observed == [False]
    assert outs[-1].verb == "FENCED"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 0  # nothing committed by the stale holder
    assert locks.lock_entry("g", MQ).owner == "c2"


def test_refused_commit_reaches_hooks_as_a_structured_record(env) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    locks = RebalanceLockManager(eng.brokers)
    refused = []
    run_ids = set()

    class Recorder(ConsumeMessageHook):
        def consume_message_before(self, context):
            run_ids.add(context.run_id)

        def consume_refused(self, context):
            refused.append(context)

    def listener(msgs, ctx):
        assert ctx.run_id in run_ids
        if msgs[0].queue_offset == 1:
            locks.assign("g", [(MQ, "c2", "other")], dead_clients=["c1"])
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", hooks=[Recorder()]))
    (rec,) = refused
    assert (rec.reason, rec.client_id, rec.current_owner, rec.sub) == ("FENCED", "c1", "c2", "g")
    assert rec.current_epoch > rec.epoch
    assert rec.run_id in run_ids and rec.offset == 3  # the run handled all three, then tried to commit


def test_hooks_run_before_and_after_each_call(env) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    events = []

    class Recorder(ConsumeMessageHook):
        def consume_message_before(self, context):
            events.append(("before", context.msg_list[0].queue_offset))

        def consume_message_after(self, context):
            events.append(("after", context.msg_list[0].queue_offset, context.status, context.success))

    drain(eng, ListenerSpec(lambda m, c: S.SUCCESS, "t", "g", hooks=[Recorder()]))
    assert events == [
        ("before", 0), ("after", 0, "SUCCESS", True),
        ("before", 1), ("after", 1, "SUCCESS", True),
        ("before", 2), ("after", 2, "SUCCESS", True),
    ]


def test_time_budget_requeues_the_request(settings) -> None:
    s = settings.model_copy(update={"max_time_consume_continuously_ms": 50})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(s, "c1")
    for i in range(50):
        p.send_orderly("t", str(i).encode(), sharding_key="k")

    def slow(msgs, ctx):
        time.sleep(0.01)
        return S.SUCCESS

    outs = drain(eng, ListenerSpec(slow, "t", "g"))
    assert any(o.verb == "REQUEUE" and o.countdown == pytest.approx(0.01) for o in outs)
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 50


def test_stale_or_duplicate_token_does_nothing(env) -> None:
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="k")
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    called = []
    spec = ListenerSpec(lambda m, c: called.append(1) or S.SUCCESS, "t", "g")
    assert ConsumeRequest(eng, spec, "g", MQ, "not-the-token").run().verb == "STALE"
    eng.brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), "run", 2**50)
    assert ConsumeRequest(eng, spec, "g", MQ, "tok0").run().verb == "BUSY"
    assert called == []


def test_message_with_unencodable_metadata_still_reaches_the_dlq(env) -> None:
    p, eng = env
    c = eng.brokers.default.client
    # Valid JSON, wrong types, and a lone surrogate in a key: nothing about it can be re-encoded.
    c.xadd(keys.queue_log(MQ.tag), {"h": b'{"i":"x","k":["\\ud800"],"p":{"a":1}}', "b": b"payload", "s": b"0"},
           id="0-1")
    c.incr(keys.queue_next(MQ.tag))
    p.send_orderly("t", b"next", sharding_key="k")
    seen = []
    drain(eng, ListenerSpec(lambda msgs, ctx: seen.extend(m.body for m in msgs) or S.SUCCESS, "t", "g"))
    assert seen == [b"next"]
    (dead,) = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert dead.body == b"payload" and dead.properties["ORIGIN_QUEUE_OFFSET"] == "0"


def test_oversized_stored_message_goes_to_dlq_with_reason(settings) -> None:
    big = Producer(settings=settings)  # default 4 MiB limit: this producer may write 64 bytes
    big.create_topic("t", queues=1)
    big.send_orderly("t", b"x" * 64, sharding_key="k")
    big.send_orderly("t", b"ok", sharding_key="k")
    small = settings.model_copy(update={"max_message_size": 16})  # the consumer's limit is lower
    eng = ConsumerEngine(small, "c1")
    seen = []
    drain(eng, ListenerSpec(lambda msgs, ctx: seen.extend(m.body for m in msgs) or S.SUCCESS, "t", "g"))
    assert seen == [b"ok"]
    (dead,) = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert dead.body == b"x" * 64
    assert "over max_message_size 16" in dead.properties["DLQ_REASON"]


def test_consume_counters_reach_redis(env) -> None:
    from mqorder.consumer.stats import ConsumerStatsManager

    p, eng = env
    for i in range(7):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    drain(eng, ListenerSpec(lambda m, c: S.SUCCESS, "t", "g"))
    stats = ConsumerStatsManager.read(eng.brokers.default.client, "g")[MQ.key]
    assert stats["ok"] == 7 and stats["rt_n"] == 7 and stats["rt_ms"] >= 0


def test_drained_request_lingers_for_a_trickle_when_allowed(env) -> None:
    import threading

    p, eng = env
    eng.may_linger = lambda: True  # what the threads pool's probe says when no request waits
    p.send_orderly("t", b"0", sharding_key="k")
    seen: list[bytes] = []

    def trickle() -> None:
        for i in range(1, 6):
            time.sleep(0.02)  # well within consume_linger_ms (1 s by default) of each other
            p.send_orderly("t", str(i).encode(), sharding_key="k")

    t = threading.Thread(target=trickle)
    t.start()
    outs = drain(eng, ListenerSpec(lambda msgs, ctx: seen.extend(m.body for m in msgs) or S.SUCCESS, "t", "g"))
    t.join()
    assert seen == [b"0", b"1", b"2", b"3", b"4", b"5"]
    assert [o.verb for o in outs] == ["IDLE"]  # one run served the whole trickle
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 6


def _linger_run(env, may_linger: Callable[[], bool] = lambda: True):
    """Send one message and drain in a thread; return once the run is lingering after it.

    Returns (producer, engine, bodies seen, outcomes, [end time], thread, redis client).
    """
    p, eng = env
    eng.may_linger = may_linger
    p.send_orderly("t", b"0", sharding_key="k")
    seen: list[bytes] = []
    outs: list[Outcome] = []
    ended: list[float] = []

    def go() -> None:
        outs.extend(drain(eng, ListenerSpec(lambda msgs, ctx: seen.extend(m.body for m in msgs) or S.SUCCESS,
                                            "t", "g"), max_runs=1))
        ended.append(time.monotonic())

    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    log = MessageLog(eng.brokers)
    # Handled and committed (the commit carries the first lingering read): on a loaded machine the
    # commit can come well after the listener call, and a test acting before it would race it.
    while not (seen and log.consume_offset("g", MQ) == 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # the run is lingering now (consume_linger_ms is 1 s)
    assert not ended, "the run should still be lingering"
    return p, eng, seen, outs, ended, t, eng.brokers.default.client


def test_lingering_request_gives_its_slot_back_as_soon_as_a_request_waits(env) -> None:
    waiting = False
    _, eng, seen, outs, ended, t, _ = _linger_run(env, lambda: not waiting)
    waiting, flipped = True, time.monotonic()
    t.join(2)
    assert ended and ended[0] - flipped < 0.2  # within a couple of 10 ms slices, not after 1 s
    assert [o.verb for o in outs] == ["IDLE"] and seen == [b"0"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1


def test_lingering_request_stops_when_its_queue_is_reassigned(env) -> None:
    _, eng, seen, outs, ended, t, r = _linger_run(env)
    r.hset(keys.sub_state(MQ.tag, "g"), "assignee", "c2")  # what a rebalance writes
    flipped = time.monotonic()
    t.join(2)
    assert ended and ended[0] - flipped < 0.2
    # The run ended and moved the lock to the new assignee (nothing left to hand over, so IDLE),
    # with everything it consumed committed.
    assert [o.verb for o in outs] == ["IDLE"]
    assert r.hget(keys.sub_state(MQ.tag, "g"), "owner") == b"c2"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1


def test_lingering_request_that_lost_its_lock_hands_nothing_to_the_listener(env) -> None:
    """Messages read while lingering did not come through a fenced commit: if the lock moved to a
    new epoch meanwhile (a takeover), the run must stop without calling the listener on them."""
    p, eng, seen, outs, ended, t, r = _linger_run(env)
    r.hset(keys.sub_state(MQ.tag, "g"), mapping={"owner": "c2", "epoch": 99})  # what a takeover writes
    p.send_orderly("t", b"1", sharding_key="k")
    t.join(2)
    assert ended
    assert seen == [b"0"]  # b"1" was never handed to this run's listener
    assert [o.verb for o in outs] == ["FENCED"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1  # the new owner starts at b"1"


@pytest.mark.parametrize("settings", [{"client_lock_expire_ms": 300, "consume_linger_ms": 2000}], indirect=True)
def test_lingering_reads_do_not_extend_the_trust_in_a_lease_they_never_checked(env) -> None:
    """Only a fenced commit or touch confirms the lock (``ProcessQueue.mark_locked``). A lingering
    read checks owner, epoch and pending token, not the lease: it must not renew the run's local
    trust, or a lease that lapsed in Redis (renewals failing, a replica promoted with an older one)
    kept handing messages to the listener. Here the local trust is 300 ms: a message read after it
    goes through a fenced touch first, which the lapsed lease refuses."""
    p, _, seen, outs, ended, t, r = _linger_run(env)
    # Lingering reads for 1 s: far longer than the local trust since the commit (which the
    # first lingering read, riding on it, returns with: up to a slice later).
    time.sleep(1.0)
    r.hset(keys.sub_state(MQ.tag, "g"), "lease", 1)  # lapsed in Redis, owner and epoch unchanged
    p.send_orderly("t", b"1", sharding_key="k")
    t.join(3)
    assert ended
    assert seen == [b"0"]  # b"1" was never handed to the listener on a lapsed lease
    assert [o.verb for o in outs] == ["FENCED"]


def test_commit_recovers_when_redis_lost_its_scripts(env) -> None:
    """After a Redis restart (or SCRIPT FLUSH) the pipelined commit gets NOSCRIPT: it loads the
    script and sends the commit and the pull again, losing and repeating nothing."""
    p, eng = env
    for i in range(100):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    eng.brokers.default.client.script_flush()
    seen: list[int] = []
    outs = drain(eng, ListenerSpec(lambda msgs, ctx: seen.extend(int(m.body) for m in msgs) or S.SUCCESS, "t", "g"))
    assert seen == list(range(100))
    assert outs[-1].verb == "IDLE"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 100


def test_a_commit_sent_again_after_noscript_asks_again_whether_to_linger(env) -> None:
    """The first lingering read rides on a drained run's commit, right after ``_may_linger``
    said yes. If the commit comes back NOSCRIPT, the pipeline is sent again after a blocking read
    and a script load: by then a request may wait for the slot, so the resent read asks
    ``may_linger`` again and, told no, is a plain read (one blocking XREAD in all, not two)."""
    p, eng = env
    r = eng.brokers.default.client
    answers = iter([True])
    eng.may_linger = lambda: next(answers, False)  # yes once, then a request waits for the slot
    p.send_orderly("t", b"0", sharding_key="k")
    flushed: list[bool] = []

    def listener(msgs, ctx):
        if not flushed:
            r.script_flush()  # the commit after this call gets NOSCRIPT
            flushed.append(True)
        return S.SUCCESS

    before = r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)
    drain(eng, ListenerSpec(listener, "t", "g"))
    assert flushed
    assert r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0) - before == 1
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1


def test_request_does_not_linger_by_default(env) -> None:
    p, eng = env
    p.send_orderly("t", b"0", sharding_key="k")
    t0 = time.monotonic()
    outs = drain(eng, ListenerSpec(lambda m, c: S.SUCCESS, "t", "g"))
    assert [o.verb for o in outs] == ["IDLE"] and time.monotonic() - t0 < 0.05


def test_run_paused_past_its_run_lease_is_fenced_even_within_one_client(settings, monkeypatch) -> None:
    """A pool process paused mid-call (its worker still alive) must not commit or believe it owns
    the queue once another run of the same client took over. The pause is the whole process's
    (SIGSTOP, a VM freeze): its LeaseKeeper thread, which renews a long call's lease, is paused too,
    so here it renews nothing."""
    import threading

    from mqorder.consumer.lease_keeper import LeaseKeeper

    monkeypatch.setattr(LeaseKeeper, "renew_due", lambda self, now: None)

    from mqorder.rebalance.service import RebalanceService

    s = settings.model_copy(update={"run_lease_ms": 300})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    eng = ConsumerEngine(s, "c1")
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    eng.brokers.meta.hset(keys.assignment("g"), MQ.key, "c1")
    release = threading.Event()
    observed: list[bool] = []

    def stuck(msgs, ctx):
        if msgs[0].queue_offset == 0 and not observed:
            release.wait(5)  # "paused" past the run lease
            observed.append(ctx.still_owner())
        return S.SUCCESS

    first: list[Outcome] = []
    t = threading.Thread(target=lambda: first.append(ConsumeRequest(eng, ListenerSpec(stuck, "t", "g"), "g", MQ, "tok0").run()))
    t.start()
    time.sleep(0.6)
    (d,) = RebalanceService(eng.brokers, s).sweep(["g"], "c1")  # the lapsed run is re-dispatched
    second = ConsumeRequest(ConsumerEngine(s, "c1"), ListenerSpec(lambda m, c: S.SUCCESS, "t", "g"), "g", MQ, d.token).run()
    assert second.verb == "IDLE" and second.consumed == 3
    release.set()
    t.join()
    assert observed == [False]
    assert first[0].verb == "FENCED"
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 3

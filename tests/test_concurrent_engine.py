"""Concurrent listeners (``@concurrent_listener``) in the Celery-free engine, against a real
redis-server: messages of one queue in parallel, batches and ``ack_index``, sends back to
``%RETRY%<group>`` with RocketMQ's delay levels, the DLQ after ``max_reconsume_times``, the
committed offset held at the lowest message in flight, a failover that redelivers only unfinished
offsets, and the span limit. The worker tests run the same engine in real Celery workers
(``test_concurrent_e2e``)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from mqorder import ConsumeConcurrentlyStatus, concurrent_listener, keys, orderly_listener
from mqorder.consumer.concurrent_request import ConcurrentConsumeRequest
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.listener import ListenerSpec, get_listener, unregister_listener
from mqorder.consumer.offset_map import decode_done
from mqorder.consumer.retry import retry_delay_ms
from mqorder.consumer.run_types import Outcome
from mqorder.errors import ListenerError
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings, parse_delay_levels
from mqorder.store.delay import DelayMover, DelayStore
from mqorder.store.log import MessageLog
from tests.engine_support import MQ, drain

C = ConsumeConcurrentlyStatus
RETRY_MQ = MessageQueue(keys.retry_topic("g"), "broker-a", 0)


def conc_spec(func, topic: str = "t", **kw) -> ListenerSpec:
    return ListenerSpec(func, topic, "g", ordering="concurrent", **kw)


class Recorder:
    """Records every call: offsets seen, reconsume counts, how many calls ran at once."""

    def __init__(self, sleep_ms: float = 3.0) -> None:
        self.lock = threading.Lock()
        self.seen: list[int] = []
        self.batches: list[list[int]] = []
        self.now_running = 0
        self.max_running = 0
        self.sleep_ms = sleep_ms
        self.rng = random.Random(5)

    def __call__(self, msgs, ctx):
        with self.lock:
            self.now_running += 1
            self.max_running = max(self.max_running, self.now_running)
            delay = self.rng.random() * self.sleep_ms / 1000
        time.sleep(delay)
        with self.lock:
            self.seen.extend(m.queue_offset for m in msgs)
            self.batches.append([m.queue_offset for m in msgs])
            self.now_running -= 1
        return self.status(msgs, ctx)

    def status(self, msgs, ctx):
        return C.CONSUME_SUCCESS


@pytest.fixture
def fast_retry_env(redis_url):
    """A producer, a topic ``t`` of one queue and an engine whose delay levels are 50 ms each."""
    from mqorder import Producer

    s = load_settings(redis_url=redis_url, message_delay_level=" ".join(["50ms"] * 18))
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(s, "c1")
    yield p, eng, s
    p.close()
    eng.brokers.close()


def send_all(p, bodies: list[bytes]) -> None:
    """To the one queue of ``t``, in this order, each with a key of its own."""
    p.send_orderly_batch("t", [(f"k{i}", b) for i, b in enumerate(bodies)])


def test_messages_of_one_queue_run_in_parallel_and_each_finishes_once(env) -> None:
    p, eng = env
    send_all(p, [f"m{i}".encode() for i in range(200)])
    rec = Recorder()
    drain(eng, conc_spec(rec, key_concurrency=8))
    assert sorted(rec.seen) == list(range(200))  # every message once
    assert 1 < rec.max_running <= 8  # really side by side, within consume_concurrency
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 200


def test_the_engine_runs_a_concurrent_consume_request_for_concurrent_listeners() -> None:
    assert request_class(conc_spec(lambda m, c: C.CONSUME_SUCCESS)) is ConcurrentConsumeRequest


def test_batches_and_ack_index_send_only_the_unacknowledged_tail_back(env) -> None:
    """Batches of 4: the listener acknowledges the first two of each; the other two of each go to
    %RETRY%g (delayed, not visible yet) and the queue's offset still moves to its end."""
    p, eng = env
    send_all(p, [f"m{i}".encode() for i in range(16)])

    class Partial(Recorder):
        def status(self, msgs, ctx):
            ctx.ack_index = 1
            return C.CONSUME_SUCCESS

    rec = Partial(sleep_ms=0)
    drain(eng, conc_spec(rec, consume_message_batch_max_size=4, key_concurrency=2))
    assert all(1 <= len(b) <= 4 for b in rec.batches) and max(len(b) for b in rec.batches) == 4
    expected_back = sum(max(0, len(b) - 2) for b in rec.batches)
    assert expected_back > 0
    delays = DelayStore(eng.brokers, eng._appender, timeout=5)
    assert delays.waiting(RETRY_MQ) == expected_back
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 16
    assert MessageLog(eng.brokers).max_offset(RETRY_MQ) == 0  # delayed: not in the log yet


def test_retry_delay_follows_rocketmqs_levels() -> None:
    levels = parse_delay_levels("1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h")
    assert retry_delay_ms(levels, 0) == 10_000  # level 3 on the first retry
    assert retry_delay_ms(levels, 1) == 30_000
    assert retry_delay_ms(levels, 15) == 7_200_000  # capped at the last level
    assert retry_delay_ms(levels, 0, level=1) == 1_000  # the listener's choice wins
    assert parse_delay_levels("200ms 1s") == [200, 1000]


def test_a_failing_message_comes_back_through_the_retry_topic_and_reaches_the_dlq_after_16(
    fast_retry_env,
) -> None:
    """RECONSUME_LATER every time: the message is handled 1 + 16 times (reconsume_times 0..16), the
    retries come from %RETRY%g with the original topic, id and body, then it goes to %DLQ%g; the
    other messages finish once."""
    p, eng, s = fast_retry_env
    send_all(p, [b"ok0", b"bad", b"ok1"])
    calls: list[tuple[str, str, int, str]] = []

    def listener(msgs, ctx):
        for m in msgs:
            calls.append((m.body.decode(), m.topic, m.reconsume_times, m.msg_id))
        return C.RECONSUME_LATER if msgs[0].body == b"bad" else C.CONSUME_SUCCESS

    spec = conc_spec(listener)
    drain(eng, spec)
    unregister_listener("g", "t")
    concurrent_listener(topic="t", group="g")(listener)  # the retry run finds the listener by topic
    try:
        mover = DelayMover(eng.brokers, eng._appender)
        dlq = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)
        log = MessageLog(eng.brokers)
        retry = get_listener("g", keys.retry_topic("g"))
        RebalanceLockManager(eng.brokers).assign("g", [(RETRY_MQ, "c1", "r0")])
        r = eng.brokers.default.client
        deadline = time.monotonic() + 60
        for n in range(1000):
            if log.max_offset(dlq) or time.monotonic() > deadline:
                break
            time.sleep(0.06)
            mover.move_once()
            # What the mover's wake-up does for a subscribed owner: a new pending request.
            r.hset(keys.sub_state(RETRY_MQ.tag, "g"), "pending", f"r{n}")
            eng.run(retry, "g", RETRY_MQ, f"r{n}")
    finally:
        unregister_listener("g", "t")
    bad = [c for c in calls if c[0] == "bad"]
    assert [c[2] for c in bad] == list(range(17))  # the first call and 16 retries
    assert {c[1] for c in bad} == {"t"} and len({c[3] for c in bad}) == 1  # as sent, same id
    assert sorted(c[0] for c in calls if c[0] != "bad") == ["ok0", "ok1"]
    dead = log.read(dlq, 0, 10)
    assert len(dead) == 1 and dead[0].body == b"bad"
    assert dead[0].properties["RECONSUME_TIMES"] == "16" and dead[0].properties["ORIGIN_TOPIC"] == "t"
    assert log.consume_offset("g", RETRY_MQ) == 16  # every retry finished in the retry queue
    assert get_listener("g", keys.retry_topic("g")) is None  # gone with the group's last listener


def test_delay_level_minus_one_sends_straight_to_the_dlq(env) -> None:
    p, eng = env
    send_all(p, [b"x"])

    def listener(msgs, ctx):
        ctx.delay_level_when_next_consume = -1
        return C.RECONSUME_LATER

    drain(eng, conc_spec(listener))
    dead = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert [m.body for m in dead] == [b"x"]
    assert DelayStore(eng.brokers, eng._appender, timeout=5).waiting(RETRY_MQ) == 0


def test_an_exception_or_none_counts_as_reconsume_later(env) -> None:
    p, eng = env
    send_all(p, [b"raise", b"none", b"ok"])

    def listener(msgs, ctx):
        if msgs[0].body == b"raise":
            raise RuntimeError("boom")
        if msgs[0].body == b"none":
            return None
        return C.CONSUME_SUCCESS

    drain(eng, conc_spec(listener))
    assert DelayStore(eng.brokers, eng._appender, timeout=5).waiting(RETRY_MQ) == 2
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 3


def test_the_committed_offset_is_the_lowest_in_flight_and_a_failover_redelivers_only_it(env, settings) -> None:
    """Offset 0 hangs while 1..29 finish: the committed offset stays 0 with 1..29 in the map; c2
    takes over (new epoch) and gets offset 0 only; c1's late result is fenced."""
    p, eng = env
    send_all(p, [f"m{i}".encode() for i in range(30)])
    release, hanging = threading.Event(), threading.Event()

    def hang(msgs, ctx):
        if msgs[0].queue_offset == 0:
            hanging.set()
            release.wait(30)
        return C.CONSUME_SUCCESS

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    result: list[Outcome | None] = []
    t = threading.Thread(target=lambda: result.append(eng.run(conc_spec(hang, key_concurrency=4), "g", MQ, "tok0")))
    t.start()
    state = keys.sub_state(MQ.tag, "g")
    r = eng.brokers.default.client

    def committed() -> tuple[int, set[int]]:
        off, raw = r.hmget(state, "offset", "done")
        return int(off or 0), decode_done(raw, int(off or 0))

    deadline = time.monotonic() + 20
    while committed()[1] != set(range(1, 30)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hanging.is_set() and committed() == (0, set(range(1, 30)))
    r.hset(state, mapping={"lease": 0})  # c1 paused past its lease
    eng2 = ConsumerEngine(settings, "c2")
    rec2 = Recorder(sleep_ms=0)
    drain(eng2, conc_spec(rec2), client="c2", token="tok1")
    assert rec2.seen == [0]
    release.set()
    t.join(10)
    assert result and result[0] is not None and result[0].verb in ("FENCED", "STALE")
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 30
    eng2.brokers.close()


def test_pulling_pauses_while_the_in_flight_span_is_too_wide(env) -> None:
    """consume_concurrently_max_span 10: while offset 0 runs, nothing past one pull beyond the
    span is handed out."""
    p, eng = env
    send_all(p, [f"m{i}".encode() for i in range(100)])
    slow_done = threading.Event()
    handled_while_slow: list[int] = []

    def listener(msgs, ctx):
        off = msgs[0].queue_offset
        if off == 0:
            time.sleep(0.5)
            slow_done.set()
        elif not slow_done.is_set():
            handled_while_slow.append(off)
        return C.CONSUME_SUCCESS

    drain(eng, conc_spec(listener, consume_concurrently_max_span=10, pull_batch_size=4, key_concurrency=4))
    assert handled_while_slow and max(handled_while_slow) < 10 + 4
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 100


def test_broadcasting_listeners_retry_in_place(env) -> None:
    p, eng = env
    send_all(p, [b"flaky", b"ok"])
    attempts: list[int] = []

    def listener(msgs, ctx):
        if msgs[0].body == b"flaky":
            attempts.append(msgs[0].reconsume_times)
            if len(attempts) < 3:
                return C.RECONSUME_LATER
        return C.CONSUME_SUCCESS

    spec = ListenerSpec(listener, "t", "g", ordering="concurrent", suspend_current_queue_time_millis=20,
                        message_model=__import__("mqorder").MessageModel.BROADCASTING)
    eng.may_linger = lambda: True
    drain(eng, spec)
    assert attempts == [0, 1, 2]
    assert DelayStore(eng.brokers, eng._appender, timeout=5).waiting(RETRY_MQ) == 0
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 2


def test_bad_listener_settings_and_mixed_groups_are_refused() -> None:
    with pytest.raises(ListenerError, match="consume_concurrency"):
        concurrent_listener(topic="t9", group="g9", consume_concurrency=0)
    with pytest.raises(ListenerError, match="message_model"):
        concurrent_listener(topic="t9", group="g9", message_model="SOMETIMES")
    with pytest.raises(ListenerError, match="two arguments"):
        concurrent_listener(topic="t9", group="g9")(lambda msgs: None)

    def f(msgs, ctx):
        return C.CONSUME_SUCCESS

    concurrent_listener(topic="t9", group="g9")(f)
    try:
        assert get_listener("g9", keys.retry_topic("g9")) is not None  # the retry subscription
        with pytest.raises(ListenerError, match="either in order or concurrently"):
            orderly_listener(topic="t10", group="g9")(lambda msgs, ctx: None)
    finally:
        unregister_listener("g9", "t9")
    assert get_listener("g9", keys.retry_topic("g9")) is None


def test_a_bad_ack_index_on_a_retried_message_names_the_listener(fast_retry_env, caplog) -> None:
    """On %RETRY%<group> the run's spec is a placeholder: the warning named
    mqorder.consumer.listener._retry_placeholder, not the listener that set ack_index."""
    p, eng, s = fast_retry_env
    send_all(p, [b"x"])

    def sloppy(msgs, ctx):
        ctx.ack_index = "0"
        return C.CONSUME_SUCCESS

    concurrent_listener(topic="t", group="g")(sloppy)
    try:
        with caplog.at_level("WARNING", logger="mqorder.consumer.concurrent_request"):
            drain(eng, get_listener("g", "t"))
            mover = DelayMover(eng.brokers, eng._appender)
            retry = get_listener("g", keys.retry_topic("g"))
            RebalanceLockManager(eng.brokers).assign("g", [(RETRY_MQ, "c1", "r0")])
            log = MessageLog(eng.brokers)
            deadline = time.monotonic() + 10
            while not log.max_offset(RETRY_MQ) and time.monotonic() < deadline:
                time.sleep(0.06)
                mover.move_once()
            eng.brokers.default.client.hset(keys.sub_state(RETRY_MQ.tag, "g"), "pending", "r1")
            eng.run(retry, "g", RETRY_MQ, "r1")
    finally:
        unregister_listener("g", "t")
    warned = [r.getMessage() for r in caplog.records if "ack_index" in r.getMessage()]
    assert len(warned) >= 2, warned  # the first delivery and the retried one
    assert all("sloppy" in w and "_retry_placeholder" not in w for w in warned), warned

"""Dead letters of messages that came back through ``%RETRY%<group>`` (concurrent listeners), on a
real redis-server with the engine's own runs and delay mover. Found by a review: such a dead letter
took the dedup id of another message of the original queue (one was dropped: lost) and named the
retry queue's id and offset as its origin (``mqorder dlq replay`` put the copy on the wrong queue)."""
from __future__ import annotations

import time

from mqorder import ConsumeConcurrentlyStatus, concurrent_listener, keys
from mqorder.consumer.listener import ListenerSpec, get_listener, unregister_listener
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.delay import DelayMover
from mqorder.store.log import MessageLog

C = ConsumeConcurrentlyStatus
MQ = MessageQueue("t", "broker-a", 0)
RETRY_MQ = MessageQueue(keys.retry_topic("g"), "broker-a", 0)
DLQ = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)


def res_key_hash(key: str) -> int:
    import zlib

    return zlib.crc32(key.encode())


def _env(redis_url):
    from mqorder import Producer
    from mqorder.consumer.engine import ConsumerEngine
    s = load_settings(redis_url=redis_url, message_delay_level=" ".join(["50ms"] * 18))
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    return p, ConsumerEngine(s, "c1")


def _run(eng, spec, mq, token, runs=20):
    for _ in range(runs):
        out = eng.run(spec, "g", mq, token)
        if out is None or not out.needs_dispatch or out.target != "c1":
            return
        time.sleep(out.countdown)
        token = out.token


def _drive_retries(eng, listener, done, rounds: int = 60) -> None:
    """Register ``listener`` for the group's retry topic, then move due retries and run the retry
    queue (as a worker's mover and dispatch would) until ``done()``."""
    unregister_listener("g", "t")
    concurrent_listener(topic="t", group="g", max_reconsume_times=1)(listener)
    retry = get_listener("g", keys.retry_topic("g"))
    mover = DelayMover(eng.brokers, eng._appender)
    r = eng.brokers.default.client
    for n in range(rounds):
        time.sleep(0.06)
        mover.move_once()
        r.hset(keys.sub_state(RETRY_MQ.tag, "g"), "pending", f"r{n}")
        _run(eng, retry, RETRY_MQ, f"r{n}", runs=1)
        if done():
            return


def test_two_different_messages_dead_lettered_are_both_kept(redis_url) -> None:
    """t:0@0 'x' goes to the DLQ directly (delay level -1); t:0@1 'y' fails once, comes back from
    %RETRY%g queue 0 at offset 0 and is dead-lettered there (max_reconsume_times=1). Two different
    messages: the DLQ must hold both."""
    p, eng = _env(redis_url)
    try:
        p.send_orderly_batch("t", [("k0", b"x"), ("k1", b"y")])
        # Both lanes assigned in one rebalance call (what the rebalance of a worker does per broker).
        eng.retry_sender.queues("g")  # the retry topic exists
        RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0"), (RETRY_MQ, "c1", "r0")])

        def listener(msgs, ctx):
            if msgs[0].body == b"x":
                ctx.delay_level_when_next_consume = -1
            return C.RECONSUME_LATER

        _run(eng, ListenerSpec(listener, "t", "g", ordering="concurrent", max_reconsume_times=1), MQ, "tok0")
        log = MessageLog(eng.brokers)
        _drive_retries(eng, listener, lambda: log.consume_offset("g", RETRY_MQ) >= 1)
        assert log.consume_offset("g", RETRY_MQ) == 1  # 'y' finished in the retry queue...
        dead = log.read(DLQ, 0, 10)
        assert sorted(d.body for d in dead) == [b"x", b"y"]  # ...so it must be in the DLQ
    finally:
        unregister_listener("g", "t")
        p.close()
        eng.brokers.close()


def test_a_dead_letter_from_the_retry_topic_records_and_replays_to_its_real_queue(redis_url) -> None:
    """A message of t:3 fails, comes back from %RETRY%g queue 0 and dies there: its dead letter
    says it came from t queue 0 at the retry queue's offset, and replay puts it on t:0."""
    from mqorder import Producer
    from mqorder.admin.common import Admin
    from mqorder.admin.dlq import dlq_list, replay
    from mqorder.consumer.engine import ConsumerEngine
    s = load_settings(redis_url=redis_url, message_delay_level=" ".join(["50ms"] * 18))
    p = Producer(settings=s)
    p.create_topic("t", queues=4)
    eng = ConsumerEngine(s, "c1")
    mq3 = MessageQueue("t", "broker-a", 3)
    try:
        for i in range(50):
            res = p.send_orderly("t", b"pad", sharding_key=f"o{i}")
            if res.message_queue == mq3:
                key = f"o{i}"
                break
        res = p.send_orderly("t", b"poison", sharding_key=key)
        assert res.message_queue == mq3
        eng.retry_sender.queues("g")
        RebalanceLockManager(eng.brokers).assign("g", [(mq3, "c1", "tok0"), (RETRY_MQ, "c1", "r0")])

        def listener(msgs, ctx):
            return C.RECONSUME_LATER if msgs[0].body == b"poison" else C.CONSUME_SUCCESS

        _run(eng, ListenerSpec(listener, "t", "g", ordering="concurrent", max_reconsume_times=1), mq3, "tok0")
        log = MessageLog(eng.brokers)
        _drive_retries(eng, listener, lambda: log.max_offset(DLQ) >= 1)
        admin = Admin.open(s)
        d = dlq_list(admin, "g").messages[0]
        assert (d.origin_topic, d.origin_broker, d.origin_queue_id, d.origin_offset) == ("t", "broker-a", 3,
                                                                                         res.queue_offset)
        rep = replay(admin, "g")
        assert rep.by_queue == {mq3.key: 1}
        (copy,) = log.read(mq3, res.queue_offset + 1, 10)
        assert copy.body == b"poison" and copy.key_hash == res_key_hash(key)
        assert [k for k in copy.properties if k.startswith(("RETRY_", "ORIGIN_")) or k == "RECONSUME_TIME"] == ["ORIGIN_MESSAGE_ID"]
    finally:
        unregister_listener("g", "t")
        p.close()
        eng.brokers.close()


def test_a_send_back_whose_reply_was_lost_is_not_stored_twice(redis_url, monkeypatch) -> None:
    """The first send-back to %RETRY%g is stored but its reply is lost (the script ran, then the
    call raised BrokerUnavailableError, as on a timeout): the engine retries the run, which sends
    the message back again. Once stored twice (each copy then retried on its own); now once per
    message and holder epoch, as the DLQ writer's dead letters (found by a review)."""
    from mqorder.errors import BrokerUnavailableError
    p, eng = _env(redis_url)
    try:
        p.send_orderly_batch("t", [("k0", b"x")])
        delays = eng.retry_sender.delays
        real = delays.schedule
        lost = []

        calls = 0

        def schedule(*a, **kw):
            nonlocal calls
            calls += 1
            due = real(*a, **kw)
            if not lost:
                lost.append(1)
                raise BrokerUnavailableError("reply lost (simulated timeout)")
            return due

        monkeypatch.setattr(delays, "schedule", schedule)
        RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
        spec = ListenerSpec(lambda msgs, ctx: C.RECONSUME_LATER, "t", "g", ordering="concurrent")
        _run(eng, spec, MQ, "tok0")
        assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1
        assert delays.waiting(RETRY_MQ) == 1, f"{delays.waiting(RETRY_MQ)} copies of one message in the retry topic"
        assert len(lost) == 1 and calls == 2  # the lost reply, then the retried run's send-back
    finally:
        p.close()
        eng.brokers.close()

"""A dead letter is written once per original message and holder epoch.

The run commits the original's offset only after the dead letter is stored; when that commit
fails (a Redis error) the run starts over from the committed offset, under the same epoch, and
dead-letters the same message again. Once a bug: the DLQ then held two copies. A new holder (a
new epoch) redelivering and dead-lettering it again still adds its own copy (at-least-once).
"""

from __future__ import annotations

import redis

from mqorder import ConsumeOrderlyStatus, keys
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog
from mqorder.store.raw_pipe import ConnectionLease
from tests.engine_support import MQ, drain

DLQ = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)


def test_a_commit_lost_after_the_dead_letter_does_not_write_it_twice(env, monkeypatch) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    log = MessageLog(eng.brokers)
    scripts = eng.brokers.get(MQ.broker_name).scripts
    scripts.load("commit")
    original = ConnectionLease.round_trip
    failed: list[int] = []

    def round_trip(self, commands):
        if (not failed and any(c[0] == "EVALSHA" and c[1] == scripts.commit.sha for c in commands)
                and log.max_offset(DLQ) == 1):
            failed.append(1)  # the commit behind the dead letter never reaches Redis
            self.release()
            raise redis.ConnectionError("connection dropped (test)")
        return original(self, commands)

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    calls: list[int] = []

    def listener(msgs, ctx):
        calls.append(msgs[0].queue_offset)
        return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT if msgs[0].queue_offset == 1 else ConsumeOrderlyStatus.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", max_reconsume_times=2, suspend_current_queue_time_millis=10))
    assert failed, "the commit after the dead letter was not failed"
    # The failed commit carried the last reconsume count and offset 2's progress: the retry
    # calls the listener on 1 once more, dead-letters it again (same epoch), then handles 2.
    assert calls == [0, 1, 1, 1, 2, 1, 2], calls
    dead = log.read(DLQ, 0, 10)
    assert [m.properties["ORIGIN_QUEUE_OFFSET"] for m in dead] == ["1"], "the dead letter was written twice"
    assert log.consume_offset("g", MQ) == 3


def test_a_new_epoch_dead_letters_the_message_again(env) -> None:
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="k")
    (msg,) = MessageLog(eng.brokers).read(MQ, 0, 1)
    eng.dlq.send("g", msg, "test", 7)
    eng.dlq.send("g", msg, "test", 7)  # the same holder again: dropped
    eng.dlq.send("g", msg, "test", 8)  # another holder's: kept
    dead = MessageLog(eng.brokers).read(DLQ, 0, 10)
    assert [m.properties["DLQ_EPOCH"] for m in dead] == ["7", "8"]

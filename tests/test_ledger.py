"""The consumption ledger (opt-in) against a real redis-server: one record per handled message,
written with the batch's fenced commit, including calls whose commit was refused."""

from __future__ import annotations

import pytest
import redis

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.ledger import FIELDS, decode_record
from mqorder.consumer.listener import ListenerSpec, orderly_listener
from mqorder.consumer.run_types import Verb
from mqorder.errors import ListenerError
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager

S = ConsumeOrderlyStatus
MQ = MessageQueue("t", "broker-a", 0)




def run_until_idle(eng: ConsumerEngine, spec: ListenerSpec, max_runs: int = 50) -> list[Verb]:
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    token, verbs = "tok0", []
    for _ in range(max_runs):
        out = ConsumeRequest(eng, spec, "g", MQ, token).run()
        verbs.append(out.verb)
        if not out.needs_dispatch or out.target != "c1":
            break
        token = out.token
    return verbs


def ledger(r: redis.Redis) -> list[dict]:
    return [decode_record(f[b"r"]) for _, f in r.xrange(keys.ledger("g"))]


def test_every_handled_message_gets_one_record_with_its_outcome(env, r: redis.Redis) -> None:
    p, eng = env
    for i in range(4):
        p.send_orderly_batch("t", [(f"k{i % 2}", str(i).encode())])
    fails = {1: 1}

    def listener(msgs, ctx):
        off = msgs[0].queue_offset
        if fails.get(off, 0) > 0:
            fails[off] -= 1
            return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", suspend_current_queue_time_millis=10, ledger=True)
    run_until_idle(eng, spec)
    recs = ledger(r)
    assert [(x["offset"], x["attempt"], x["outcome"]) for x in recs] == [
        (0, 0, "SUCCESS"), (1, 0, "SUSPEND"), (1, 1, "SUCCESS"), (2, 0, "SUCCESS"), (3, 0, "SUCCESS"),
    ]
    assert [x["key"] for x in recs] == ["k0", "k1", "k1", "k0", "k1"]
    assert set(recs[0]) == set(FIELDS)
    assert {(x["group"], x["topic"], x["queue"], x["client"]) for x in recs} == {("g", "t", 0, "c1")}
    assert all(x["born_ms"] <= x["start_ms"] <= x["end_ms"] for x in recs)
    assert len({x["run"] for x in recs}) == 2  # the suspend ended the first run


def test_dlq_and_poison_messages_are_recorded_as_dlq(env, r: redis.Redis) -> None:
    p, eng = env
    p.send_orderly("t", b"bad", sharding_key="k")
    p.send_orderly("t", b"ok", sharding_key="k")
    spec = ListenerSpec(
        lambda m, c: S.SUCCESS if m[0].body == b"ok" else S.SUSPEND_CURRENT_QUEUE_A_MOMENT,
        "t", "g", max_reconsume_times=1, suspend_current_queue_time_millis=10, ledger=True,
    )
    run_until_idle(eng, spec)
    assert [(x["offset"], x["attempt"], x["outcome"]) for x in ledger(r)] == [
        (0, 0, "SUSPEND"), (0, 1, "DLQ"), (1, 0, "SUCCESS"),
    ]


def test_a_call_whose_commit_was_refused_is_still_recorded(env, r: redis.Redis) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    locks = RebalanceLockManager(eng.brokers)

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 1:
            locks.assign("g", [(MQ, "c2", "other")], dead_clients=["c1"])
        return S.SUCCESS

    verbs = run_until_idle(eng, ListenerSpec(listener, "t", "g", ledger=True))
    assert verbs[-1] == Verb.FENCED
    recs = ledger(r)
    assert [x["offset"] for x in recs] == [0, 1, 2]  # handled by the stale holder: an audit must see it
    assert len({x["epoch"] for x in recs}) == 1  # one run, one epoch


def test_no_ledger_unless_asked(env, r: redis.Redis) -> None:
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="k")
    run_until_idle(eng, ListenerSpec(lambda m, c: S.SUCCESS, "t", "g"))
    assert not r.exists(keys.ledger("g"))


def test_the_setting_turns_it_on_and_bounds_its_length(settings, r: redis.Redis) -> None:
    s = settings.model_copy(update={"ledger": True, "ledger_max_len": 1000})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(s, "c1")
    p.send_orderly_batch("t", [("k", b"x")] * 3000)
    run_until_idle(eng, ListenerSpec(lambda m, c: S.SUCCESS, "t", "g", consume_message_batch_max_size=32))
    assert 1000 <= r.xlen(keys.ledger("g")) < 1500  # trimmed approximately (MAXLEN ~)
    p.close()
    eng.brokers.close()


def test_a_bad_ledger_option_is_refused() -> None:
    with pytest.raises(ListenerError, match="ledger must be"):
        orderly_listener(topic="t", group="g", ledger="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("survives", [(), ("commit",), ("ledger",)], ids=["both-lost", "ledger-lost", "commit-lost"])
def test_records_behind_the_commit_survive_a_script_flush_once_each(env, r: redis.Redis, survives) -> None:
    """The records ride behind the fenced commit by SHA. When Redis loses its scripts mid-run (a
    restart, SCRIPT FLUSH), whichever of the two was refused is sent again, and only that one: every
    message keeps exactly one record, and the commit is never applied twice."""
    from mqorder.store.scripts import source

    p, eng = env
    for i in range(100):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    flushed: list[int] = []

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 50 and not flushed:
            flushed.append(50)
            r.script_flush()
            for name in survives:  # what a Redis that lost one script would still hold
                r.script_load(source(name))
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", ledger=True)
    run_until_idle(eng, spec)
    assert flushed == [50]
    recs = ledger(r)
    assert sorted(x["offset"] for x in recs) == list(range(100))
    assert {x["outcome"] for x in recs} == {"SUCCESS"}
    state = r.hgetall(keys.sub_state(MQ.tag, "g"))
    assert int(state[b"offset"]) == 100

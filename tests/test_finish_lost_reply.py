"""A run's ``finish.lua`` whose reply is lost: the request it decided on must still be sent.

``finish.lua`` ends a run and, when the queue has a backlog, records a new pending token and
answers who must get the next ConsumeRequest (REQUEUE to the caller, HANDOVER or DISPATCH to
another client). Only the caller sends that request. If the reply is lost (the connection drops
after the script ran), ``ConsumerEngine._run_one`` retries. Once a bug: the retry began the run
again, ``begin.lua`` saw the new token and answered STALE, and nobody sent the request: the queue,
backlog and all, waited out ``pending_ttl_ms`` and a sweep. Now the retry sends the same finish
call (the run's one new token), which answers as the first did (``finished_already``).

The reply is lost for real: the script runs on a real redis-server, then the connection is
dropped before the caller reads the reply (a wrapper around the lease's round trip).
"""

from __future__ import annotations

import pytest
import redis

from mqorder import ConsumeOrderlyStatus, keys
from mqorder.consumer.listener import ListenerSpec
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.raw_pipe import ConnectionLease
from tests.engine_support import MQ

SUB = "g"


def _lose_first_reply_of(monkeypatch: pytest.MonkeyPatch, sha: str) -> list[int]:
    """Drop the connection right after the first round trip holding script ``sha`` ran."""
    original = ConnectionLease.round_trip
    lost: list[int] = []

    def round_trip(self, commands):
        replies = original(self, commands)
        if not lost and any(c[0] == "EVALSHA" and c[1] == sha for c in commands):
            lost.append(len(commands))
            self.release()
            raise redis.ConnectionError("the reply was lost on its way back (test)")
        return replies

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    return lost


@pytest.mark.parametrize("suspend", [True, False], ids=["suspend-requeue", "handover"])
def test_a_lost_reply_of_finish_still_sends_the_request_it_decided_on(env, r, monkeypatch, suspend: bool) -> None:
    p, eng = env
    for n in range(3):
        p.send_orderly("t", str(n).encode(), sharding_key="k")
    locks = RebalanceLockManager(eng.brokers)
    assert locks.assign(SUB, [(MQ, "c1", "tok0")])[MQ] == "DISPATCH"
    scripts = eng.brokers.get(MQ.broker_name).scripts
    scripts.load("finish")
    lost = _lose_first_reply_of(monkeypatch, scripts.finish.sha)
    seen: list[int] = []

    def listener(msgs, ctx):
        seen.extend(int(m.body) for m in msgs)
        if suspend:
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT  # the run ends: REQUEUE, backlog left
        if len(seen) == 3:
            # A rebalance gives the queue to c2 while c1 runs it (BUSY), and a message comes: the
            # run ends and finish.lua hands the lock and the backlog over (HANDOVER to c2).
            r.hset(keys.assignment(SUB), MQ.key, "c2")
            assert locks.assign(SUB, [(MQ, "c2", "tok-c2")]) == {MQ: "BUSY"}
            p.send_orderly("t", b"3", sharding_key="k")
        return ConsumeOrderlyStatus.SUCCESS

    spec = ListenerSpec(listener, "t", SUB, consume_message_batch_max_size=1)
    out = eng.run(spec, SUB, MQ, "tok0")
    assert lost, "no finish.lua round trip: the lost reply was not tried"
    state = {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(MQ.tag, SUB)).items()}
    assert out is not None
    # The request the first finish recorded is the one the outcome asks the caller to send.
    assert out.needs_dispatch, f"the request finish.lua decided on was lost: {out}"
    assert out.token == state["pending"] and state["pending"] not in ("", "tok0")
    assert out.target == ("c1" if suspend else "c2") == state["owner"]
    assert (int(state["offset"]), seen) == ((0, [0]) if suspend else (3, [0, 1, 2]))


def _a_run_to_finish(env, r):
    """A queue with a backlog held by c1's run ``tok0``: finish.lua's scripts, keys and the call
    that ends the run with a REQUEUE for ``tok1``."""
    p, eng = env
    p.send_orderly("t", b"0", sharding_key="k")
    assert RebalanceLockManager(eng.brokers).assign(SUB, [(MQ, "c1", "tok0")])[MQ] == "DISPATCH"
    k = [keys.sub_state(MQ.tag, SUB), keys.queue_next(MQ.tag)]
    r.hset(k[0], mapping={"owner": "c1", "lease": 2**62, "run": 0})
    return eng.brokers.get(MQ.broker_name).scripts, k, ["c1", "tok0", "requeue", "tok1", 10_000, 60_000]


def test_a_finish_sent_again_after_the_token_moved_on_is_stale(env, r) -> None:
    """``finished_already`` answers only the call that set the pending token: once another
    request replaced it (the sweep re-dispatched), the old call is STALE again."""
    scripts, k, call = _a_run_to_finish(env, r)
    first = scripts.call("finish", k, call)
    assert [x.decode() if isinstance(x, bytes) else x for x in first] == ["REQUEUE", "c1", "tok1"]
    again = scripts.call("finish", k, call)
    assert [x.decode() if isinstance(x, bytes) else x for x in again] == ["REQUEUE", "c1", "tok1"]
    r.hset(k[0], "pending", "tok2")  # the sweep sent another request
    assert [x.decode() for x in scripts.call("finish", k, call)] == ["STALE"]


def test_a_run_whose_finish_was_retried_ends_even_if_its_idle_nudge_fails(settings, monkeypatch) -> None:
    """A review's repro: the first finish.lua fails before it is sent, the retry's finish answers
    IDLE, and the idle nudge written after it hits a second Redis error. Once a bug: the engine
    sent finish.lua a third time on a run whose end it had already read, an AssertionError that
    failed the task (its follow-ups and the watch's release lost). The nudge is a hint now."""
    from mqorder import Producer
    from mqorder.consumer.engine import ConsumerEngine

    s = settings.model_copy(update={"consume_linger_ms": 100})
    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(s, "c1")
    eng.may_linger = lambda: True
    assert eng.nudges_idle
    p.send_orderly("t", b"0", sharding_key="k")
    assert RebalanceLockManager(eng.brokers).assign(SUB, [(MQ, "c1", "tok0")])[MQ] == "DISPATCH"
    scripts = eng.brokers.get(MQ.broker_name).scripts
    scripts.load("finish")
    original = ConnectionLease.round_trip
    fails = {"finish": 0, "nudge": 0}

    def round_trip(self, commands):
        if not fails["finish"] and any(c[0] == "EVALSHA" and c[1] == scripts.finish.sha for c in commands):
            fails["finish"] += 1
            self.release()
            raise redis.ConnectionError("refused before the finish was sent (test)")
        if not fails["nudge"] and any(c[0] == "XADD" for c in commands):
            fails["nudge"] += 1
            self.release()
            raise redis.ConnectionError("the idle nudge failed (test)")
        return original(self, commands)

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    out = eng.run(ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, "t", SUB), SUB, MQ, "tok0")
    assert fails == {"finish": 1, "nudge": 1}
    assert out is not None and out.verb == "IDLE" and out.consumed == 1
    p.close()
    eng.brokers.close()


def test_a_repeated_finish_renews_the_requests_pending_deadline(env, r) -> None:
    """The request a repeated finish hands out is sent only now: its ``pend_until`` counts from
    now. Once a bug: after an outage longer than ``pending_ttl_ms`` the repeat handed out a token
    already lapsed, and the sweep dispatched a second request beside it."""
    scripts, k, call = _a_run_to_finish(env, r)
    scripts.call("finish", k, call)
    r.hset(k[0], "pend_until", 1)  # the outage outlasted it
    assert [x.decode() if isinstance(x, bytes) else x for x in scripts.call("finish", k, call)] == ["REQUEUE", "c1", "tok1"]
    now_ms = int(r.time()[0]) * 1000
    assert int(r.hget(k[0], "pend_until")) >= now_ms + 9_000

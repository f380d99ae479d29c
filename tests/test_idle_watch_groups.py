"""A lingering request watches the idle queues of *every* group of its process, not only its own
(``IdleQueueWatch``), against a real redis-server.

RocketMQ gives each consumer group consume threads of its own; a Celery worker's few pool slots
serve every group, and one request per worker lingers. With a watch over its own group only, an
operator's 60 groups at a trickle on two stock ``-c 2`` workers cost a wake-up and a Celery task
for nearly every message (p99 send to handle 0.8-6 s). Here a message to another group's idle
queue is run by the lingering request itself, with that group's listener, waking nobody; two
groups of one topic share the queue's log stream, and each group gets every message once, in order. A send to an adopted queue rings the client's doorbell (its nudge
stream) rather than being read from every adopted queue's log."""

from __future__ import annotations

import time

import pytest

from mqorder import ConsumeOrderlyStatus, keys
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.idle_watch import DOORBELL_MARK, IdleQueueWatch
from mqorder.consumer.listener import ListenerSpec, orderly_listener, unregister_listener
from mqorder.consumer.nudge import idle_entry, read_nudges
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from tests.test_idle_watch import (
    ME,
    QUEUES,
    SUB,
    TOPIC,
    assert_every_run_ended_and_committed,
    key_for,
    lingering_run,
    owned_idle_queues,
    wait_until,
    wakes_of_the_client,
)

OTHER = "h"  # a second group of topic ``tw``
THIRD, THIRD_TOPIC = "x", "tx"  # a group of another topic


def own_idle(eng: ConsumerEngine, sub: str, mqs: list[MessageQueue], r) -> None:
    """``sub``'s queues ``mqs`` assigned to and locked by c1, all idle (as ``owned_idle_queues``)."""
    from mqorder.consumer.consume_request import ConsumeRequest

    eng.topics.subscribe(sub, mqs[0].topic, MessageModel.CLUSTERING)
    r.hset(keys.assignment(sub), mapping={mq.key: ME for mq in mqs})
    res = RebalanceLockManager(eng.brokers).assign(sub, [(mq, ME, f"{sub}-tok{mq.queue_id}") for mq in mqs])
    spec = ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, mqs[0].topic, sub)
    for mq in mqs:
        assert res[mq] in ("MOVED", "DISPATCH")
        if res[mq] == "DISPATCH":
            assert ConsumeRequest(eng, spec, sub, mq, f"{sub}-tok{mq.queue_id}").run().verb == "IDLE"


def doorbells_read(monkeypatch) -> list[str]:
    """The state keys of every doorbell a watch reads (``IdleQueueWatch.ring``), as they come."""
    rung: list[str] = []
    ring = IdleQueueWatch.ring

    def spy(self, state_keys):
        rung.extend(state_keys)
        return ring(self, state_keys)

    monkeypatch.setattr(IdleQueueWatch, "ring", spy)
    return rung


def ended_and_committed(r, sub: str, mqs: list[MessageQueue]) -> None:
    for mq in mqs:
        state = {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(mq.tag, sub)).items()}
        assert state["pending"] == "" and state["run"] == "0", (sub, mq.key, state)
        assert int(state.get("offset", 0)) == int(r.get(keys.queue_next(mq.tag)) or 0), (sub, mq.key, state)


def test_a_send_to_another_groups_idle_queue_is_run_by_the_lingering_request_with_that_groups_listener(
    settings, r,
) -> None:
    """Group ``g`` lingers on queue 0 of ``tw``; group ``x`` consumes topic ``tx`` in the same
    process. Messages to ``tx`` wake nobody and are handled, in order, by ``x``'s listener, in the
    lingering request's own task; every run and adoption ends, everything is committed."""
    p, eng = owned_idle_queues(settings, r)
    p.create_topic(THIRD_TOPIC, queues=2)
    tx = [MessageQueue(THIRD_TOPIC, "broker-a", i) for i in range(2)]
    own_idle(eng, THIRD, tx, r)
    by: list[tuple[str, int, int]] = []

    def g_listener(msgs, ctx):
        by.extend(("g", m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    def x_listener(msgs, ctx):
        assert ctx.group == THIRD
        by.extend(("x", m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    orderly_listener(topic=THIRD_TOPIC, group=THIRD)(x_listener)
    try:
        with wakes_of_the_client(r) as wakes, lingering_run(eng, ListenerSpec(g_listener, TOPIC, SUB), r) as run:
            assert wait_until(lambda: all(r.hget(keys.sub_state(mq.tag, THIRD), "pending") not in (None, b"")
                                          for mq in tx)), "the lingering run did not adopt group x's queues"
            sent = []
            for seq in range(20):
                qid = seq % 2
                p.send_orderly(THIRD_TOPIC, str(seq).encode(), sharding_key=key_for(qid, 2))
                sent.append(("x", qid, seq))
                time.sleep(0.01)
            assert wait_until(lambda: len(by) >= len(sent))
            assert sorted(by) == sorted(sent)
            for qid in (0, 1):
                assert [s for _, q, s in by if q == qid] == [s for _, q, s in sent if q == qid]
            assert wakes.get_message(timeout=0.2) is None, "a send woke the client: x's queue was not watched"
        (out,) = run.result
        assert out.consumed == 20 and out.follow_ups == ()
        assert out.sub == THIRD  # the chain ended on one of x's queues
        assert_every_run_ended_and_committed(r)
        ended_and_committed(r, THIRD, tx)
    finally:
        unregister_listener(THIRD, THIRD_TOPIC)
        p.close()
        eng.brokers.close()


def test_two_groups_of_one_topic_each_get_every_message_once_in_order_from_one_lingering_request(
    settings, r, monkeypatch,
) -> None:
    """Groups ``g`` and ``h`` both consume ``tw``, and c1 holds all four queues of each. The run of
    ``g`` lingers on queue 0, whose log stream ``h``'s adopted queue 0 shares. Sends to every
    queue, queue 0 included: each group handles each message exactly once, each queue's in offset
    order, without waking the client."""
    p, eng = owned_idle_queues(settings, r)
    own_idle(eng, OTHER, QUEUES, r)
    by: dict[str, list[tuple[int, int]]] = {SUB: [], OTHER: []}

    def g_listener(msgs, ctx):
        by[SUB].extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    def h_listener(msgs, ctx):
        by[OTHER].extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    orderly_listener(topic=TOPIC, group=OTHER)(h_listener)
    rung = doorbells_read(monkeypatch)
    try:
        with wakes_of_the_client(r) as wakes, lingering_run(eng, ListenerSpec(g_listener, TOPIC, SUB), r) as run:
            assert wait_until(lambda: all(r.hget(keys.sub_state(mq.tag, OTHER), "pending") not in (None, b"")
                                          for mq in QUEUES)), "the lingering run did not adopt h's queues"
            sent = []
            for seq in range(40):
                qid = seq % 4
                p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(qid))
                sent.append((qid, seq))
                time.sleep(0.01)
            assert wait_until(lambda: len(by[SUB]) >= len(sent) and len(by[OTHER]) >= len(sent))
            time.sleep(0.3)  # nothing more comes
            for group in (SUB, OTHER):
                got = by[group]
                assert sorted(got) == sorted(sent), f"group {group} did not get every message exactly once"
                for qid in range(4):
                    assert [s for q, s in got if q == qid] == [s for q, s in sent if q == qid], (group, qid)
            assert wakes.get_message(timeout=0.2) is None, "a send woke the client"
        (out,) = run.result
        assert out.consumed == 80 and out.follow_ups == ()
        # Doorbells, not only the renewals' backlog reports, brought the run to h's queues.
        assert {keys.sub_state(mq.tag, OTHER) for mq in QUEUES} <= set(rung)
        assert_every_run_ended_and_committed(r)
        ended_and_committed(r, OTHER, QUEUES)
    finally:
        unregister_listener(OTHER, TOPIC)
        p.close()
        eng.brokers.close()


def test_ending_the_watch_hands_another_groups_queue_with_messages_to_a_request_of_that_group(settings, r) -> None:
    """``release`` ends each adoption under its own group's state, and the request a queue that got
    messages meanwhile needs is that group's (``FollowUp.sub``): dispatched for ``g``, it would
    find no run to begin and the message would wait out the pending ttl and a sweep."""
    p, eng = owned_idle_queues(settings, r)
    own_idle(eng, OTHER, QUEUES, r)
    orderly_listener(topic=TOPIC, group=OTHER)(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS)
    try:
        watch = eng.idle_watch(SUB, QUEUES[0])
        assert isinstance(watch, IdleQueueWatch)
        watch.refresh(SUB, QUEUES[0])
        assert sorted(watch.adopted) == sorted([(SUB, keys.queue_log(mq.tag)) for mq in QUEUES[1:]]
                                               + [(OTHER, keys.queue_log(mq.tag)) for mq in QUEUES])
        assert watch.plan(SUB, QUEUES[0]).offered == QUEUES[1:]  # switch.lua: g's own queues only
        p.send_orderly(TOPIC, b"x", sharding_key=key_for(2))  # a backlog on queue 2, for g and h alike
        follow = {(f.sub, f.mq) for f in watch.release()}
        assert follow == {(SUB, QUEUES[2]), (OTHER, QUEUES[2])}
        for f in watch.release():  # nothing left to end
            raise AssertionError(f)
        for sub in (SUB, OTHER):
            assert r.hget(keys.sub_state(QUEUES[1].tag, sub), "pending") == b""
            assert r.hget(keys.sub_state(QUEUES[2].tag, sub), "pending") not in (None, b"", watch.token.encode())
    finally:
        unregister_listener(OTHER, TOPIC)
        p.close()
        eng.brokers.close()


def test_a_went_idle_nudge_names_the_group_and_one_without_it_is_skipped() -> None:
    """The nudge stream's "went idle" entries carry each queue's subscription; an entry written by
    a version that named the queue alone (read after an upgrade) is skipped, not taken for the
    reading run's group: the next full refresh adopts the queue anyway."""
    cmd = idle_entry("c1", [("g", "tw:broker-a:0"), ("h%BC%c1", "tw:broker-a:1")])
    fields = list(cmd[cmd.index("*") + 1:])
    entries = [(b"1-0", [f.encode() for f in fields]), (b"2-0", [b"q", b"tw:broker-a:3"]), (b"3-0", [b"w", b"1"]),
               (b"4-0", [b"m", b"state-of-2"])]
    # One pass gives both: the went-idle queues, and the doorbells between them (here, one).
    assert read_nudges(entries) == ([("g", "tw:broker-a:0"), ("h%BC%c1", "tw:broker-a:1")], ["state-of-2"])


def test_a_send_to_an_adopted_queue_rings_its_owners_doorbell_and_nothing_else_does(settings, r) -> None:
    """``ring_doorbell`` (``_append.lua``): a send to a queue whose pending request is a watch's
    token (``DOORBELL_MARK``) and that is not running appends the queue's state key to the
    owner's nudge stream, the key ``keys.linger_nudge`` names; a queue with a dispatched
    request pending, or running under the watch's token, rings nothing."""
    p, eng = owned_idle_queues(settings, r)
    nudge = keys.linger_nudge(ME)
    st = [keys.sub_state(mq.tag, SUB) for mq in QUEUES]
    watch_token = DOORBELL_MARK + "w1"
    r.hset(st[1], mapping={"pending": watch_token, "pend_until": 2**62, "run": 0})
    r.hset(st[2], mapping={"pending": "dispatched", "pend_until": 2**62, "run": 0})
    r.hset(st[3], mapping={"pending": watch_token, "pend_until": 2**62, "run": 2**62})
    for qid in (1, 2, 3):
        p.send_orderly(TOPIC, b"x", sharding_key=key_for(qid))
    entries = [(i, [x for kv in f.items() for x in kv]) for i, f in r.xrange(nudge)]
    assert read_nudges(entries)[1] == [st[1]]
    p.close()
    eng.brokers.close()


def test_a_switch_to_a_key_ordered_group_runs_it_as_key_ordered_runs(settings, r) -> None:
    """The lingering run is queue-ordered; group ``x`` is key-ordered (``ordering="key"``): its
    queue, switched to, runs as a key-ordered run (``KeyConsumeRequest``), not with the lingering
    run's kind: the call of ``a`` waits for a call of ``b`` of the same queue, which only a
    key-ordered run makes while the first is in flight; each key's messages in order."""
    import threading

    p, eng = owned_idle_queues(settings, r)
    p.create_topic(THIRD_TOPIC, queues=1)
    tx = [MessageQueue(THIRD_TOPIC, "broker-a", 0)]
    own_idle(eng, THIRD, tx, r)
    by_key: dict[str, list[int]] = {}
    b_called = threading.Event()
    waited: list[bool] = []
    lock = threading.Lock()

    def x_listener(msgs, ctx):
        for m in msgs:
            key, seq = m.body.decode().split(":")
            if key == "b":
                b_called.set()
            elif not waited:
                waited.append(b_called.wait(5))
            with lock:
                by_key.setdefault(key, []).append(int(seq))
        return ConsumeOrderlyStatus.SUCCESS

    orderly_listener(topic=THIRD_TOPIC, group=THIRD, ordering="key")(x_listener)
    try:
        with wakes_of_the_client(r) as wakes, lingering_run(
                eng, ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB), r) as run:
            assert wait_until(lambda: r.hget(keys.sub_state(tx[0].tag, THIRD), "pending") not in (None, b""))
            items = [("a" if seq < 10 else "b", seq) for seq in range(20)]
            p.send_orderly_batch(THIRD_TOPIC, [(k, f"{k}:{seq}".encode()) for k, seq in items])
            assert wait_until(lambda: sum(len(v) for v in by_key.values()) >= 20)
            assert wakes.get_message(timeout=0.2) is None, "a send woke the client"
        (out,) = run.result
        assert out.consumed == 20
        assert waited == [True], "a's call never saw b's: the queue did not run as a key-ordered run"
        assert by_key == {"a": list(range(10)), "b": list(range(10, 20))}
        ended_and_committed(r, THIRD, tx)
    finally:
        unregister_listener(THIRD, THIRD_TOPIC)
        p.close()
        eng.brokers.close()


@pytest.mark.parametrize("settings", [{"consume_linger_ms": 8000}], indirect=True)
def test_adopted_queues_with_news_are_run_one_after_another_without_waiting_for_another_doorbell(
    settings, r, monkeypatch,
) -> None:
    """Two adopted queues get a message each while the lingering run is inside a listener call:
    one read brings both doorbells. The run switches to the first; when that one is drained the
    second must run at once, not after the next read has waited for a doorbell that never comes
    (once: 20 ms of latency per message at 300 msg/s; here, with a 2 s read slice, 2 s)."""
    import threading

    from mqorder.consumer import linger

    monkeypatch.setattr(linger, "LINGER_SLICE_S", 2.0)  # under the connections' 3 s socket timeout
    p, eng = owned_idle_queues(settings, r)
    handled: dict[int, float] = {}
    in_call = threading.Event()
    release = threading.Event()

    def listener(msgs, ctx):
        for m in msgs:
            if m.queue_id == 0:
                in_call.set()
                release.wait(5)
            handled[m.queue_id] = time.monotonic()
        return ConsumeOrderlyStatus.SUCCESS

    with lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        assert wait_until(lambda: all(r.hget(keys.sub_state(mq.tag, SUB), "pending") not in (None, b"")
                                      for mq in QUEUES[1:]))
        p.send_orderly(TOPIC, b"0", sharding_key=key_for(0))  # the run's own queue: a long call
        assert in_call.wait(5)
        p.send_orderly(TOPIC, b"1", sharding_key=key_for(1))
        p.send_orderly(TOPIC, b"2", sharding_key=key_for(2))
        release.set()
        assert wait_until(lambda: 1 in handled and 2 in handled, timeout=10)
        assert abs(handled[2] - handled[1]) < 1.0, "the second queue waited for a read slice"
    (out,) = run.result
    assert out.consumed == 3
    p.close()
    eng.brokers.close()


def test_a_new_watch_reads_the_doorbells_rung_after_it_was_made_not_older_ones(settings, r, monkeypatch) -> None:
    """Doorbells left in the nudge stream by an earlier watch (a sibling process's, released since)
    are not news for a new one: each would cost a switch to a queue with nothing in it. The new
    watch reads the stream from its newest entry on (``IdleQueueWatch.start_reading``)."""
    p, eng = owned_idle_queues(settings, r)
    old = keys.sub_state(QUEUES[2].tag, SUB)
    r.xadd(keys.linger_nudge(ME), {"m": old})  # rung for a watch gone before this test's
    rung = doorbells_read(monkeypatch)
    seen: list[int] = []

    def listener(msgs, ctx):
        seen.extend(m.queue_id for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    with lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        assert wait_until(lambda: r.hget(old, "pending") not in (None, b""))
        p.send_orderly(TOPIC, b"x", sharding_key=key_for(3))
        assert wait_until(lambda: seen == [3])
    (out,) = run.result
    assert out.consumed == 1
    assert old not in rung, "the new watch took an older watch's doorbell for news"
    p.close()
    eng.brokers.close()


def test_a_renewal_sent_as_a_run_ended_sets_no_run_mark_on_the_adopted_queue(settings, r) -> None:
    """A lingering request's switched-to runs share its watch's token, and a queue handed back to
    the watch keeps that token and its epoch (``finish.lua`` 'adopt'). A run-lease renewal
    (``touch.lua``, a LeaseKeeper tick) arriving just after the run ended must not mark the idle
    queue running: for the run lease (60 s) sends would neither wake anybody nor ring the
    doorbell, and the rebalance would leave it BUSY (chaos: 60 s queue stalls after faults)."""
    p, eng = owned_idle_queues(settings, r)
    scripts = eng.brokers.get("broker-a").scripts
    st = keys.sub_state(QUEUES[1].tag, SUB)
    epoch = int(r.hget(st, "epoch"))
    token = DOORBELL_MARK + "w1"
    r.hset(st, mapping={"pending": token, "pend_until": 2**62, "run": 0})  # adopted, as finish 'adopt' leaves it
    ok = scripts.touch(keys=[st], args=[ME, epoch, token, 60_000, 60_000])
    assert int(ok[0]) == 1  # still the owner at that epoch and token
    assert r.hget(st, "run") == b"0", "a renewal after the run ended marked the idle queue running"
    r.hset(st, "run", 1)  # a run in progress (a mark, however old, until finish clears it)
    scripts.touch(keys=[st], args=[ME, epoch, token, 60_000, 60_000])
    assert int(r.hget(st, "run")) > 1  # renewed
    p.close()
    eng.brokers.close()

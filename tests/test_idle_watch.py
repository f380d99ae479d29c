"""A lingering ConsumeRequest watches its client's other idle queues (``IdleQueueWatch``), against a
real redis-server: sends to those queues wake nobody and are handled by the lingering request, in
order, each claimed through begin.lua; ending the watch hands a queue that got messages meanwhile
to a new request; and only idle queues of the caller are ever adopted."""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.idle_watch import FollowUp, IdleQueueWatch
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from tests.support import evalsha_of

TOPIC, SUB, ME = "tw", "g", "c1"
QUEUES = [MessageQueue(TOPIC, "broker-a", i) for i in range(4)]


def key_for(queue_id: int, n: int = 4) -> str:
    """A sharding key that lands on ``queue_id`` (crc32 mod queues, the producer's default)."""
    i = 0
    while zlib.crc32(f"k{i}".encode()) % n != queue_id:
        i += 1
    return f"k{i}"


def owned_idle_queues(settings, r: redis.Redis) -> tuple[Producer, ConsumerEngine]:
    """Topic ``tw`` with 4 queues, subscribed by group ``g`` (so a send wakes the owner, or rings
    its doorbell), all assigned to and locked by c1, all idle."""
    p = Producer(settings=settings)
    p.create_topic(TOPIC, queues=4)
    p.topics.subscribe(SUB, TOPIC, MessageModel.CLUSTERING)
    eng = ConsumerEngine(settings, ME)
    r.hset(keys.assignment(SUB), mapping={mq.key: ME for mq in QUEUES})
    res = RebalanceLockManager(eng.brokers).assign(SUB, [(mq, ME, f"tok{mq.queue_id}") for mq in QUEUES])
    spec = ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)
    for mq in QUEUES:
        assert res[mq] in ("MOVED", "DISPATCH")  # locked by c1 (with a request if not empty)
        if res[mq] == "DISPATCH":
            assert ConsumeRequest(eng, spec, SUB, mq, f"tok{mq.queue_id}").run().verb == "IDLE"
    return p, eng


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond`` every 10 ms until it holds or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


def wait_adopted(r: redis.Redis, mq: MessageQueue) -> None:
    """Until the lingering run's watch has adopted ``mq`` (its pending slot is the watch's)."""
    assert wait_until(lambda: r.hget(keys.sub_state(mq.tag, SUB), "pending") not in (None, b"")), \
        f"the lingering run did not adopt queue {mq.queue_id}"


@dataclass
class LingeringRun:
    """A request running in a thread, allowed to linger while ``linger`` is set."""

    linger: threading.Event
    thread: threading.Thread
    result: list = field(default_factory=list)


@contextlib.contextmanager
def lingering_run(eng: ConsumerEngine, spec: ListenerSpec, r: redis.Redis, token: str = "t0") -> Iterator[LingeringRun]:
    """Run a request on queue 0 in a thread (its pending slot set to ``token``, as a dispatch
    does) that may linger until the block ends; the block's end lets it stop and joins it."""
    linger = threading.Event()
    linger.set()
    eng.may_linger = linger.is_set
    r.hset(keys.sub_state(QUEUES[0].tag, SUB), mapping={"pending": token, "pend_until": 2**62})
    result: list = []
    thread = threading.Thread(target=lambda: result.append(eng.run(spec, SUB, QUEUES[0], token)))
    thread.start()
    try:
        yield LingeringRun(linger, thread, result)
    finally:
        linger.clear()
        thread.join(timeout=10)


def switch_args(run_token: str, watch_token: str, adopt_ttl_ms: int) -> list:
    """``switch.lua``'s arguments after its first three: ``finish.lua``'s for the run (action
    'adopt'), then ``begin.lua``'s for a candidate (run lease, lock lease, pull_n, runner)."""
    return [ME, run_token, "adopt", "new-tok", 1000, 60_000, watch_token, adopt_ttl_ms,
            ME, watch_token, 60_000, 60_000, 32, "runner-1"]


def assert_every_run_ended_and_committed(r: redis.Redis) -> None:
    """Every run and adoption of the four queues ended: nothing pending, everything committed."""
    for mq in QUEUES:
        state = {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(mq.tag, SUB)).items()}
        assert state["pending"] == "" and state["run"] == "0"
        assert int(state.get("offset", 0)) == int(r.get(keys.queue_next(mq.tag)) or 0)


@contextlib.contextmanager
def wakes_of_the_client(r: redis.Redis) -> Iterator[redis.client.PubSub]:
    """A subscription to c1's wake channel: a message there means a send woke the client."""
    wakes = r.pubsub()
    wakes.subscribe(keys.wake_channel(ME))
    # Read the confirmation now: left unread, it would be the one message a later check reads.
    confirmed = wakes.get_message(timeout=5)
    assert confirmed is not None and confirmed["type"] == "subscribe"
    wakes.ignore_subscribe_messages = True
    try:
        yield wakes
    finally:
        wakes.close()


def test_sends_to_idle_queues_wake_nobody_and_the_lingering_request_runs_them_in_order(settings, r) -> None:
    p, eng = owned_idle_queues(settings, r)
    seen: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        for m in msgs:
            seen.append((m.queue_id, int(m.body)))
        return ConsumeOrderlyStatus.SUCCESS

    with wakes_of_the_client(r) as wakes, lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        time.sleep(0.5)  # the run drained queue 0 and lingers, watching queues 1-3
        sent = []
        for seq in range(30):
            qid = 1 + seq % 3
            p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(qid))
            sent.append((qid, seq))
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while len(seen) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(seen) == sorted(sent)
        for qid in (1, 2, 3):  # per queue, in send (offset) order
            assert [s for q, s in seen if q == qid] == [s for q, s in sent if q == qid]
        assert wakes.get_message(timeout=0.2) is None, "a send woke the client: the queue was not watched"
    (out,) = run.result
    assert out.consumed == 30 and out.follow_ups == ()
    assert_every_run_ended_and_committed(r)
    p.close()
    eng.brokers.close()


def test_ending_the_watch_hands_a_queue_that_got_messages_to_a_new_request(settings, r) -> None:
    p, eng = owned_idle_queues(settings, r)
    broker = eng.brokers.get("broker-a")
    watch = IdleQueueWatch(ME, SUB, "broker-a", broker.scripts, broker.client, lambda: [(SUB, q) for q in eng.owned_queues(SUB)],
                           10_000, 60_000)
    watch.refresh(SUB, QUEUES[0])
    assert sorted(mq for mq, _ in watch.adopted.values()) == QUEUES[1:]
    res = p.send_orderly(TOPIC, b"x", sharding_key=key_for(2))
    assert res.message_queue == QUEUES[2]
    state = keys.sub_state(QUEUES[2].tag, SUB)
    assert r.hget(state, "pending").decode() == watch.token  # the send woke nobody
    (follow,) = watch.release()
    assert (follow.mq, follow.target) == (QUEUES[2], ME)
    assert r.hget(state, "pending").decode() == follow.token  # a new request, to be dispatched
    for mq in (QUEUES[1], QUEUES[3]):  # idle ones just get their pending slot back
        assert r.hget(keys.sub_state(mq.tag, SUB), "pending") == b""
    p.close()
    eng.brokers.close()


@pytest.mark.parametrize("ran", [True, False], ids=["reply-lost", "not-sent"])
def test_ending_the_watch_after_a_connection_error_still_returns_the_request_a_queue_needs(
    settings, r, monkeypatch, ran: bool,
) -> None:
    """``release``'s ``finish.lua`` calls meet a connection error, after they ran (the reply is
    lost) or before. The same calls are sent again: queue 2, which got a message while adopted,
    gets its request. Once a bug: the error went up, the first send had already made the new
    token queue 2's pending one, nobody sent that request, and queue 2 waited out
    ``pending_ttl_ms`` and a sweep with its message."""
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    broker = eng.brokers.get("broker-a")
    watch = IdleQueueWatch(ME, SUB, "broker-a", broker.scripts, broker.client, lambda: [(SUB, q) for q in eng.owned_queues(SUB)],
                           10_000, 60_000)
    watch.refresh(SUB, QUEUES[0])
    p.send_orderly(TOPIC, b"x", sharding_key=key_for(2))
    sent: list[list[Any]] = []
    run_many = Scripts.run_many

    def failing_once(self, calls, via=None):
        if calls[0][0] == "finish":
            sent.append([list(c[2]) for c in calls])
            if len(sent) == 1:
                if ran:
                    run_many(self, calls, via)
                raise redis.ConnectionError("the connection dropped (test)")
        return run_many(self, calls, via)

    monkeypatch.setattr(Scripts, "run_many", failing_once)
    (follow,) = watch.release()
    state = keys.sub_state(QUEUES[2].tag, SUB)
    assert len(sent) == 2 and sent[0] == sent[1], "the retry did not send the same calls"
    assert (follow.mq, follow.target) == (QUEUES[2], ME)
    assert r.hget(state, "pending").decode() == follow.token, "queue 2's request was lost"
    for mq in (QUEUES[1], QUEUES[3]):
        assert r.hget(keys.sub_state(mq.tag, SUB), "pending") == b""
    p.close()
    eng.brokers.close()


def test_only_idle_queues_locked_by_the_caller_are_adopted(settings, r) -> None:
    p, eng = owned_idle_queues(settings, r)
    scripts = eng.brokers.get("broker-a").scripts
    scripts.load("adopt")

    def adopt(mq: MessageQueue, client: str = ME, token: str = "w") -> int:
        return int(scripts.adopt(keys=[keys.sub_state(mq.tag, SUB), keys.queue_next(mq.tag)],
                                 args=[client, token, 2000])[0])

    assert adopt(QUEUES[0]) == 1 and adopt(QUEUES[0]) == 1  # idle, mine; again with the same token
    assert adopt(QUEUES[0], token="other") == 0  # adopted by another watch
    assert adopt(QUEUES[1], client="c2") == 0  # locked by c1, not c2
    p.send_orderly(TOPIC, b"x", sharding_key=key_for(1))  # wakes c1: queue 1 has a request pending
    assert adopt(QUEUES[1]) == 0
    r.hset(keys.sub_state(QUEUES[2].tag, SUB), mapping={"pending": "", "offset": 0})
    r.set(keys.queue_next(QUEUES[2].tag), 5)  # a backlog and no request: not idle, not adopted
    assert adopt(QUEUES[2]) == 0
    r.hset(keys.sub_state(QUEUES[3].tag, SUB), "run", 2**62)  # running
    assert adopt(QUEUES[3]) == 0
    p.close()
    eng.brokers.close()


def test_a_nudge_ends_a_lingering_read_at_once_not_at_its_slice_end(settings, r, monkeypatch) -> None:
    """The worker's main process nudges (``LingerNudge``) while a request waits for a slot: a
    lingering read blocked for a long slice returns right away and gives the slot back."""
    from mqorder.consumer import linger
    from mqorder.consumer.nudge import LingerNudge

    # A long slice (below the broker connection's 3 s socket timeout, which would end it too).
    monkeypatch.setattr(linger, "LINGER_SLICE_S", 2.5)
    settings = settings.model_copy(update={"consume_linger_ms": 20_000, "run_lease_ms": 60_000, "lock_max_live_time_ms": 60_000})
    p, eng = owned_idle_queues(settings, r)
    spec = ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)
    with lingering_run(eng, spec, r) as run:
        time.sleep(0.5)  # lingering now, in a read that blocks until about 2.5 s
        assert run.thread.is_alive()
        run.linger.clear()  # a request waits for a slot...
        t0 = time.monotonic()
        nudge = LingerNudge(eng.brokers, ME)
        nudge()  # ...and the main process says so
        run.thread.join(1.2)
        assert not run.thread.is_alive(), "the lingering read did not end on the nudge"
        assert time.monotonic() - t0 < 1.2
    p.close()
    eng.brokers.close()


def test_a_switch_to_a_queue_of_another_topic_of_the_group_runs_that_topics_listener(settings, r) -> None:
    """A group consuming two topics: the run lingering on a ``tw`` queue adopts the idle queue of
    ``tw2`` too; a message sent there is handled by ``tw2``'s listener, never by ``tw``'s (once a
    bug: the switched-to queue ran with the lingering run's listener)."""
    from mqorder.consumer.listener import orderly_listener, unregister_listener

    p, eng = owned_idle_queues(settings, r)
    p.create_topic("tw2", queues=1)
    other = MessageQueue("tw2", "broker-a", 0)
    r.hset(keys.assignment(SUB), other.key, ME)
    RebalanceLockManager(eng.brokers).assign(SUB, [(other, ME, "tokx")])
    by: list[tuple[str, str]] = []

    def tw_listener(msgs, ctx):
        by.extend(("tw", m.topic) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    def tw2_listener(msgs, ctx):
        by.extend(("tw2", m.topic) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    orderly_listener(topic="tw2", group=SUB)(tw2_listener)
    try:
        with lingering_run(eng, ListenerSpec(tw_listener, TOPIC, SUB), r):
            time.sleep(0.5)
            p.send_orderly("tw2", b"x", sharding_key="k")
            deadline = time.monotonic() + 10
            while not by and time.monotonic() < deadline:
                time.sleep(0.02)
        assert by == [("tw2", "tw2")]
    finally:
        unregister_listener(SUB, "tw2")


def test_the_queue_a_switch_left_stays_watched_so_a_send_to_it_at_once_wakes_nobody(settings, r) -> None:
    """A run that switches to another adopted queue hands its own queue to the watch in the same
    step that ends the run (``finish.lua`` 'adopt'): a send to it while the next queue runs,
    before any new read, wakes nobody and is handled by the same lingering request, in order."""
    p, eng = owned_idle_queues(settings, r)
    seen: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        for m in msgs:
            seen.append((m.queue_id, int(m.body)))
            if m.queue_id == 1 and int(m.body) < 5:
                # Queue 0 was left by the switch that brought this run here, moments ago.
                p.send_orderly(TOPIC, str(int(m.body) + 100).encode(), sharding_key=key_for(0))
        return ConsumeOrderlyStatus.SUCCESS

    with wakes_of_the_client(r) as wakes, lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        time.sleep(0.5)  # the run drained queue 0 and lingers, watching queues 1-3
        for seq in range(5):
            p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(1))
            deadline = time.monotonic() + 5
            while (0, seq + 100) not in seen and time.monotonic() < deadline:
                time.sleep(0.01)
        assert seen == [x for seq in range(5) for x in ((1, seq), (0, seq + 100))]
        assert wakes.get_message(timeout=0.2) is None, "a send to the queue just left woke the client"
    (out,) = run.result
    assert out.consumed == 10 and out.follow_ups == ()
    assert_every_run_ended_and_committed(r)
    p.close()
    eng.brokers.close()


def test_finish_adopt_hands_the_queue_to_the_watch_only_while_the_caller_holds_it(settings, r) -> None:
    """``finish.lua`` 'adopt': the pending slot passes to the watch's token (backlog or not) while
    the caller holds the live lock of a queue still its own; otherwise the run ends as 'done'."""
    p, eng = owned_idle_queues(settings, r)
    scripts = eng.brokers.get("broker-a").scripts
    scripts.load("finish")

    def finish(mq: MessageQueue, token: str) -> list:
        st = keys.sub_state(mq.tag, SUB)
        r.hset(st, mapping={"pending": token, "pend_until": 2**62, "run": 2**62})
        res = scripts.finish(keys=[st, keys.queue_next(mq.tag)],
                             args=[ME, token, "adopt", "new", 10_000, 60_000, "watch", 2000])
        return [x.decode() if isinstance(x, bytes) else x for x in res]

    def state(mq: MessageQueue) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(mq.tag, SUB)).items()}

    assert finish(QUEUES[0], "a") == ["ADOPTED", 0, 0]  # offset 0, next 0
    assert state(QUEUES[0])["pending"] == "watch" and state(QUEUES[0])["run"] == "0"
    p.send_orderly(TOPIC, b"x", sharding_key=key_for(1))  # c1 is woken: a request "b" would run
    # A backlog too: the reply's next offset says so (no doorbell rang), the watch runs it at once.
    assert finish(QUEUES[1], "b") == ["ADOPTED", 0, 1]
    assert state(QUEUES[1])["pending"] == "watch"
    r.hset(keys.sub_state(QUEUES[2].tag, SUB), "assignee", "c2")  # reassigned meanwhile
    assert finish(QUEUES[2], "c") == ["IDLE"]
    assert state(QUEUES[2])["pending"] == "" and state(QUEUES[2])["owner"] == "c2"
    r.hset(keys.sub_state(QUEUES[3].tag, SUB), "lease", 0)  # the lock lapsed
    assert finish(QUEUES[3], "d") == ["IDLE"]
    assert state(QUEUES[3])["pending"] == ""
    p.close()
    eng.brokers.close()


def test_a_request_that_has_not_lingered_begins_only_when_allowed_and_a_lingering_one_goes_on(settings, r) -> None:
    """``may_start_linger`` (no pool slot would stay free) keeps a fresh request from lingering;
    a request already lingering, along its chain of switches, asks only ``may_linger``."""
    p, eng = owned_idle_queues(settings, r)
    seen: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        seen.extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    start = threading.Event()
    eng.may_linger = lambda: True
    eng.may_start_linger = start.is_set
    spec = ListenerSpec(listener, TOPIC, SUB)
    r.hset(keys.sub_state(QUEUES[0].tag, SUB), mapping={"pending": "t0", "pend_until": 2**62})
    p.send_orderly(TOPIC, b"0", sharding_key=key_for(0))
    t0 = time.monotonic()
    out = eng.run(spec, SUB, QUEUES[0], "t0")  # may not begin: drains and ends at once
    assert out.verb == "IDLE" and out.consumed == 1 and time.monotonic() - t0 < 0.5
    start.set()
    with lingering_run(eng, spec, r, token="t1") as run:
        time.sleep(0.5)  # lingering now
        start.clear()  # every slot busy: nobody may begin to linger, this one goes on
        for seq in range(1, 7):
            p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(1 + seq % 3))
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while len(seen) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == sorted([(0, 0)] + [(1 + s % 3, s) for s in range(1, 7)])
        assert run.thread.is_alive(), "the lingering request stopped although nobody waits for its slot"
    (out,) = run.result
    assert out.consumed == 6
    p.close()
    eng.brokers.close()


def test_a_queue_a_run_leaves_idle_is_watched_by_the_lingering_request_at_once(settings, r, monkeypatch) -> None:
    """A run that ends without lingering (another request of its worker lingers already) says so in
    the client's nudge stream (``nudge.idle_entry``); the lingering request adopts that queue at its
    next read, not at its next full refresh, so the next send there wakes nobody."""
    from mqorder.consumer import idle_watch

    monkeypatch.setattr(idle_watch, "ADOPT_REFRESH_S", 60.0)  # only the nudge can adopt it in time
    p, eng = owned_idle_queues(settings, r)
    seen: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        seen.extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    spec = ListenerSpec(listener, TOPIC, SUB)
    q3 = keys.sub_state(QUEUES[3].tag, SUB)
    r.hset(q3, mapping={"pending": "t3", "pend_until": 2**62})  # a request is on its way to queue 3
    other = ConsumerEngine(settings, ME)  # the worker's other pool process
    other.may_linger = lambda: True
    other.may_start_linger = lambda: False  # a slot stays free only if it does not linger
    try:
        with wakes_of_the_client(r) as wakes, lingering_run(eng, spec, r):
            time.sleep(0.5)  # lingering, watching queues 1 and 2 (3 had a request pending)
            p.send_orderly(TOPIC, b"1", sharding_key=key_for(3))
            assert wakes.get_message(timeout=0.2) is None  # pending already: nobody woken
            out = other.run(spec, SUB, QUEUES[3], "t3")
            assert out.verb == "IDLE" and out.consumed == 1
            deadline = time.monotonic() + 2
            while r.hget(q3, "pending") in (b"", None) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert r.hget(q3, "pending") not in (b"", None), "the lingering request did not adopt queue 3"
            p.send_orderly(TOPIC, b"2", sharding_key=key_for(3))
            deadline = time.monotonic() + 5
            while (3, 2) not in seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == [(3, 1), (3, 2)]
            assert wakes.get_message(timeout=0.2) is None, "the send to queue 3 woke the client"
    finally:
        other.brokers.close()
    p.close()
    eng.brokers.close()


def test_a_run_that_switched_and_must_be_dispatched_again_names_the_queue_it_ended_on(settings, r) -> None:
    """A request that found nothing on its own queue lingers and switches to an adopted queue, whose
    listener suspends: the outcome asks for a new request, and it must say for which queue (the
    caller sends it there). Once a bug: with no follow-ups and nothing consumed before the switch,
    the outcome came back without its queue, so the caller sent the suspended queue's token to the
    task's own queue, where it was stale, and the suspended queue waited out pending_ttl_ms (10 s)
    and a sweep instead of the suspend's 1 s."""
    settings = settings.model_copy(update={"consume_linger_ms": 10_000})  # lingers all along
    p, eng = owned_idle_queues(settings, r)

    def listener(msgs, ctx):
        return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT

    with lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        # The run found queue 0 empty and lingers, watching queues 1-3 once it adopted them.
        wait_adopted(r, QUEUES[1])
        p.send_orderly(TOPIC, b"x", sharding_key=key_for(1))
        run.thread.join(timeout=10)
        assert not run.thread.is_alive(), "the run did not end after the suspend"
    (out,) = run.result
    assert out is not None and out.needs_dispatch and out.consumed == 0
    assert out.queue == QUEUES[1], f"the request for queue 1 would go to {out.queue or QUEUES[0]}"
    state = {k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(QUEUES[1].tag, SUB)).items()}
    assert state["pending"] == out.token  # the token the caller sends is queue 1's
    p.close()
    eng.brokers.close()


def test_a_switched_run_retried_after_a_redis_error_still_sends_the_request_the_queue_left_needs(
    settings, r, monkeypatch,
) -> None:
    """A switch the usual way (no ``switch.lua``): the run on queue 1 ends the run it left on queue
    0 in its first round trip, and queue 0, reassigned to c2 meanwhile with a backlog, is handed
    over (``finish.lua``: HANDOVER), a request the chain must send at once. Then the connection of
    the run on queue 1 is killed (its listener declines the message it was handed then) and
    ``ConsumerEngine._run_one`` retries it. The retry must not end queue 0's run again, and the
    chain's outcome must still carry queue 0's request. Once a bug: the retry sent the same
    ``finish.lua`` again (STALE) and lost the follow-up, so queue 0 waited out ``pending_ttl_ms``
    (10 s) and a sweep."""
    from mqorder.consumer.linger import LingeringReads
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    left, to = QUEUES[0], QUEUES[1]
    k_left = keys.sub_state(left.tag, SUB)
    # No switch.lua behind the lingering reads: the run switches the usual way (finish + begin).
    monkeypatch.setattr(LingeringReads, "_offer_switch", lambda self, pipe, plan: setattr(self, "_offered", []))
    switches_sent: list[list[str]] = []
    lease_ids: list[int] = []
    run_many = Scripts.run_many

    def reassigning_run_many(self, calls, via=None):
        names = [c[0] for c in calls]
        if names == ["finish", "begin"]:
            switches_sent.append(names)
            if len(switches_sent) == 1:
                # Right before the switch ends the run on queue 0: a rebalance gives queue 0 to c2
                # (its run still holds it: BUSY, handed over when it ends), and it gets a message.
                r.hset(keys.assignment(SUB), left.key, "c2")
                assert RebalanceLockManager(eng.brokers).assign(SUB, [(left, "c2", "tok-c2")]) == {left: "BUSY"}
                p.send_orderly(TOPIC, b"left", sharding_key=key_for(0))
                assert via is not None
                lease_ids.append(via.round_trip([("CLIENT", "ID")])[0])
        return run_many(self, calls, via)

    monkeypatch.setattr(Scripts, "run_many", reassigning_run_many)
    delivered: list[tuple[int, int]] = []
    handled: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        delivered.extend((m.queue_id, int(m.body)) for m in msgs)
        if len(delivered) == 1:
            # Redis drops the run's connection while the listener runs; the listener declines
            # the message (a suspend), so it is handled once, by the retry.
            assert lease_ids and r.client_kill_filter(_id=lease_ids[0]) == 1
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        handled.extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    with lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        wait_adopted(r, QUEUES[1])
        p.send_orderly(TOPIC, b"0", sharding_key=key_for(1))
        wait_until(lambda: handled)
    (out,) = run.result
    assert delivered == [(1, 0), (1, 0)] and handled == [(1, 0)]  # never queue 0's message: c2's now
    state = {k.decode(): v.decode() for k, v in r.hgetall(k_left).items()}
    assert state["owner"] == "c2" and state["pending"] not in ("", "t0")
    assert out is not None and out.queue == to and out.consumed == 1
    assert out.follow_ups == (FollowUp(left, "c2", state["pending"], sub=SUB),), "queue 0's handover was lost in the retry"
    assert switches_sent == [["finish", "begin"]], "the retry ended the run on queue 0 again"
    p.close()
    eng.brokers.close()


def test_a_lost_reply_of_the_switchs_finish_still_sends_the_request_the_queue_left_needs(
    settings, r, monkeypatch,
) -> None:
    """As above, but the reply of the switch's round trip itself (``finish.lua`` of the run left,
    ``begin.lua`` of the next) is lost after both ran. The retry sends the same finish again
    (the run's one new token) and must learn the handover it decided on. Once a bug: each send
    of the prior's finish drew a new token, the second was STALE, and queue 0's request was
    lost (it waited out ``pending_ttl_ms`` and a sweep)."""
    from mqorder.consumer.linger import LingeringReads
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    left, to = QUEUES[0], QUEUES[1]
    k_left = keys.sub_state(left.tag, SUB)
    monkeypatch.setattr(LingeringReads, "_offer_switch", lambda self, pipe, plan: setattr(self, "_offered", []))
    switches_sent: list[list[Any]] = []
    run_many = Scripts.run_many

    def losing_run_many(self, calls, via=None):
        names = [c[0] for c in calls]
        if names != ["finish", "begin"]:
            return run_many(self, calls, via)
        switches_sent.append(list(calls[0][2]))
        if len(switches_sent) > 1:
            return run_many(self, calls, via)
        r.hset(keys.assignment(SUB), left.key, "c2")
        assert RebalanceLockManager(eng.brokers).assign(SUB, [(left, "c2", "tok-c2")]) == {left: "BUSY"}
        p.send_orderly(TOPIC, b"left", sharding_key=key_for(0))
        run_many(self, calls, via)  # both ran; the reply is lost on its way back
        assert via is not None
        via.release()
        raise redis.ConnectionError("the reply was lost on its way back (test)")

    monkeypatch.setattr(Scripts, "run_many", losing_run_many)
    handled: list[tuple[int, int]] = []
    spec = ListenerSpec(lambda msgs, ctx: handled.extend((m.queue_id, int(m.body)) for m in msgs)
                        or ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)
    with lingering_run(eng, spec, r) as run:
        wait_adopted(r, QUEUES[1])
        p.send_orderly(TOPIC, b"0", sharding_key=key_for(1))
        wait_until(lambda: handled)
    (out,) = run.result
    assert handled == [(1, 0)]
    state = {k.decode(): v.decode() for k, v in r.hgetall(k_left).items()}
    assert len(switches_sent) == 2 and switches_sent[0] == switches_sent[1], "the retry sent another finish"
    assert state["owner"] == "c2" and state["pending"] == switches_sent[0][3]
    assert out is not None and out.queue == to
    assert out.follow_ups == (FollowUp(left, "c2", state["pending"], sub=SUB),), "queue 0's handover was lost in the retry"
    p.close()
    eng.brokers.close()


def test_a_lost_reply_of_a_switch_leaves_no_queue_begun_and_unconsumed(settings, r, monkeypatch) -> None:
    """``switch.lua`` runs behind a lingering read: it hands queue 0 to the watch and begins queue
    1, which got a message. Then the reply is lost (the connection drops on its way back), so the
    run never learns it switched; ``ConsumerEngine._run_one`` retries queue 0's request, which is
    STALE now. The chain's watch, made by the failed attempt, must still end its adoptions: queue
    1's run mark is cleared and a request for it returned. Once a bug: the retry dropped the
    watch, and queue 1 stayed begun, its message unconsumed and out of the sweep's reach, for the
    whole run lease (60 s)."""
    from mqorder.store.raw_pipe import ConnectionLease

    p, eng = owned_idle_queues(settings, r)
    q1 = keys.sub_state(QUEUES[1].tag, SUB)
    scripts = eng.brokers.get(QUEUES[0].broker_name).scripts
    scripts.load("switch")  # known to Redis: the first lingering read that sees m1 offers it
    switch_sha = scripts.switch.sha
    original = ConnectionLease.round_trip
    lost: list[int] = []

    def round_trip(self, commands):
        replies = original(self, commands)
        switched = [rep for c, rep in zip(commands, replies, strict=True) if evalsha_of(c) == switch_sha]
        if not lost and switched and not isinstance(switched[0], Exception) and int(switched[0][0]):
            lost.append(int(switched[0][0]))
            self.release()
            raise redis.ConnectionError("the reply was lost on its way back (test)")
        return replies

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    handled: list[tuple[int, bytes]] = []
    spec = ListenerSpec(lambda msgs, ctx: handled.extend((m.queue_id, m.body) for m in msgs)
                        or ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)

    with lingering_run(eng, spec, r) as run:
        wait_adopted(r, QUEUES[1])
        p.send_orderly(TOPIC, b"m1", sharding_key=key_for(1))
        assert wait_until(lambda: lost), "no switch.lua reply switched: the lost reply was not tried"
        run.thread.join(timeout=10)
        assert not run.thread.is_alive(), "the retried run did not end"
    (out,) = run.result
    assert out is not None and out.verb == "STALE"  # queue 0 is the watch's now
    state = {k.decode(): v.decode() for k, v in r.hgetall(q1).items()}
    assert state["run"] == "0", f"queue 1 is still begun (run mark {state['run']})"
    assert [(f.mq, f.token) for f in out.follow_ups] == [(QUEUES[1], state["pending"])], out.follow_ups
    assert handled == []  # queue 1's message waits for the request returned, nothing was lost
    p.close()
    eng.brokers.close()


@pytest.mark.parametrize("pause_s", [0.0, 0.25], ids=["at-once", "after-a-refresh"])
def test_a_switch_behind_a_commit_that_got_noscript_is_taken_not_dropped(settings, r, monkeypatch, pause_s) -> None:
    """After a ``SCRIPT FLUSH`` (a restart, a failover) another client loads ``switch.lua`` again
    while this run's ``commit.lua`` is still unknown. The run's commit (on an empty queue it moves
    no offset) gets ``NOSCRIPT``, yet the ``switch.lua`` behind its lingering read runs and
    switches: queue 0 handed to the watch, queue 1 (which got ``m1``) begun. Once a bug: that reply
    was dropped with the refused commit's, the pipeline sent again; queue 0 stayed with a token the
    watch did not know (a send to it woke nobody until the adoption lapsed), and when the resend
    came after the watch's refresh interval (``after-a-refresh``) queue 1 was dropped from the watch
    with its 60 s run mark set: its message out of even the sweep's reach. The switch's reply is
    taken now: both queues are released by the watch, queue 1 with a request for ``m1``."""
    from mqorder.store.raw_pipe import ConnectionLease
    from mqorder.store.scripts import source

    p, eng = owned_idle_queues(settings, r)
    scripts = eng.brokers.get(QUEUES[0].broker_name).scripts
    for name in ("commit", "switch"):
        scripts.load(name)
    commit_sha, switch_sha = scripts.commit.sha, scripts.switch.sha
    original = ConnectionLease.round_trip
    first: list[Any] = []

    def round_trip(self, commands):
        shas = [evalsha_of(c) for c in commands]
        if first or commit_sha not in shas or switch_sha not in shas:
            return original(self, commands)
        r.script_flush()
        r.script_load(source("switch"))  # another client of this Redis needed it first
        p.send_orderly(TOPIC, b"m1", sharding_key=key_for(1))  # the read returns with it
        replies = original(self, commands)
        first.append([rep for c, rep in zip(commands, replies, strict=True) if evalsha_of(c)])
        time.sleep(pause_s)
        return replies

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    handled: list[bytes] = []
    spec = ListenerSpec(lambda msgs, ctx: handled.extend(m.body for m in msgs) or ConsumeOrderlyStatus.SUCCESS,
                        TOPIC, SUB)
    eng.may_linger = lambda: True
    r.hset(keys.sub_state(QUEUES[0].tag, SUB), mapping={"pending": "t0", "pend_until": 2**62})
    out = eng.run(spec, SUB, QUEUES[0], "t0")
    (replies,) = first
    assert isinstance(replies[0], redis.exceptions.NoScriptError) and int(replies[-1][0]) >= 1  # it switched
    q0, q1 = ({k.decode(): v.decode() for k, v in r.hgetall(keys.sub_state(mq.tag, SUB)).items()}
              for mq in QUEUES[:2])
    assert q0["pending"] == "", f"queue 0 still holds a token nobody knows: {q0['pending']}"
    assert q1["run"] == "0", f"queue 1 is still begun (run mark {q1['run']})"
    assert [(f.mq, f.token) for f in out.follow_ups] == [(QUEUES[1], q1["pending"])], out.follow_ups
    assert handled == []  # m1 waits for the request returned
    p.close()
    eng.brokers.close()


def test_a_long_chain_of_switches_keeps_no_finished_run_alive(settings, r) -> None:
    """Each run of a chain ends in the next one's first round trip; once ended it must be let go,
    or a lingering request that switched queues for hours would hold every run it made (and
    their ProcessQueues), and the collector's full passes would grow with them."""
    import gc

    p, eng = owned_idle_queues(settings, r)
    seen: list[int] = []
    spec = ListenerSpec(lambda msgs, ctx: seen.extend(int(m.body) for m in msgs) or ConsumeOrderlyStatus.SUCCESS,
                        TOPIC, SUB)
    with lingering_run(eng, spec, r):
        time.sleep(0.3)
        for seq in range(60):  # every message on another queue than the last: 60 switches
            p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(1 + seq % 3))
            deadline = time.monotonic() + 5
            while len(seen) <= seq and time.monotonic() < deadline:
                time.sleep(0.002)
        assert seen == list(range(60))
        gc.collect()
        # This chain's runs only: other tests of the session may leave runs of their own engines.
        alive = sum(1 for o in gc.get_objects() if isinstance(o, ConsumeRequest) and o.engine is eng)
        assert alive <= 3, f"{alive} runs of the chain are still alive"
    p.close()
    eng.brokers.close()


def test_a_switch_to_an_adopted_queue_rides_on_the_lingering_read_that_sees_its_message(
    settings, r, monkeypatch,
) -> None:
    """``switch.lua`` goes behind every lingering read that watches adopted queues of the run's
    listener: when the read returns for a message on one of them, Redis has already ended the run
    (its queue handed to the watch) and begun that queue's, so the switch sends no ``finish.lua`` +
    ``begin.lua`` round trip of its own. Messages to ever another queue are still handled in
    order, each once, and every run ends committed."""
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    switches_sent: list[list[str]] = []
    run_many = Scripts.run_many

    def counting_run_many(self, calls, via=None):
        switches_sent.append([c[0] for c in calls])
        return run_many(self, calls, via)

    monkeypatch.setattr(Scripts, "run_many", counting_run_many)
    pre_switched = []
    check = ConsumeRequest._check

    def noting_check(self):
        pre_switched.append(self.prior is not None and self.prior.pre_switched is not None)
        return check(self)

    monkeypatch.setattr(ConsumeRequest, "_check", noting_check)
    seen: list[tuple[int, int]] = []

    def listener(msgs, ctx):
        seen.extend((m.queue_id, int(m.body)) for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    sent: list[tuple[int, int]] = []
    with wakes_of_the_client(r) as wakes, lingering_run(eng, ListenerSpec(listener, TOPIC, SUB), r) as run:
        time.sleep(0.5)  # the run drained queue 0 and lingers, watching queues 1-3
        for seq in range(24):
            qid = 1 + seq % 3  # never the queue the run is on (0, then the last one): each a switch
            p.send_orderly(TOPIC, str(seq).encode(), sharding_key=key_for(qid))
            sent.append((qid, seq))
            deadline = time.monotonic() + 5
            while len(seen) < len(sent) and time.monotonic() < deadline:
                time.sleep(0.005)
        assert seen == sent
        assert wakes.get_message(timeout=0.2) is None, "a send woke the client: the queue was not watched"
    (out,) = run.result
    assert out.consumed == 24 and out.follow_ups == ()
    assert [c for c in switches_sent if c == ["finish", "begin"]] == [], "a switch took a round trip of its own"
    assert pre_switched == [False] + [True] * 24, "not every switch was switch.lua's"
    assert_every_run_ended_and_committed(r)
    p.close()
    eng.brokers.close()


def test_switch_lua_switches_only_while_the_run_holds_its_queue_read_to_its_end(settings, r) -> None:
    """``switch.lua`` against a real redis-server: with the run's own queue not read to its end, at
    another epoch, or under another pending token, it changes nothing and answers 0; otherwise it
    ends the run (``ADOPTED``: the queue goes to the watch) and begins the adopted queue with a
    backlog (``OK`` with its first batch, run mark and lock renewed), as the two scripts would."""
    from mqorder.consumer.idle_watch import ADOPT_TTL_MS
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    scripts = Scripts(r)
    own, adopted = QUEUES[0], QUEUES[2]
    k_own = keys.sub_state(own.tag, SUB)
    epoch = int(r.hget(k_own, "epoch"))
    r.hset(k_own, mapping={"pending": "run-tok", "pend_until": 2**62})
    r.hset(keys.sub_state(adopted.tag, SUB), mapping={"pending": "watch-tok", "pend_until": 2**62})
    p.send_orderly(TOPIC, b"m", sharding_key=key_for(2))
    ks = [k_own, keys.queue_next(own.tag), keys.sub_state(QUEUES[1].tag, SUB), keys.queue_log(QUEUES[1].tag),
          keys.queue_next(QUEUES[1].tag), keys.sub_retries(QUEUES[1].tag, SUB),
          keys.sub_state(adopted.tag, SUB), keys.queue_log(adopted.tag), keys.queue_next(adopted.tag),
          keys.sub_retries(adopted.tag, SUB)]

    def switch(run_epoch: int, token: str, pulled_to: int, committed: int = 0, seen: tuple = (0, 0)) -> list:
        return scripts.switch(keys=ks, args=[run_epoch, pulled_to, committed,
                                             *switch_args(token, "watch-tok", ADOPT_TTL_MS), *seen])

    k_to = keys.sub_state(adopted.tag, SUB)
    before = {k: r.hgetall(k) for k in ks if k.endswith(f":s:{SUB}")}
    assert switch(epoch + 1, "run-tok", 0) == [0]  # fenced: another epoch
    assert switch(epoch, "other-tok", 0) == [0]  # not the run's pending token
    assert switch(epoch, "run-tok", 1) == [0]  # its queue ends below what it pulled (a failover)
    assert switch(epoch, "run-tok", 0, committed=1) == [0]  # the commit before the read did not land
    # The adopted queue with the backlog is not this watch's, or not free: never begun.
    r.hset(k_to, "pending", "someone-else")
    assert switch(epoch, "run-tok", 0) == [0]
    r.hset(k_to, mapping={"pending": "watch-tok", "run": 2**62})
    assert switch(epoch, "run-tok", 0) == [0]  # a live run mark
    r.hset(k_to, mapping={"run": 0, "lease": 1})
    assert switch(epoch, "run-tok", 0) == [0]  # the caller's lock lapsed
    r.hset(k_to, mapping=before[k_to])
    # No backlog where the watch saw the queue at its end (the MGET of the next counters says so),
    # nor where it was committed since (what the watch saw is only a lower bound).
    assert switch(epoch, "run-tok", 0, seen=(0, 1)) == [0]
    r.hset(k_to, "offset", 1)
    assert switch(epoch, "run-tok", 0) == [0]
    r.hset(k_to, mapping=before[k_to])
    if b"offset" not in before[k_to]:
        r.hdel(k_to, "offset")
    p.send_orderly(TOPIC, b"own", sharding_key=key_for(0))
    assert switch(epoch, "run-tok", 0) == [0]  # its own queue has something new
    assert {k: r.hgetall(k) for k in before} == before  # none of them wrote anything
    assert r.hget(k_own, "pending") == b"run-tok" and r.hget(keys.sub_state(adopted.tag, SUB), "run") in (None, b"0")
    # More candidates than one MGET reads (their counters in chunks of 500): the one with a backlog
    # is found behind 600 without any, its committed offset as the watch saw it passed in order.
    idle = [MessageQueue(TOPIC, "broker-a", 1000 + i) for i in range(600)]
    wide = ks[:2] + [k for mq in idle for k in (keys.sub_state(mq.tag, SUB), keys.queue_log(mq.tag),
                                                 keys.queue_next(mq.tag), keys.sub_retries(mq.tag, SUB))] + ks[2:]
    far = scripts.switch(keys=wide, args=[epoch, 1, 0, *switch_args("run-tok", "watch-tok", ADOPT_TTL_MS),
                                          *[0] * 600, 0, 0])
    assert far[0] == 602 and far[1][0] == b"ADOPTED"  # 600 idle ones, the first queue, then this one
    r.hset(k_own, mapping={"pending": "run-tok", "run": before[k_own].get(b"run", b"0"), "offset": 0})
    r.hset(k_to, mapping=before[k_to])
    for k in (b"run", b"runner", b"offset"):
        if k not in before[k_to]:
            r.hdel(k_to, k)
    res = switch(epoch, "run-tok", 1)
    assert res[0] == 2  # the second candidate: the first one has no backlog
    assert res[1][0] == b"ADOPTED"
    assert res[2][0] == b"OK" and len(res[2][4]) == 1  # begin.lua's reply: its first batch
    own_state = r.hgetall(k_own)
    assert own_state[b"pending"] == b"watch-tok" and own_state[b"run"] == b"0"
    st = r.hgetall(keys.sub_state(adopted.tag, SUB))
    assert st[b"pending"] == b"watch-tok" and int(st[b"run"]) > 0 and st[b"runner"] == b"runner-1"
    assert int(st[b"lease"]) > int(before[k_to][b"lease"])  # the lock renewed by begin.lua
    p.close()
    eng.brokers.close()


def test_a_run_begun_by_switch_lua_that_is_retried_reads_its_queue_again(settings, r) -> None:
    """The replies of a switch done behind a lingering read are taken once: a retry of the run
    switched to that still names the same prior (``ConsumerEngine._run_one`` after a Redis error
    passes it again unless the failed attempt had ended it) sends ``finish.lua`` and ``begin.lua``
    again and starts from the queue's committed offset as it is then, not from the offset of the
    switch (once a bug: after a Sentinel failover such a retry handled again what its run had
    committed)."""
    from mqorder.consumer.idle_watch import ADOPT_TTL_MS
    from mqorder.consumer.run_types import LoopEnd, Stop
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    spec = ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)
    own, to = QUEUES[0], QUEUES[1]
    watch = eng.idle_watch(SUB, own)
    assert watch is not None
    k_own, k_to = keys.sub_state(own.tag, SUB), keys.sub_state(to.tag, SUB)
    epoch = int(r.hget(k_own, "epoch"))
    r.hset(k_own, mapping={"pending": "run-tok", "pend_until": 2**62})
    r.hset(k_to, mapping={"pending": watch.token, "pend_until": 2**62})
    for i in range(3):
        p.send_orderly(TOPIC, str(i).encode(), sharding_key=key_for(1))
    switched = Scripts(r).switch(
        keys=[k_own, keys.queue_next(own.tag), k_to, keys.queue_log(to.tag), keys.queue_next(to.tag),
              keys.sub_retries(to.tag, SUB)],
        args=[epoch, 0, 0, *switch_args("run-tok", watch.token, ADOPT_TTL_MS)])
    assert switched[0] == 1
    prior = ConsumeRequest(eng, spec, SUB, own, "run-tok", runner="runner-1", watch=watch)
    prior.deferred_end = LoopEnd(Stop.SWITCH)
    prior.pre_switched = (switched[1], switched[2])

    first = ConsumeRequest(eng, spec, SUB, to, watch.token, runner="runner-1", watch=watch, prior=prior)
    assert first._check() is None and first.committed == 0 and first.pulled_to == 3
    r.hset(k_to, "offset", 2)  # what the first try committed before Redis failed
    retry = ConsumeRequest(eng, spec, SUB, to, watch.token, runner="runner-1", watch=watch, prior=prior)
    assert retry._check() is None
    assert retry.committed == 2, "the retry took the switch's stale begin.lua reply"
    p.close()
    eng.brokers.close()


def test_a_switch_behind_a_refused_commit_leaves_both_queues_to_the_watch_release(settings, r) -> None:
    """If the commit sent before a lingering read is refused while the read's ``switch.lua`` still
    switched (``_switch_refused``), the run does not go on to the queue begun, and neither queue is
    left holding the watch's token to lapse: ``release`` ends both, the one with a backlog gets a
    request, the other goes idle."""
    from mqorder.consumer.idle_watch import ADOPT_TTL_MS
    from mqorder.consumer.run_types import Slice
    from mqorder.store.scripts import Scripts

    p, eng = owned_idle_queues(settings, r)
    spec = ListenerSpec(lambda msgs, ctx: ConsumeOrderlyStatus.SUCCESS, TOPIC, SUB)
    own, to = QUEUES[0], QUEUES[1]
    watch = eng.idle_watch(SUB, own)
    assert watch is not None
    watch.adopted[(SUB, keys.queue_log(to.tag))] = (to, 0)  # as adopt.lua left it
    k_own, k_to = keys.sub_state(own.tag, SUB), keys.sub_state(to.tag, SUB)
    r.hset(k_own, mapping={"pending": "run-tok", "pend_until": 2**62})
    r.hset(k_to, mapping={"pending": watch.token, "pend_until": 2**62})
    p.send_orderly(TOPIC, b"x", sharding_key=key_for(1))
    switched = Scripts(r).switch(
        keys=[k_own, keys.queue_next(own.tag), k_to, keys.queue_log(to.tag), keys.queue_next(to.tag),
              keys.sub_retries(to.tag, SUB)],
        args=[int(r.hget(k_own, "epoch")), 0, 0, *switch_args("run-tok", watch.token, ADOPT_TTL_MS)])
    assert switched[0] == 1 and r.hget(k_own, "pending") == watch.token.encode()
    req = ConsumeRequest(eng, spec, SUB, own, "run-tok", runner="runner-1", watch=watch)
    req._offered = [to]
    req._switch_refused(Slice(None, [], switched))
    follow_ups = watch.release()
    assert [(f.mq, f.target) for f in follow_ups] == [(to, ME)]  # its message needs a request
    assert r.hget(k_own, "pending") == b"" and r.hget(k_to, "run") == b"0"
    p.close()
    eng.brokers.close()


def test_a_reassignment_during_the_read_behind_a_commit_skips_nothing(settings, r: redis.Redis) -> None:
    """A rebalance's assign.lua landing between commit.lua and the lingering read's state check
    (a pipeline Redis reads in more than one piece): the read's entries were never looked at, the
    run took them for a tail retention had trimmed and committed past them (offset 5, skipped 3:
    messages 2..4 never delivered). Found by a review; the interleaving is forced by a real HSET
    of the assignee in the same pipeline, right behind the commit."""
    settings = settings.model_copy(update={"consume_linger_ms": 1000, "pull_batch_size": 2,
                                           "consume_linger_idle_queues": False})
    p = Producer(settings=settings)
    p.create_topic("t", queues=1)
    mq = MessageQueue("t", "broker-a", 0)
    eng = ConsumerEngine(settings, "c1")
    eng.may_linger = lambda: True
    r.hset(keys.assignment("g"), mapping={mq.key: "c1"})
    RebalanceLockManager(eng.brokers).assign("g", [(mq, "c1", "tok")])
    for i in range(5):
        p.send_orderly("t", f"m{i}".encode(), sharding_key="k")
    seen: list[int] = []

    def listener(msgs, ctx):
        seen.extend(m.queue_offset for m in msgs)
        return ConsumeOrderlyStatus.SUCCESS

    spec = ListenerSpec(listener, "t", "g")
    k_state = keys.sub_state(mq.tag, "g")
    r.hset(k_state, "pending", "tok")

    for name in ("commit", "begin", "finish", "touch"):
        eng.brokers.get("broker-a").scripts.load(name)  # no NOSCRIPT retry of the pipeline
    req = ConsumeRequest(eng, spec, "g", mq, "tok")
    orig = req._queue_slice

    def racing_slice(pipe, until, checked=False):
        # A rebalance's assign.lua interleaving right after commit.lua in the same pipeline.
        pipe.execute_command("HSET", k_state, "assignee", "c2")
        return orig(pipe, until, checked=checked)

    req._queue_slice = racing_slice
    orig_replies = req._slice_replies
    req._slice_replies = lambda replies: orig_replies(replies[1:])  # drop the injected HSET's reply
    try:
        req.run()
    finally:
        p.close()
        eng.brokers.close()
    st = {k.decode(): v.decode() for k, v in r.hgetall(k_state).items()}
    assert seen == [0, 1]
    # Only offsets 0 and 1 were handled: the committed offset must not pass 2.
    assert int(st["offset"]) == 2, f"committed {st['offset']} with skipped={st.get('skipped')}"
    assert "skipped" not in st or st["skipped"] == "0"


def test_the_read_plan_kept_across_switches_is_the_one_made_afresh() -> None:
    """``IdleQueueWatch.switched`` turns the plan of the run left into the plan of the run switched
    to (no pass over the adopted queues per trickling message): after every switch of a random
    walk over two groups and two topics, some switches without a hand-over, the kept plan must be
    the plan made from the adopted queues as they are (same queues, keys and offsets, same order)."""
    import random

    import hiredis

    from mqorder.consumer.linger import switch_command

    rng = random.Random(7)
    queues = [("g", MessageQueue("ta", "broker-a", i)) for i in range(6)]
    queues += [("g", MessageQueue("tb", "broker-a", i)) for i in range(3)]
    queues += [("h", MessageQueue("ta", "broker-a", i)) for i in range(4)]
    watch = IdleQueueWatch(ME, "g", "broker-a", None, None, lambda: [], 30_000, 60_000)
    running = queues[0]
    for sub, mq in queues[1:]:
        watch._hand_over(sub, mq, rng.randrange(100))
    kept = 0
    for step in range(600):
        sub, mq = running
        plan = watch.plan(sub, mq)
        adopted = [(s, q) for (s, _k), (q, _o) in watch.adopted.items()]
        # Mostly a queue the plan offers (what switch.lua takes), sometimes any adopted one.
        if plan.offered and rng.random() < 0.8:
            to = (sub, rng.choice(plan.offered))
        else:
            to = rng.choice(adopted)
        adopted_at = None if rng.random() < 0.1 else rng.randrange(1000)
        watch.switched(sub, mq, to[0], to[1], adopted_at, backlog=rng.random() < 0.2)
        kept += watch._plan is not None
        got = watch.plan(*to)
        watch._changed()
        fresh = watch.plan(*to)
        assert (got.offered, got.keys, got.seen) == (fresh.offered, fresh.keys, fresh.seen), step
        # switch.lua's call, packed from the plan's packed pieces, is the call packed whole.
        own, args = ["own-state", "own-next"], [step, 7, "c1", "tok", "adopt", 2000, "é"]
        whole = hiredis.pack_command(("EVALSHA", "f" * 40, 2 + len(got.keys), *own, *got.keys, *args, *got.seen))
        assert switch_command("f" * 40, own, got, args) == switch_command("f" * 40, own, fresh, args) == whole, step
        if adopted_at is None:  # the queue left was not handed over: take it back for the walk
            watch.took_back(sub, mq, rng.randrange(1000))
        running = to
    assert kept > 300  # the kept plan is the common case, not the fallback

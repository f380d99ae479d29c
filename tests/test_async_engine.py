"""``async def`` listeners in the Celery-free engine, against a real redis-server: per-key order in
key mode, one call at a time in queue mode, a failing key that reaches the DLQ while the others
finish, cancellation of calls in flight when the run loses its queue, a listener that blocks the
loop being named, concurrent listeners, async hooks, and a plain listener beside an async one.
Real workers run the same listeners in ``test_async_e2e``."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import defaultdict

import pytest

from mqorder import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, concurrent_listener, keys, orderly_listener
from mqorder.consumer.async_loop import BLOCKED_S, FOREIGN_QUIET_S, ProcessLoop
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook
from mqorder.consumer.listener import ListenerSpec, get_listener, unregister_listener
from mqorder.consumer.offset_map import decode_done
from mqorder.consumer.run_types import Outcome
from mqorder.errors import ListenerError
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.log import MessageLog
from tests.engine_support import MQ, drain

S = ConsumeOrderlyStatus


def send_keys(p, n_keys: int, per_key: int, topic: str = "t") -> dict[str, list[int]]:
    sent: dict[str, list[int]] = defaultdict(list)
    items = [(f"k{k}", f"k{k}:{i}".encode()) for i in range(per_key) for k in range(n_keys)]
    for (key, _), res in zip(items, p.send_orderly_batch(topic, items), strict=True):
        sent[key].append(res.queue_offset)
    return sent


class AsyncRecorder:
    """An ``async def`` listener (an object with an async ``__call__``): awaits ``sleep_s`` and
    records, per key, the offsets it saw, overlaps of one key and the most calls at once. It runs
    on the loop's one thread only, so it needs no lock."""

    def __init__(self, sleep_s: float = 0.005) -> None:
        self.seen: dict[str, list[int]] = defaultdict(list)
        self.running: dict[str, int] = defaultdict(int)
        self.overlaps: list[str] = []
        self.now_running = 0
        self.max_running = 0
        self.sleep_s = sleep_s
        self.threads: set[int] = set()
        self.loops: set[asyncio.AbstractEventLoop] = set()

    async def __call__(self, msgs, ctx):
        key = msgs[0].body.decode().split(":")[0]
        self.threads.add(threading.get_ident())
        self.loops.add(asyncio.get_running_loop())
        self.running[key] += 1
        if self.running[key] > 1:
            self.overlaps.append(key)
        self.now_running += 1
        self.max_running = max(self.max_running, self.now_running)
        try:
            await asyncio.sleep(self.sleep_s)
            self.seen[key].extend(m.queue_offset for m in msgs)
            return await self.status(key, msgs, ctx)
        finally:
            self.running[key] -= 1
            self.now_running -= 1

    async def status(self, key: str, msgs, ctx):
        return S.SUCCESS


def test_async_key_mode_keeps_per_key_order_and_runs_keys_side_by_side_on_the_loop(env) -> None:
    p, eng = env
    sent = send_keys(p, 60, 5)
    rec = AsyncRecorder()
    drain(eng, ListenerSpec(rec, "t", "g", ordering="key", key_concurrency=32))
    assert dict(rec.seen) == dict(sent)
    assert rec.overlaps == []
    assert 1 < rec.max_running <= 32
    assert rec.loops == {ProcessLoop.get().loop}  # every call on the process's loop
    # The only run of the process drives the loop in its own thread (ProcessLoop.claim): no
    # thread crossing per call.
    assert rec.threads == {threading.get_ident()}
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 300


def test_each_async_call_runs_in_a_task_and_context_of_its_own(env) -> None:
    """A ``ContextVar`` a listener sets (a request id, structlog's bound values) is never seen by
    another message's call, of its key or another, and each call is a task of its own (what a
    scoped session keyed by ``asyncio.current_task()`` relies on). A run driving the loop once
    ran the next call in the task of the call that just ended, leaking both."""
    import contextvars

    p, eng = env
    send_keys(p, 40, 5)
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
    leaks: list[str] = []
    tasks: list[asyncio.Task] = []

    async def listener(msgs, ctx):
        if request_id.get():
            leaks.append(request_id.get())
        request_id.set(msgs[0].body.decode())
        tasks.append(asyncio.current_task())
        if msgs[0].queue_offset % 3:
            await asyncio.sleep(0)
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", ordering="key", key_concurrency=8))
    assert len(tasks) == 200 and leaks == []
    assert len({id(t) for t in tasks}) == 200  # kept alive in the list: distinct objects


def test_a_listener_that_never_suspends_still_commits_every_pull(env, monkeypatch) -> None:
    """An ``async def`` listener that returns without awaiting anything (a cache hit, CPU work)
    ends its call within the step that started it. The run still commits once ``pull_n`` finished
    messages are unsaved: what a crash may redeliver stays within ``uncommitted_bound`` (settling
    and starting calls where they end once kept the dispatcher away for the whole buffer)."""
    from mqorder.consumer.key_request import KeyConsumeRequest, uncommitted_bound

    p, eng = env
    sent = send_keys(p, 10, 100)  # few, deep keys: the run pulls its whole buffer while they wait
    unsaved_at_commit: list[int] = []
    persist = KeyConsumeRequest._persist

    def spy(self, *a, **kw):
        unsaved_at_commit.append(self.unsaved)
        return persist(self, *a, **kw)

    monkeypatch.setattr(KeyConsumeRequest, "_persist", spy)
    seen: dict[str, list[int]] = defaultdict(list)

    async def listener(msgs, ctx):
        key, i = msgs[0].body.decode().split(":")
        if i == "0":
            # Each key's first call waits a little: the dispatcher meanwhile pulls the backlog
            # into the run's buffer, and every later call then ends without suspending.
            await asyncio.sleep(0.02)
        seen[key].extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", ordering="key", key_concurrency=16))
    assert dict(seen) == dict(sent)
    pull_n = eng.settings.pull_batch_size
    assert unsaved_at_commit and max(unsaved_at_commit) <= uncommitted_bound(pull_n, 16)
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 1000


def test_a_failure_settling_a_result_where_its_call_ends_ends_the_run_with_it(env, monkeypatch) -> None:
    """A bug while a result is settled in the step that ends its call (the run drives the loop)
    surfaces as the run's error, as when the dispatcher settles it, not as an unseen task error
    with the run waiting for ever on a call it thinks is in flight."""
    from mqorder.consumer.key_request import KeyConsumeRequest

    p, eng = env
    send_keys(p, 20, 5)
    finished = KeyConsumeRequest._finished
    count = [0]

    def failing(self, *a, **kw):  # where settling a success records it (ledger, offset tracker)
        count[0] += 1
        if count[0] == 30:
            raise RuntimeError("bug in settling")
        return finished(self, *a, **kw)

    monkeypatch.setattr(KeyConsumeRequest, "_finished", failing)

    async def listener(msgs, ctx):
        await asyncio.sleep(0.001)
        return S.SUCCESS

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    raised: list[BaseException] = []

    def run() -> None:
        try:
            eng.run(ListenerSpec(listener, "t", "g", ordering="key", key_concurrency=8), "g", MQ, "tok0")
        except BaseException as exc:  # noqa: BLE001 - what the run raised is the test's subject
            raised.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the run hung after a failure settling a result"
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError) and "bug in settling" in str(raised[0])


def test_async_queue_mode_awaits_one_call_at_a_time_in_offset_order(env) -> None:
    p, eng = env
    sent = send_keys(p, 4, 10)
    rec = AsyncRecorder(sleep_s=0.001)
    drain(eng, ListenerSpec(rec, "t", "g"))
    assert rec.max_running == 1
    assert sorted(o for offs in rec.seen.values() for o in offs) == list(range(40))
    assert dict(rec.seen) == dict(sent)
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 40


def test_an_async_listener_returning_an_unawaited_coroutine_is_told_the_await_is_missing(env, caplog) -> None:
    """``async def f(msgs, ctx): return other()``: every call was a suspend, the warning showed the
    coroutine's repr and Python added "never awaited" elsewhere (an async walk-through). A plain
    function returning a coroutine is awaited, as before."""
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="k")

    async def inner():
        return ConsumeOrderlyStatus.SUCCESS

    async def forgot(msgs, ctx):
        return inner()

    def plain(msgs, ctx):
        return inner()

    with caplog.at_level(logging.WARNING, logger="mqorder"):
        drain(eng, ListenerSpec(forgot, "t", "g", max_reconsume_times=0, suspend_current_queue_time_millis=10))
    assert "returned a coroutine (test_an_async_listener_returning_an_unawaited_coroutine_is_told_the_await_is_" \
           "missing.<locals>.inner), not a ConsumeOrderlyStatus: an `await` is missing" in caplog.text
    p.send_orderly("t", b"y", sharding_key="k")
    # What a send's wake-up does for the owner: a new pending request.
    eng.brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), mapping={"pending": "tok1", "pend_until": 2**50})
    drain(eng, ListenerSpec(plain, "t", "g"), token="tok1")
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 2  # y handled: no DLQ, no suspend


def test_an_async_key_that_keeps_failing_reaches_the_dlq_while_the_others_finish(env) -> None:
    p, eng = env
    sent = send_keys(p, 10, 3)
    done_at: dict[str, float] = {}
    k3_at: list[float] = []

    class Failing(AsyncRecorder):
        async def status(self, key, msgs, ctx):
            if key == "k3":
                k3_at.append(time.monotonic())
                ctx.suspend_current_queue_time_millis = 30
                raise RuntimeError("k3 always fails")  # an exception counts as a suspend
            done_at[key] = time.monotonic()
            return S.SUCCESS

    rec = Failing(sleep_s=0.001)
    drain(eng, ListenerSpec(rec, "t", "g", ordering="key", max_reconsume_times=2, key_concurrency=4))
    for k, offs in sent.items():
        if k != "k3":
            assert rec.seen[k] == offs
    assert rec.seen["k3"] == [o for o in sent["k3"] for _ in range(3)]  # 1 + max_reconsume_times each
    dead = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert [int(m.properties["ORIGIN_QUEUE_OFFSET"]) for m in dead] == sent["k3"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 30
    # The others did not wait behind k3's retries (9 calls, 30 ms apart at least): all were done
    # before k3's last call. Compared with k3's own calls, not a wall-clock bound (a loaded machine).
    assert len(k3_at) == 9 and max(done_at.values()) < k3_at[-1]


class _NoHook(ConsumeMessageHook):
    """A hook that does nothing: its presence takes the hooked call path (``call_listener_async``)."""


@pytest.mark.parametrize(("ordering", "hooked"), [("key", False), ("key", True), ("queue", False)])
def test_a_cancelled_error_of_the_listeners_own_is_a_failure_retried_not_a_stalled_key(env, ordering, hooked) -> None:
    """A listener that raises ``CancelledError`` itself (it awaited a future someone else
    cancelled) fails like any exception: its messages are suspended and retried, with a reconsume
    count. It once counted as the run cancelling the call: its key was released, neither finished
    nor retried, and waited for the run's 60 s time budget."""
    p, eng = env
    sent = send_keys(p, 3, 4)
    first: set[int] = set()
    seen: dict[str, list[int]] = defaultdict(list)
    retried: dict[int, int] = {}

    async def listener(msgs, ctx):
        m = msgs[0]
        if m.queue_offset % 5 == 1 and m.queue_offset not in first:
            first.add(m.queue_offset)
            ctx.suspend_current_queue_time_millis = 10
            gone = asyncio.get_running_loop().create_future()
            gone.cancel()
            await gone  # raises CancelledError: not the run's cancellation
        if m.reconsume_times:
            retried[m.queue_offset] = m.reconsume_times
        seen[m.body.decode().split(":")[0]].append(m.queue_offset)
        return S.SUCCESS

    hooks = [_NoHook()] if hooked else []
    t0 = time.monotonic()
    drain(eng, ListenerSpec(listener, "t", "g", ordering=ordering, hooks=hooks, key_concurrency=4))
    took = time.monotonic() - t0
    assert dict(seen) == dict(sent)  # every message once past its failure, in order per key
    assert sorted(first) == [1, 6, 11] and retried == {1: 1, 6: 1, 11: 1}
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 12
    # No run waited out its 60 s time budget with a key neither finished nor retried (the bug
    # took 60 s here; a retry is due 10 ms after its failure).
    assert took < 30, took


def test_a_run_that_loses_its_lease_cancels_its_async_calls_after_the_grace_and_commits_none(env, settings) -> None:
    """c1 finishes every key but k0, whose call hangs; the queue moves to c2 (new epoch). c1's run
    is refused at its next commit, waits its grace (300 ms), cancels k0's call, and ends fenced;
    c2 redelivers k0 only."""
    p, eng = env
    sent = send_keys(p, 6, 3)
    cancelled = threading.Event()
    hanging = threading.Event()

    class Hang(AsyncRecorder):
        async def status(self, key, msgs, ctx):
            if key == "k0":
                hanging.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            return S.SUCCESS

    spec1 = ListenerSpec(Hang(sleep_s=0), "t", "g", ordering="key", key_concurrency=4, cancel_grace_ms=300)
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    result: list[Outcome | None] = []
    t = threading.Thread(target=lambda: result.append(eng.run(spec1, "g", MQ, "tok0")))
    t.start()
    r = eng.brokers.default.client
    state = keys.sub_state(MQ.tag, "g")
    finished = {o for k, offs in sent.items() if k != "k0" for o in offs}

    def committed_map() -> set[int]:
        off, raw = r.hmget(state, "offset", "done")
        return decode_done(raw, int(off or 0))

    deadline = time.monotonic() + 20
    while committed_map() != finished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hanging.is_set() and committed_map() == finished
    r.hset(state, mapping={"lease": 0})  # c1 paused past its lease: the queue goes to c2
    eng2 = ConsumerEngine(settings, "c2")
    rec2 = AsyncRecorder(sleep_s=0)
    drain(eng2, ListenerSpec(rec2, "t", "g", ordering="key"), client="c2", token="tok1")
    assert dict(rec2.seen) == {"k0": sent["k0"]}
    t.join(20)
    assert cancelled.is_set()
    assert result and result[0] is not None and result[0].verb in ("FENCED", "STALE")
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 18
    eng2.brokers.close()


def test_queue_mode_cancels_an_async_call_when_a_rebalance_revokes_the_queue(env) -> None:
    """The queue is revoked (reassigned to c2) while c1's only call hangs: c1's run cancels it after
    the grace and ends without committing the message, which stays for the next owner."""
    p, eng = env
    send_keys(p, 1, 2)
    cancelled = threading.Event()
    started = threading.Event()

    async def hang(msgs, ctx):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return S.SUCCESS

    spec = ListenerSpec(hang, "t", "g", cancel_grace_ms=200)
    lm = RebalanceLockManager(eng.brokers)
    lm.assign("g", [(MQ, "c1", "tok0")])
    result: list[Outcome | None] = []
    t = threading.Thread(target=lambda: result.append(eng.run(spec, "g", MQ, "tok0")))
    t.start()
    assert started.wait(10)
    lm.assign("g", [(MQ, "c2", "tok1")])  # a rebalance moves the queue away
    t.join(20)
    assert not t.is_alive() and cancelled.is_set()
    assert result and result[0] is not None
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 0  # nothing of the cancelled call committed


def test_a_listener_that_blocks_the_loop_is_named_and_shows_as_loop_lag(env, caplog) -> None:
    p, eng = env
    send_keys(p, 2, 1)
    lags: list[float] = []
    loop = ProcessLoop.get()
    loop.lag_observers.append(lags.append)

    async def sleepy_blocker(msgs, ctx):
        time.sleep(BLOCKED_S * 2.5)  # the mistake: a blocking sleep inside async def
        return S.SUCCESS

    try:
        with caplog.at_level(logging.WARNING, logger="mqorder.consumer.async_loop"):
            drain(eng, ListenerSpec(sleepy_blocker, "t", "g", ordering="key"))
    finally:
        loop.lag_observers.remove(lags.append)
    assert max(lags) >= BLOCKED_S
    lines = [r.getMessage() for r in caplog.records if "blocking the event loop" in r.getMessage()]
    assert lines and "sleepy_blocker" in lines[0]


def test_async_concurrent_listener_acknowledges_and_retries(env) -> None:
    p, eng = env
    send_keys(p, 5, 4)
    seen: list[int] = []

    @concurrent_listener(topic="t", group="g-ac", consume_concurrency=8)
    async def conc(msgs, ctx):
        await asyncio.sleep(0.001)
        seen.extend(m.queue_offset for m in msgs)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    try:
        spec = get_listener("g-ac", "t")
        assert spec is not None and spec.is_async
        RebalanceLockManager(eng.brokers).assign("g-ac", [(MQ, "c1", "tok0")])
        out = eng.run(spec, "g-ac", MQ, "tok0")
        assert out is not None
        deadline = time.monotonic() + 10
        while len(seen) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(seen) == list(range(20))
    finally:
        unregister_listener("g-ac", "t")


def test_async_hooks_are_awaited_around_async_and_plain_listeners_side_by_side(env) -> None:
    """One engine runs a plain key-mode listener and an async one (two groups), both with an
    ``async def`` hook."""
    p, eng = env
    send_keys(p, 3, 2)
    calls: list[tuple[str, str, bool]] = []

    class AsyncHook(ConsumeMessageHook):
        async def consume_message_before(self, context: ConsumeMessageContext) -> None:
            await asyncio.sleep(0)
            calls.append(("before", context.consumer_group, context.success))

        async def consume_message_after(self, context: ConsumeMessageContext) -> None:
            calls.append(("after", context.consumer_group, context.success))

    async def async_one(msgs, ctx):
        return S.SUCCESS

    def plain_one(msgs, ctx):
        return S.SUCCESS

    drain(eng, ListenerSpec(async_one, "t", "g", ordering="key", hooks=[AsyncHook()]))
    RebalanceLockManager(eng.brokers).assign("g2", [(MQ, "c1", "tok9")])
    assert eng.run(ListenerSpec(plain_one, "t", "g2", ordering="key", hooks=[AsyncHook()]), "g2", MQ, "tok9")
    assert calls.count(("after", "g", True)) == 6 and calls.count(("before", "g", False)) == 6
    assert calls.count(("after", "g2", True)) == 6 and calls.count(("before", "g2", False)) == 6
    assert MessageLog(eng.brokers).consume_offset("g2", MQ) == 6


def test_the_decorators_take_async_def_and_refuse_generators_with_what_to_write() -> None:
    @orderly_listener(topic="t-a1", group="g-a1", ordering="key")
    async def ok(msgs, ctx):
        return S.SUCCESS

    try:
        spec = get_listener("g-a1", "t-a1")
        assert spec is not None and spec.is_async
    finally:
        unregister_listener("g-a1", "t-a1")

    async def agen(msgs, ctx):
        yield S.SUCCESS

    with pytest.raises(ListenerError, match="generator.*async def"):
        orderly_listener(topic="t-a2", group="g-a2")(agen)
    with pytest.raises(ListenerError, match="cancel_grace_ms"):
        orderly_listener(topic="t-a2", group="g-a2", cancel_grace_ms=-1)


def test_a_plain_function_returning_a_coroutine_is_awaited_not_dropped(env) -> None:
    """A decorator that hides an ``async def`` behind a plain function returning its coroutine: the
    calls are awaited on the process's loop, not silently lost (issue 31's bug)."""
    p, eng = env
    send_keys(p, 3, 2)
    seen: list[int] = []

    async def handle(tag, msgs, ctx):
        await asyncio.sleep(0)
        seen.extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    def wrapper(msgs, ctx):  # what a careless decorator leaves
        return handle("x", msgs, ctx)

    spec = ListenerSpec(wrapper, "t", "g")
    assert not spec.is_async
    drain(eng, spec)
    assert seen == list(range(6))
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 6


def test_the_process_cap_holds_calls_past_it_until_a_slot_frees() -> None:
    loop = ProcessLoop(max_in_flight=2)
    running, peak, done = [0], [0], threading.Event()
    release = asyncio.Event()
    ended: list[int] = []

    async def call(i: int) -> None:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        if i < 2:
            await release.wait()
        running[0] -= 1
        ended.append(i)
        if len(ended) == 5:
            done.set()

    for i in range(5):
        loop.submit("cap-test", functools.partial(call, i), lambda: None)
    time.sleep(0.3)
    assert peak[0] == 2 and ended == []  # three calls wait for a slot
    loop.loop.call_soon_threadsafe(release.set)
    assert done.wait(10)
    assert peak[0] == 2 and sorted(ended) == [0, 1, 2, 3, 4]


def test_a_revoked_key_run_cancels_its_hanging_call_and_counts_no_reconsume(env) -> None:
    """A rebalance revokes the queue while one key's call hangs: the other keys' work is committed,
    the hanging call is cancelled after the grace, and its message stays unfinished with its
    reconsume count untouched (never a step towards the DLQ)."""
    p, eng = env
    sent = send_keys(p, 4, 1)
    cancelled = threading.Event()

    class Hang(AsyncRecorder):
        async def status(self, key, msgs, ctx):
            if key == "k0":
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            return S.SUCCESS

    rec = Hang(sleep_s=0)
    spec = ListenerSpec(rec, "t", "g", ordering="key", cancel_grace_ms=200, max_reconsume_times=0)
    lm = RebalanceLockManager(eng.brokers)
    lm.assign("g", [(MQ, "c1", "tok0")])
    result: list[Outcome | None] = []
    t = threading.Thread(target=lambda: result.append(eng.run(spec, "g", MQ, "tok0")))
    t.start()
    deadline = time.monotonic() + 10
    while len(rec.seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    lm.assign("g", [(MQ, "c2", "tok1")])
    t.join(20)
    assert not t.is_alive() and cancelled.is_set()
    r = eng.brokers.default.client
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == sent["k0"][0]  # k0's offset stays unfinished
    assert decode_done(r.hget(keys.sub_state(MQ.tag, "g"), "done"), sent["k0"][0]) == {1, 2, 3}
    assert not r.hgetall(keys.sub_retries(MQ.tag, "g"))  # no reconsume counted for the cancelled call
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert dlq == []


def wait_for_a_quiet_loop(timeout: float = 10.0) -> None:
    """Wait until nothing of an earlier test of this process is on the process's loop (a call
    still being cancelled, a task, another thread's work within ``FOREIGN_QUIET_S``): only then is
    a run the process's only one, which ``ProcessLoop.claim`` requires. (Under a loaded parallel
    ``make test-fast`` an earlier test's cancelled call could still be in flight here.)"""
    loop = ProcessLoop.get()

    def quiet() -> bool:
        return (not (loop.in_flight or loop._pending or loop._background) and loop._owner is None
                and loop._runs == 0 and time.monotonic() - loop._foreign_at >= FOREIGN_QUIET_S)

    deadline = time.monotonic() + timeout
    while not quiet():
        assert time.monotonic() < deadline, "the process's loop still holds an earlier test's work"
        time.sleep(0.01)


def test_a_run_gives_the_loop_back_when_it_ends_and_background_tasks_go_on(env) -> None:
    """The only run of a process drives the loop in its own thread (``ProcessLoop.claim``); when
    it ends the loop's own thread runs it again: a task the listener left behind keeps running."""
    p, eng = env
    sent = send_keys(p, 20, 3)
    ticks: list[int] = []
    started = threading.Event()

    async def ticker() -> None:
        while True:
            ticks.append(threading.get_ident())
            await asyncio.sleep(0.01)

    rec = AsyncRecorder(sleep_s=0.002)

    async def listener(msgs, ctx):
        if not started.is_set():
            started.set()
            asyncio.get_running_loop().create_task(ticker())
        return await rec(msgs, ctx)

    wait_for_a_quiet_loop()
    drain(eng, ListenerSpec(listener, "t", "g", ordering="key", key_concurrency=8))
    assert dict(rec.seen) == dict(sent)
    assert rec.threads == {threading.get_ident()}  # the run drove the loop itself
    loop = ProcessLoop.get()
    n = len(ticks)
    deadline = time.monotonic() + 5
    while len(ticks) < n + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ticks) >= n + 5, "the loop stopped running after the run that drove it ended"
    assert ticks[-1] == loop.thread_id  # back on the loop's own thread
    for task in [t for t in asyncio.all_tasks(loop.loop) if t.get_coro().__name__ == "ticker"]:
        loop.loop.call_soon_threadsafe(task.cancel)


def test_two_runs_of_one_process_share_the_loop_and_keep_per_key_order(settings) -> None:
    """Two key-ordered async runs at once in one process (a threads pool): neither may keep the
    loop to itself; both finish, each key in order, and calls ran on the loop's own thread."""
    from mqorder import Producer

    pr = Producer(settings=settings)
    pr.create_topic("u", queues=2)
    eng = ConsumerEngine(settings, "c1")
    try:
        sent = send_keys(pr, 40, 4, topic="u")
        rec = AsyncRecorder(sleep_s=0.003)
        spec = ListenerSpec(rec, "u", "g", ordering="key", key_concurrency=8)
        mqs = [MessageQueue("u", "broker-a", i) for i in range(2)]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                drain(eng, spec, mq=mqs[i], token=f"tok-u{i}")
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert dict(rec.seen) == dict(sent)
        assert rec.overlaps == []
        assert ProcessLoop.get().thread_id in rec.threads  # the loop's own thread ran calls too
        log = MessageLog(eng.brokers)
        assert sum(log.consume_offset("g", mq) for mq in mqs) == 160
    finally:
        pr.close()
        eng.brokers.close()


def test_the_process_cap_is_a_validated_setting_that_reaches_the_loop(monkeypatch, redis_url) -> None:
    """``async_max_in_flight`` (``MQORDER_ASYNC_MAX_IN_FLIGHT``) is read and checked with the other
    settings, and a run passes it to the process's loop."""
    from mqorder.errors import ConfigError
    from mqorder.settings import load_settings

    monkeypatch.setenv("MQORDER_ASYNC_MAX_IN_FLIGHT", "0")
    with pytest.raises(ConfigError, match="MQORDER_ASYNC_MAX_IN_FLIGHT"):
        load_settings(redis_url=redis_url)
    monkeypatch.setenv("MQORDER_ASYNC_MAX_IN_FLIGHT", "lots")
    with pytest.raises(ConfigError, match="MQORDER_ASYNC_MAX_IN_FLIGHT"):
        load_settings(redis_url=redis_url)
    monkeypatch.setenv("MQORDER_ASYNC_MAX_IN_FLIGHT", "3")
    s = load_settings(redis_url=redis_url)
    assert s.async_max_in_flight == 3
    from mqorder import Producer

    p = Producer(settings=s)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(s, "c1")
    loop = ProcessLoop.get()
    before = loop.max_in_flight
    try:
        sent = send_keys(p, 12, 2)
        rec = AsyncRecorder(sleep_s=0.005)
        drain(eng, ListenerSpec(rec, "t", "g", ordering="key", key_concurrency=8))
        assert dict(rec.seen) == dict(sent)
        assert loop.max_in_flight == 3 and rec.max_running <= 3  # the process cap, below key_concurrency
    finally:
        ProcessLoop.get(before)
        p.close()
        eng.brokers.close()

"""Key-ordered consumption (``ordering="key"``) in the Celery-free engine, against a real
redis-server: per-key order, no two calls of one key at once, a suspend that holds back only its
key, the DLQ, and a failover that redelivers only unfinished offsets. The end-to-end tests run the
same engine in real Celery workers on prefork, threads and gevent (``test_key_e2e``)."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

from mqorder import ConsumeOrderlyStatus, keys
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.key_request import KeyConsumeRequest
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.offset_map import decode_done
from mqorder.consumer.run_types import Outcome
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.log import MessageLog
from tests.engine_support import MQ, drain

S = ConsumeOrderlyStatus


def key_spec(func, **kw) -> ListenerSpec:
    return ListenerSpec(func, "t", "g", ordering="key", **kw)


class Recorder:
    """A listener that sleeps randomly and records, per key, the offsets it saw and any overlap."""

    def __init__(self, sleep_ms: float = 3.0) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, list[int]] = defaultdict(list)
        self.running: dict[str, int] = defaultdict(int)
        self.overlaps: list[str] = []
        self.now_running = 0
        self.max_running = 0
        self.sleep_ms = sleep_ms
        self.rng = random.Random(3)

    def key_of(self, body: bytes) -> str:
        return body.decode().split(":")[0]

    def __call__(self, msgs, ctx):
        key = self.key_of(msgs[0].body)
        with self.lock:
            self.running[key] += 1
            if self.running[key] > 1:
                self.overlaps.append(key)
            self.now_running += 1
            self.max_running = max(self.max_running, self.now_running)
            delay = self.rng.random() * self.sleep_ms / 1000
        time.sleep(delay)
        with self.lock:
            self.seen[key].extend(m.queue_offset for m in msgs)
            self.running[key] -= 1
            self.now_running -= 1
        return self.status(msgs, ctx)

    def status(self, msgs, ctx) -> S:
        return S.SUCCESS


def send_keys(p, n_keys: int, per_key: int) -> dict[str, list[int]]:
    """Interleaved sends of ``per_key`` messages for each of ``n_keys`` keys to the one queue."""
    sent: dict[str, list[int]] = defaultdict(list)
    items = [(f"k{k}", f"k{k}:{i}".encode()) for i in range(per_key) for k in range(n_keys)]
    for (key, _), res in zip(items, p.send_orderly_batch("t", items), strict=True):
        sent[key].append(res.queue_offset)
    return sent


def test_keys_run_in_parallel_in_offset_order_per_key_never_two_calls_of_one_key(env) -> None:
    p, eng = env
    sent = send_keys(p, 40, 10)
    rec = Recorder()
    outs = drain(eng, key_spec(rec, key_concurrency=8))
    assert dict(rec.seen) == dict(sent)  # every message once, each key in offset order
    assert rec.overlaps == []
    assert rec.max_running > 1  # keys of one queue really ran side by side
    assert rec.max_running <= 8
    assert outs[-1].verb in ("IDLE", "STALE") or not outs[-1].needs_dispatch
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 400


def test_a_suspended_key_holds_back_only_itself_and_reaches_the_dlq(env) -> None:
    p, eng = env
    sent = send_keys(p, 10, 5)
    done_at: dict[str, float] = {}
    dlq_seen: list[int] = []

    class Failing(Recorder):
        def status(self, msgs, ctx):
            if self.key_of(msgs[0].body) == "k3":
                ctx.suspend_current_queue_time_millis = 20
                dlq_seen.extend(m.reconsume_times for m in msgs)
                return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
            done_at[self.key_of(msgs[0].body)] = time.monotonic()
            return S.SUCCESS

    rec = Failing(sleep_ms=1)
    t0 = time.monotonic()
    drain(eng, key_spec(rec, max_reconsume_times=2, key_concurrency=4))
    for k, offs in sent.items():
        if k != "k3":
            assert rec.seen[k] == offs
    # k3: each message tried 3 times (0, 1, 2 reconsumes), in order, then the DLQ.
    assert rec.seen["k3"] == [o for o in sent["k3"] for _ in range(3)]
    dlq = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)
    dead = MessageLog(eng.brokers).read(dlq, 0, 100)
    assert [int(m.properties["ORIGIN_QUEUE_OFFSET"]) for m in dead] == sent["k3"]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 50
    # The other keys did not wait behind k3 (5 messages x 3 tries x 20 ms suspend >= 300 ms).
    assert max(done_at.values()) - t0 < 0.3


def test_a_keys_suspend_holds_across_runs_that_end_at_another_keys_earlier_time(env, r) -> None:
    """A run with no spare slot (``may_linger`` False: a busy worker, and the engine tests) ends
    with REQUEUE at the *earliest* suspended key's time. Once the next run retried every key at
    once: a key suspended for 600 ms was retried every 30 ms (another key's suspend), and reached
    the DLQ in a fraction of its suspend times. The commit keeps each suspended key's time
    (``held``) and the next run holds the key back until then."""
    p, eng = env
    p.send_orderly("t", b"slow", sharding_key="slow")
    p.send_orderly("t", b"fast", sharding_key="fast")
    tries: dict[str, list[float]] = defaultdict(list)

    def listener(msgs, ctx):
        k = msgs[0].body.decode()
        tries[k].append(time.monotonic())
        ctx.suspend_current_queue_time_millis = 600 if k == "slow" else 30
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT

    outs = drain(eng, key_spec(listener, key_concurrency=4, max_reconsume_times=2), max_runs=100)
    assert len(outs) > 3  # runs ended and began again while "slow" was suspended
    gaps = [b - a for a, b in zip(tries["slow"], tries["slow"][1:], strict=False)]
    assert len(tries["slow"]) == 3 and min(gaps) >= 0.58, f"key 'slow' retried after {gaps} s, not 0.6 s"
    dlq = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)
    assert sorted(m.body for m in MessageLog(eng.brokers).read(dlq, 0, 10)) == [b"fast", b"slow"]
    assert r.hget(keys.sub_state(MQ.tag, "g"), "held") in (None, b"")  # nothing held once both left


def test_a_keys_dead_letter_says_what_its_last_call_raised(env) -> None:
    p, eng = env
    p.send_orderly("t", b"bad", sharding_key="bad")
    p.send_orderly("t", b"good", sharding_key="good")

    def listener(msgs, ctx):
        if msgs[0].body == b"bad":
            raise KeyError("no such account")
        return S.SUCCESS

    drain(eng, key_spec(listener, key_concurrency=4, max_reconsume_times=1, suspend_current_queue_time_millis=10),
          max_runs=100)
    dlq = MessageLog(eng.brokers).read(MessageQueue(keys.dlq_topic("g"), "broker-a", 0), 0, 10)
    assert [(m.body, m.properties["DLQ_REASON"]) for m in dlq] == [
        (b"bad", "max reconsume times 1 reached (the last call raised KeyError: 'no such account')")]


def test_an_offset_reset_back_does_not_let_a_keys_old_suspend_run_two_of_its_calls_at_once(env, r) -> None:
    """Run A suspends key k at k:1 (``held`` names offset 1). An operator resets the group to 0
    (``mqorder offsets reset``). Once the reset kept ``held``: run B replayed k:0 (a slow call),
    pulled k:1, applied the old suspend to it and so cleared k's busy mark, and k:1 went out
    beside k:0 and finished first."""
    p, eng = env
    p.send_orderly("t", b"k:0", sharding_key="k")
    p.send_orderly("t", b"k:1", sharding_key="k")
    phase, lock, running = ["A"], threading.Lock(), [0]
    calls: list[tuple[str, str, int]] = []

    def listener(msgs, ctx):
        body = msgs[0].body.decode()
        with lock:
            running[0] += 1
            calls.append((phase[0], body, running[0]))
        try:
            if phase[0] == "A" and body == "k:1":
                ctx.suspend_current_queue_time_millis = 300
                return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
            if phase[0] == "B" and body == "k:0":
                time.sleep(1.0)  # still running when k:1's old suspend is over
            return S.SUCCESS
        finally:
            with lock:
                running[0] -= 1

    spec = key_spec(listener, key_concurrency=4, pull_batch_size=1)
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    eng.run(spec, "g", MQ, "tok0")
    st = keys.sub_state(MQ.tag, "g")
    assert r.hget(st, "held")  # k suspended at its offset 1
    eng.brokers.default.scripts.reset_offset(keys=[st, keys.sub_retries(MQ.tag, "g")], args=[0])
    phase[0] = "B"
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok1")])
    eng.run(spec, "g", MQ, "tok1")
    b = [(body, n) for ph, body, n in calls if ph == "B"]
    assert [body for body, _ in b][:2] == ["k:0", "k:1"]
    assert max(n for _, n in b) == 1, f"two calls of key k at once: {b}"


def test_failover_mid_flight_redelivers_only_unfinished_offsets(env, settings) -> None:
    """c1 finishes every key but k0, whose first call hangs; c2 takes over (new epoch): c2 gets k0's
    messages and nothing that c1 finished, and c1's late commit is refused."""
    p, eng = env
    sent = send_keys(p, 6, 4)
    release = threading.Event()
    hanging = threading.Event()

    class Hang(Recorder):
        def status(self, msgs, ctx):
            if self.key_of(msgs[0].body) == "k0":
                hanging.set()
                release.wait(30)
            return S.SUCCESS

    rec1 = Hang(sleep_ms=0)
    spec1 = key_spec(rec1, key_concurrency=4)
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    result: list[Outcome | None] = []
    t = threading.Thread(target=lambda: result.append(eng.run(spec1, "g", MQ, "tok0")))
    t.start()
    state = keys.sub_state(MQ.tag, "g")
    r = eng.brokers.default.client
    finished = {o for k, offs in sent.items() if k != "k0" for o in offs}

    def committed_map() -> set[int]:
        off, raw = r.hmget(state, "offset", "done")
        return decode_done(raw, int(off or 0))

    deadline = time.monotonic() + 20
    while committed_map() != finished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hanging.is_set() and committed_map() == finished
    assert int(r.hget(state, "offset")) == sent["k0"][0]  # the lowest unfinished offset
    # Failover: c1's lease lapses (a paused or dead process); the queue goes to c2, new epoch.
    r.hset(state, mapping={"lease": 0})
    eng2 = ConsumerEngine(settings, "c2")
    rec2 = Recorder(sleep_ms=0)
    drain(eng2, key_spec(rec2), client="c2", token="tok1")
    assert dict(rec2.seen) == {"k0": sent["k0"]}  # only what c1 had not finished
    release.set()
    t.join(10)
    assert result and result[0] is not None and result[0].verb in ("FENCED", "STALE")
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 24
    eng2.brokers.close()


def test_queue_mode_is_untouched_by_key_hashes(env) -> None:
    """The default ordering still runs one call at a time for the whole queue."""
    p, eng = env
    send_keys(p, 5, 4)
    rec = Recorder(sleep_ms=1)
    drain(eng, ListenerSpec(rec, "t", "g"))
    assert rec.max_running == 1
    assert sorted(o for offs in rec.seen.values() for o in offs) == list(range(20))


def test_key_consume_request_is_what_the_engine_runs_for_ordering_key() -> None:
    from mqorder.consumer.consume_request import ConsumeRequest
    from mqorder.consumer.engine import request_class

    assert request_class(key_spec(lambda m, c: S.SUCCESS)) is KeyConsumeRequest
    assert request_class(ListenerSpec(lambda m, c: S.SUCCESS, "t", "g")) is ConsumeRequest


def test_a_blocked_key_with_a_long_lane_does_not_stop_the_pulls_of_its_queue(env) -> None:
    """100 messages of one key come first, and its first one suspends twice (300 ms each): the run
    must keep pulling past that key's full lane, so the other keys finish meanwhile."""
    p, eng = env
    p.send_orderly_batch("t", [("bad", f"bad:{i}".encode()) for i in range(100)])
    p.send_orderly_batch("t", [(f"k{k}", f"k{k}:{i}".encode()) for i in range(2) for k in range(50)])
    fails = {0: 2}
    first_bad_ok: list[float] = []
    others_done: list[float] = []

    class Blocking(Recorder):
        def status(self, msgs, ctx):
            m = msgs[0]
            if self.key_of(m.body) == "bad":
                if fails.get(m.queue_offset, 0) > 0:
                    fails[m.queue_offset] -= 1
                    ctx.suspend_current_queue_time_millis = 300
                    return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
                if not first_bad_ok:
                    first_bad_ok.append(time.monotonic())
            else:
                others_done.append(time.monotonic())
            return S.SUCCESS

    rec = Blocking(sleep_ms=1)
    eng.may_linger = lambda: True  # a spare slot: the run waits for the blocked key in place
    drain(eng, key_spec(rec, key_concurrency=8))
    assert len(others_done) == 100 and rec.overlaps == []
    assert max(others_done) < first_bad_ok[0]  # nobody waited behind the blocked key
    assert rec.seen["bad"][:3] == [0, 0, 0] and rec.seen["bad"][3:] == list(range(1, 100))
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 200


def test_pulling_pauses_while_the_span_from_the_lowest_unfinished_offset_is_too_wide(env) -> None:
    """consume_concurrently_max_span: with offset 0 suspended, the run pulls no further than the
    span allows; the rest of the queue waits for offset 0 (RocketMQ's consumeConcurrentlyMaxSpan)."""
    p, eng = env
    p.send_orderly("t", b"bad:0", sharding_key="bad")
    p.send_orderly_batch("t", [(f"k{k}", f"k{k}:0".encode()) for k in range(100)])
    handled_before: list[int] = []
    bad_ok: list[bool] = []

    class Span(Recorder):
        def status(self, msgs, ctx):
            if self.key_of(msgs[0].body) == "bad":
                if msgs[0].reconsume_times == 0:
                    ctx.suspend_current_queue_time_millis = 300
                    return S.SUSPEND_CURRENT_QUEUE_A_MOMENT
                bad_ok.append(True)
            elif not bad_ok:
                handled_before.extend(m.queue_offset for m in msgs)
            return S.SUCCESS

    rec = Span(sleep_ms=0)
    eng.may_linger = lambda: True
    drain(eng, key_spec(rec, consume_concurrently_max_span=10, pull_batch_size=4, key_concurrency=4))
    assert 0 < len(handled_before) and max(handled_before) < 10 + 4  # at most one pull past the span
    assert sum(len(v) for v in rec.seen.values()) == 102  # bad twice, then everything
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 101


def test_a_drained_key_ordered_run_lingers_and_takes_a_new_message_itself(env) -> None:
    p, eng = env
    send_keys(p, 3, 2)
    runs: list[str] = []

    class Runs(Recorder):
        def status(self, msgs, ctx):
            runs.append(ctx.run_id)
            return S.SUCCESS

    rec = Runs(sleep_ms=0)
    eng.may_linger = lambda: True  # the worker has spare slots
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    out: list[Outcome | None] = []
    t = threading.Thread(target=lambda: out.append(eng.run(key_spec(rec), "g", MQ, "tok0")))
    t.start()
    deadline = time.monotonic() + 5
    while len(runs) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    sent_at = time.monotonic()
    p.send_orderly("t", b"late:0", sharding_key="late")
    while len(runs) < 7 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(runs) == 7 and time.monotonic() - sent_at < 0.5
    assert len(set(runs)) == 1  # the same run handled the late message: no wake-up, no new task
    t.join(10)
    assert out and out[0] is not None and out[0].verb == "IDLE"


def test_a_wrong_ordering_or_key_setting_is_refused_with_what_is_allowed() -> None:
    import pytest

    from mqorder.consumer.listener import orderly_listener
    from mqorder.errors import ListenerError

    with pytest.raises(ListenerError, match="ordering must be 'queue'.*or 'key'"):
        orderly_listener(topic="t", group="g", ordering="keys")
    with pytest.raises(ListenerError, match="key_concurrency must be an int from 1 to 1024, got 0"):
        orderly_listener(topic="t", group="g", ordering="key", key_concurrency=0)
    # Over the worker-wide bound: a span of 300,000 made offset maps key_commit.lua refuses (over
    # MAX_MAP_BYTES), every commit of the queue was refused and it redelivered its work forever.
    with pytest.raises(ListenerError, match="consume_concurrently_max_span must be an int from 1 to 100000"):
        orderly_listener(topic="t", group="g", ordering="key", consume_concurrently_max_span=300_000)


def test_a_listeners_bounds_are_the_worker_settings_bounds() -> None:
    from mqorder.consumer.listener import MAXIMA
    from mqorder.settings import Settings

    setting = {"suspend_current_queue_time_millis": "suspend_current_queue_time_ms"}  # RocketMQ's two spellings
    for name, most in MAXIMA.items():
        les = [m.le for m in Settings.model_fields[setting.get(name, name)].metadata
               if getattr(m, "le", None) is not None]
        assert les == [most], f"{name}: the listener allows up to {most}, the settings {les}"


def test_the_widest_span_encodes_within_what_key_commit_stores() -> None:
    """The worst map of the widest span a listener may ask for (every other offset finished: the
    bitset, a quarter of the span in hex digits) fits ``MAX_MAP_BYTES``."""
    from mqorder.consumer.key_request import MAX_MAP_BYTES
    from mqorder.consumer.listener import MAXIMA
    from mqorder.consumer.offset_map import encode_done

    span = MAXIMA["consume_concurrently_max_span"]
    base = 10**12
    assert len(encode_done(base, range(base + 2, base + span, 2))) < MAX_MAP_BYTES


def test_a_key_ordered_batch_holds_consecutive_messages_of_one_key_only(env) -> None:
    p, eng = env
    sent = send_keys(p, 4, 6)
    batches: list[list[tuple[str, int]]] = []

    def listener(msgs, ctx):
        batches.append([(m.body.decode().split(":")[0], m.queue_offset) for m in msgs])
        return S.SUCCESS

    drain(eng, key_spec(listener, consume_message_batch_max_size=3))
    assert all(len({k for k, _ in b}) == 1 for b in batches)  # one key per call
    assert any(len(b) > 1 for b in batches)
    per_key: dict[str, list[int]] = defaultdict(list)
    for b in batches:
        per_key[b[0][0]].extend(o for _, o in b)
    assert dict(per_key) == dict(sent)


def test_the_ledger_records_every_key_ordered_call(env) -> None:
    p, eng = env
    send_keys(p, 5, 4)
    drain(eng, key_spec(lambda msgs, ctx: S.SUCCESS, ledger=True))
    r = eng.brokers.default.client
    assert r.xlen(keys.ledger("g")) == 20


def test_many_lanes_may_ask_still_owner_at_once(env) -> None:
    """150 lanes of one queue each ask ``ctx.still_owner()`` at the same moment: more than
    redis-py's default pool of 100 connections, which must not turn into suspends."""
    p, eng = env
    send_keys(p, 150, 1)
    barrier = threading.Barrier(150, timeout=10)
    answers: list[bool] = []

    def listener(msgs, ctx):
        barrier.wait()
        answers.append(ctx.still_owner())
        return S.SUCCESS

    drain(eng, key_spec(listener, key_concurrency=150))
    assert len(answers) == 150 and all(answers)

"""The batching producer (``Producer.send_orderly_async``, ``mqorder.client.batching``) against a
real redis-server: order and offsets under 32 threads, linger and batch size, refusals that fail
only their own futures, flush and close, a full buffer, a fork, interpreter exit, bad input."""

from __future__ import annotations

import ctypes
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future

import pytest
import redis

from mqorder import Producer
from mqorder.client.selector import queue_index
from mqorder.errors import (
    BrokerFullError,
    BrokerRefusedError,
    BufferExhaustedError,
    ConfigError,
    InvalidNameError,
    MessageError,
    MessageTooLargeError,
    ProducerClosedError,
    TopicNotFoundError,
    TopicNotWritableError,
)
from mqorder.model import SendResult
from mqorder.settings import load_settings
from mqorder.store.log import MessageLog
from tests.support import ROOT


def _evalsha_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def _log(p: Producer, topic: str) -> dict[tuple[int, int], tuple[str, bytes]]:
    """Every stored message of ``topic``: (queue id, offset) -> (msg id, body)."""
    out = {}
    for mq in p.describe_topic(topic).message_queues:
        for m in MessageLog(p.brokers).read(mq, 0, 100_000):
            out[(mq.queue_id, m.queue_offset)] = (m.msg_id, m.body)
    return out


def test_32_threads_each_keys_order_kept_and_every_future_has_its_offset(settings, r: redis.Redis) -> None:
    p = Producer(settings=settings, linger_ms=5)
    p.create_topic("t", queues=4)
    r.config_resetstat()
    sends: dict[int, list[tuple[str, bytes, Future[SendResult]]]] = defaultdict(list)

    def thread(t: int) -> None:
        for j in range(40):
            key = f"own-{t}-{j % 3}" if j % 2 else f"shared-{j % 5}"
            body = f"{t}:{j}".encode()
            fut = p.send_orderly_async("t", body, sharding_key=key)
            sends[t].append((key, body, fut))
            if j % 4 == 3:  # some sends wait for their ack, the others go on at once
                fut.result(10)

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(32)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    p.flush(10)
    stored = _log(p, "t")
    assert len(stored) == 32 * 40  # each send stored once
    for t, items in sends.items():
        last: dict[str, int] = {}
        for key, body, fut in items:
            res = fut.result(0)
            assert res.message_queue.queue_id == queue_index(key, 4)  # send_orderly's queue for the key
            assert stored[(res.message_queue.queue_id, res.queue_offset)] == (res.msg_id, body)
            assert res.queue_offset > last.get(key, -1), f"thread {t} key {key}: stored out of call order"
            last[key] = res.queue_offset
    # One script call per queue chunk of a batch, not per send (a first NOSCRIPT call included).
    assert _evalsha_calls(r) <= 32 * 40 / 4
    p.close()


def test_a_send_waits_out_the_linger_unless_batch_size_sends_are_pending(settings) -> None:
    p = Producer(settings=settings, linger_ms=300, batch_size=8)
    p.create_topic("t", queues=2)
    t0 = time.monotonic()
    lone = p.send_orderly_async("t", b"lone", sharding_key="k")
    time.sleep(0.1)
    assert not lone.done()  # still lingering for company
    lone.result(5)
    assert time.monotonic() - t0 >= 0.28
    slow = Producer(settings=settings, linger_ms=60_000, batch_size=8)
    futures = [slow.send_orderly_async("t", b"%d" % i, sharding_key="k") for i in range(9)]
    assert [f.result(5).queue_offset for f in futures[:8]] == list(range(1, 9))  # the 8th sent the batch
    time.sleep(0.1)
    assert not futures[8].done()  # the 9th lingers (a minute) ...
    slow.flush(5)  # ... until a flush sends it at once
    assert futures[8].result(0).queue_offset == 9
    slow.close()
    p.close()


def test_a_chunk_redis_refuses_fails_only_its_own_futures(settings, r: redis.Redis, redis_server) -> None:
    """An ACL user that may not touch queue 3's keys: in one round trip, the calls of queues 0-2
    are stored and queue 3's call is refused (NOPERM), as an OOM near maxmemory would be."""
    admin = Producer(settings=settings)
    admin.create_topic("t", queues=4)
    r.acl_setuser("limited", enabled=True, passwords=["+pw"], commands=["+@all"],
                  keys=["mqorder:[^{]*", "mqorder:{t:broker-a:[012]}*"])
    try:
        url = f"redis://limited:pw@127.0.0.1:{redis_server.port}/0"
        p = Producer(settings=load_settings(redis_url=url), linger_ms=50)
        keys = {q: next(f"k{i}" for i in range(1000) if queue_index(f"k{i}", 4) == q) for q in range(4)}
        futures = {q: [p.send_orderly_async("t", b"%d" % i, sharding_key=k) for i in range(3)] for q, k in keys.items()}
        p.flush(5)
        for q in (0, 1, 2):
            assert [f.result(0).queue_offset for f in futures[q]] == [0, 1, 2]
        for f in futures[3]:
            with pytest.raises(BrokerRefusedError, match="refused the write, so nothing was stored: NOPERM"):
                f.result(0)
        assert sorted(_log(admin, "t")) == [(q, o) for q in (0, 1, 2) for o in range(3)]  # queue 3: nothing
        p.close()
    finally:
        r.acl_deluser("limited")
        admin.close()


def test_redis_out_of_memory_fails_the_batch_and_stores_nothing(settings, r: redis.Redis) -> None:
    p = Producer(settings=settings, linger_ms=2)
    p.create_topic("t", queues=2)
    p.send_orderly_async("t", b"first", sharding_key="k").result(5)  # the capacity guard's reading: ok
    r.config_set("maxmemory", 1)  # the guard's cached reading (1 s) still says ok: Redis itself refuses
    try:
        futures = [p.send_orderly_async("t", b"x", sharding_key=f"k{i}") for i in range(4)]
        for f in futures:
            with pytest.raises(BrokerRefusedError, match="OOM"):
                f.result(5)
    finally:
        r.config_set("maxmemory", 0)
    assert len(_log(p, "t")) == 1
    assert p.send_orderly_async("t", b"after", sharding_key="k").result(5).queue_offset == 1
    p.close()


def test_the_capacity_guard_fails_its_batch_with_broker_full(settings, r: redis.Redis) -> None:
    p = Producer(settings=settings, linger_ms=2)
    p.create_topic("t", queues=1)
    p.send_orderly_batch("t", [("k", b"x" * 1024) for _ in range(200)])
    r.config_set("maxmemory", int(int(r.info("memory")["used_memory"]) / 0.82))
    try:
        time.sleep(1.1)  # the guard's cached reading expires
        with pytest.raises(BrokerFullError, match="nothing was stored"):
            p.send_orderly_async("t", b"y", sharding_key="k").result(5)
    finally:
        r.config_set("maxmemory", 0)
    assert len(_log(p, "t")) == 200
    p.close()


def test_a_read_only_or_unknown_topic_fails_its_sends_and_not_the_others(settings) -> None:
    p = Producer(settings=settings, linger_ms=50)
    p.create_topic("open", queues=2)
    p.create_topic("closed", queues=2)
    p.topics.update_perm("closed", "r")
    ok = [p.send_orderly_async("open", b"%d" % i, sharding_key="k") for i in range(3)]
    refused = p.send_orderly_async("closed", b"x", sharding_key="k")
    unknown = p.send_orderly_async("nowhere", b"x", sharding_key="k")
    assert [f.result(5).queue_offset for f in ok] == [0, 1, 2]
    with pytest.raises(TopicNotWritableError, match="read-only"):
        refused.result(5)
    with pytest.raises(TopicNotFoundError, match="create it first"):
        unknown.result(5)
    assert _log(p, "closed") == {}
    p.close()


def test_bad_input_raises_in_the_callers_thread_and_sends_nothing(settings) -> None:
    p = Producer(settings=settings, linger_ms=50)
    p.create_topic("t", queues=2)
    with pytest.raises(MessageError, match="must be bytes"):
        p.send_orderly_async("t", "text", sharding_key="k")  # type: ignore[arg-type]
    with pytest.raises(MessageError, match="needs a sharding_key"):
        p.send_orderly_async("t", b"x", sharding_key=None)
    with pytest.raises(MessageError, match="sharding_key must be a str, bytes or int"):
        p.send_orderly_async("t", b"x", sharding_key=1.5)
    with pytest.raises(InvalidNameError):
        p.send_orderly_async("bad name!", b"x", sharding_key="k")
    with pytest.raises(MessageTooLargeError, match="max_message_size"):
        p.send_orderly_async("t", b"x" * (settings.max_message_size + 1), sharding_key="k")
    with pytest.raises(MessageError, match="dedup_key must be a non-empty str"):
        p.send_orderly_async("t", b"x", sharding_key="k", dedup_key="")
    with pytest.raises(ConfigError, match="linger_ms=-1: must be a number >= 0"):
        Producer(settings=settings, linger_ms=-1)
    with pytest.raises(ConfigError, match="batch_size=0"):
        Producer(settings=settings, batch_size=0)
    assert p._sender is None  # nothing got as far as the sender
    p.close()


def test_dedup_keys_keep_their_idempotency_through_the_batch(settings) -> None:
    p = Producer(settings=settings, linger_ms=20)
    p.create_topic("t", queues=2)
    first = p.send_orderly_async("t", b"paid", sharding_key="42", dedup_key="evt-9")
    again = p.send_orderly_async("t", b"paid", sharding_key="42", dedup_key="evt-9")  # same batch
    plain = p.send_orderly_async("t", b"plain", sharding_key="42")  # no key: not remembered
    assert again.result(5) == first.result(5)
    later = p.send_orderly_async("t", b"paid", sharding_key="42", dedup_key="evt-9")  # another batch
    assert later.result(5) == first.result(5)
    assert plain.result(5).queue_offset == first.result(0).queue_offset + 1
    assert len(_log(p, "t")) == 2
    p.close()


def test_close_sends_what_is_pending_then_refuses_more(settings) -> None:
    p = Producer(settings=settings, linger_ms=60_000)
    p.create_topic("t", queues=2)
    futures = [p.send_orderly_async("t", b"%d" % i, sharding_key="k") for i in range(5)]
    cancelled = p.send_orderly_async("t", b"never", sharding_key="k")
    assert cancelled.cancel()  # not yet sent: cancelling means it never is
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 5
    assert [f.result(0).queue_offset for f in futures] == [0, 1, 2, 3, 4]
    assert [body for _, body in _log(p, "t").values()] == [b"0", b"1", b"2", b"3", b"4"]
    with pytest.raises(ProducerClosedError, match="closed"):
        p.send_orderly_async("t", b"x", sharding_key="k")


def test_a_full_buffer_blocks_then_raises_and_frees_as_batches_complete(settings, r: redis.Redis) -> None:
    p = Producer(settings=settings, linger_ms=0, buffer_memory=3000, max_block_ms=300)
    p.create_topic("t", queues=1)
    p.send_orderly_async("t", b"warm", sharding_key="k").result(5)
    with pytest.raises(MessageTooLargeError, match="more than the whole buffer"):
        p.send_orderly_async("t", b"x" * 3000, sharding_key="k")
    r.execute_command("CLIENT", "PAUSE", 3000, "WRITE")  # the sender's next round trip hangs
    try:
        held = p.send_orderly_async("t", b"a" * 2000, sharding_key="k")
        t0 = time.monotonic()
        with pytest.raises(BufferExhaustedError, match="max_block_ms=300.*buffer_memory=3,000"):
            p.send_orderly_async("t", b"b" * 2000, sharding_key="k")
        assert 0.28 <= time.monotonic() - t0 < 2
        # Unpaused 50 ms in: `held`'s round trip then has 250 ms of max_block_ms to complete and
        # free its bytes (200 ms in, it once had 100 ms, too few on a loaded machine).
        threading.Timer(0.05, r.execute_command, ("CLIENT", "UNPAUSE")).start()
        t0 = time.monotonic()
        freed = p.send_orderly_async("t", b"c" * 2000, sharding_key="k")  # waits for `held` to complete
        assert 0.04 < time.monotonic() - t0 < 0.3 + 0.2
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    assert (held.result(5).queue_offset, freed.result(5).queue_offset) == (1, 2)
    p.close()


def test_a_forked_child_gets_a_sender_of_its_own(settings) -> None:
    p = Producer(settings=settings, linger_ms=2)
    p.create_topic("t", queues=2)
    assert p.send_orderly_async("t", b"parent", sharding_key="k").result(5).queue_offset == 0
    pid = os.fork()
    if pid == 0:  # the child: the parent's sender thread did not come along
        code = 1
        try:
            res = p.send_orderly_async("t", b"child", sharding_key="k").result(5)
            code = 0 if res.queue_offset == 1 and p._sender is not None and p._sender.pid == os.getpid() else 2
            p.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert p.send_orderly_async("t", b"parent again", sharding_key="k").result(5).queue_offset == 2
    assert [v[1] for _, v in sorted(_log(p, "t").items())] == [b"parent", b"child", b"parent again"]
    p.close()


def test_pending_sends_are_flushed_at_interpreter_exit(redis_url: str) -> None:
    script = (
        "from mqorder import Producer\n"
        f"p = Producer({redis_url!r}, linger_ms=60_000)\n"
        "p.create_topic('t', queues=1)\n"
        "for i in range(3):\n"
        "    p.send_orderly_async('t', b'%d' % i, sharding_key='k')\n"
    )  # no flush, no close: exit sends them
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=30)
    p = Producer(redis_url)
    assert [v[1] for _, v in sorted(_log(p, "t").items())] == [b"0", b"1", b"2"]
    p.close()


def test_sends_that_fail_at_interpreter_exit_are_logged(tmp_path) -> None:
    """A walk-through stopped Redis under pending sends: the exit flush failed them all and the
    script ended with status 0 and not a word."""
    from mqorder.testing.embedded import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    script = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from mqorder import Producer\n"
        f"p = Producer({dead!r}, linger_ms=60_000, send_msg_timeout_ms=500)\n"
        "for i in range(5):\n"
        "    p.send_orderly_async('t', b'%d' % i, sharding_key='k')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "5 of the 5 sends that send_orderly_async still held at interpreter exit failed" in done.stderr, done.stderr
    assert "BrokerUnavailableError" in done.stderr


def test_a_plain_send_after_async_sends_of_its_key_keeps_the_order_of_the_calls(redis_url: str) -> None:
    """Async A, then send_orderly B, then send_orderly_batch C, one thread, one key: stored B, C, A
    (the plain sends went straight to Redis while A lingered). They now wait for A."""
    p = Producer(redis_url, linger_ms=300)
    p.create_topic("mix", queues=2)
    a = p.send_orderly_async("mix", b"A", sharding_key="k")
    p.send_orderly("mix", b"B", sharding_key="k")
    p.send_orderly_batch("mix", [("k", b"C")])
    d = p.send_orderly_async("mix", b"D", sharding_key="k")
    p.send_orderly("mix", b"E", sharding_key="k", dedup_key="e-1")
    assert a.done() and d.done()
    assert [v[1] for _, v in sorted(_log(p, "mix").items())] == [b"A", b"B", b"C", b"D", b"E"]
    p.close()


def _sender_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "mqorder-sender" and t.is_alive()}


def test_close_racing_the_first_async_send_leaves_no_sender_thread_and_refuses_later_sends(settings) -> None:
    """``close()`` while another thread's first ``send_orderly_async`` starts the sender: that send
    either is refused or is sent by ``close()``; no sender thread outlives ``close()`` and no send
    after it is accepted. (``close()`` once set ``_closed`` without the sender lock, so a send past
    its check installed a sender after ``close()`` had looked: a leaked thread, sends accepted.)"""
    setup = Producer(settings=settings)
    setup.create_topic("t", queues=2)
    before = _sender_threads()
    rng = random.Random(7)
    accepted: list[Future[SendResult]] = []
    for _ in range(150):
        p = Producer(settings=settings, brokers=setup.brokers, linger_ms=0)
        p.describe_topic("t")  # routed: the send goes straight to the sender
        go = threading.Barrier(2)
        out: dict[str, object] = {}

        def send(p: Producer = p, go: threading.Barrier = go, out: dict[str, object] = out) -> None:
            go.wait()
            try:
                out["future"] = p.send_orderly_async("t", b"x", sharding_key="k")
            except ProducerClosedError as exc:
                out["refused"] = exc

        th = threading.Thread(target=send)
        th.start()
        go.wait()
        time.sleep(rng.uniform(0, 0.0004))  # around the send's way into the sender
        p.close()
        th.join()
        leaked = _sender_threads() - before
        assert not leaked, "close() returned with the producer's sender thread still running"
        if "future" in out:
            fut = out["future"]
            assert isinstance(fut, Future) and fut.done()  # sent (or failed) by close(), not left pending
            accepted.append(fut)
        with pytest.raises(ProducerClosedError, match="closed"):
            p.send_orderly_async("t", b"after close", sharding_key="k")
    assert len(_log(setup, "t")) == sum(1 for f in accepted if f.exception(0) is None)
    setup.close()


@pytest.mark.parametrize("kwargs", [{"linger_ms": float("inf")}, {"linger_ms": 1e20}, {"linger_ms": float("nan")},
                                    {"max_block_ms": float("inf")}, {"max_block_ms": 1e20}])
def test_waits_longer_than_a_thread_can_wait_are_refused_when_the_producer_is_built(settings, kwargs) -> None:
    """An infinite or huge ``linger_ms`` once killed the sender's thread (``Condition.wait`` raised
    ``OverflowError``) with its sends unresolved; ``max_block_ms`` raised it in the caller."""
    (name, value), = kwargs.items()
    longest = threading.TIMEOUT_MAX * 1000  # 9,223,372,036,000 on Linux
    expected = f"{name}={value!r}: must be a number >= 0 and <= {longest:,.0f}, the longest wait Python's threads"
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        Producer(settings=settings, **kwargs)
    p = Producer(settings=settings, linger_ms=longest, max_block_ms=longest)  # the longest wait is fine
    p.create_topic("t", queues=1)
    f = p.send_orderly_async("t", b"x", sharding_key="k")
    time.sleep(0.05)
    assert p._sender is not None and p._sender.alive and not f.done()
    p.flush(5)
    assert f.result(0).queue_offset == 0
    p.close()


def test_a_done_callback_raising_system_exit_neither_stops_the_sender_nor_strands_its_batch(settings) -> None:
    """Callbacks run in the sender's thread; ``Future`` lets a ``BaseException`` out of them, which
    once ended the thread with the rest of the batch unresolved and later sends queued forever."""
    p = Producer(settings=settings, linger_ms=50)
    p.create_topic("t", queues=1)
    first = p.send_orderly_async("t", b"a", sharding_key="k")
    first.add_done_callback(lambda f: sys.exit(3))
    same_batch = p.send_orderly_async("t", b"b", sharding_key="k")
    assert [first.result(2).queue_offset, same_batch.result(2).queue_offset] == [0, 1]
    assert p._sender is not None and p._sender.alive
    assert p.send_orderly_async("t", b"c", sharding_key="k").result(2).queue_offset == 2
    p.close()


def test_a_sender_thread_that_stops_fails_every_send_it_held_and_later_sends_raise(settings) -> None:
    """Whatever stops the sender's thread (here an exception raised into it from outside, as a
    debugger or a thread-killing library does), nothing waits on it forever: its sends fail with
    ``ProducerClosedError`` saying why, later sends raise it, ``close()`` returns at once."""

    class Killed(BaseException):
        pass

    p = Producer(settings=settings, linger_ms=60_000, batch_size=2)
    p.create_topic("t", queues=1)
    first = p.send_orderly_async("t", b"a", sharding_key="k")
    time.sleep(0.1)  # the sender lingers for a second send
    assert p._sender is not None
    thread = p._sender._thread
    assert thread.ident is not None
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Killed)) == 1
    second = p.send_orderly_async("t", b"b", sharding_key="k")  # the batch is full: it wakes, and stops
    thread.join(2)
    assert not thread.is_alive()
    for f in (first, second):
        with pytest.raises(ProducerClosedError, match=r"sender thread stopped on an unexpected error \(Killed\): "
                                                      "this send was not sent. Close this Producer"):
            f.result(2)
    with pytest.raises(ProducerClosedError, match=r"\(Killed\): send_orderly_async refused, nothing was sent"):
        p.send_orderly_async("t", b"c", sharding_key="k")
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 1
    assert _log(p, "t") == {}


def test_a_done_callback_may_send_on_a_full_buffer_without_waiting_for_itself(settings) -> None:
    """A callback sending its key's next message (it runs in the sender's thread) once waited
    ``max_block_ms`` for room only that thread frees, stalling every send, then dropped the
    message with a ``BufferExhaustedError`` blaming Redis. It is admitted at once now, within the
    room the batch in flight frees; past that room it is refused at once, saying why."""
    p = Producer(settings=settings, linger_ms=60_000, batch_size=4, buffer_memory=20_000, max_block_ms=1000)
    p.create_topic("t", queues=1)
    body = b"x" * 4000
    chained: list[Future[SendResult]] = []
    refused: list[BufferExhaustedError] = []

    def next_steps(_: Future[SendResult]) -> None:
        try:
            for _ in range(6):  # the batch in flight frees room for 4 of them
                chained.append(p.send_orderly_async("t", body, sharding_key="k"))
        except BufferExhaustedError as exc:
            refused.append(exc)

    first = p.send_orderly_async("t", body, sharding_key="k")
    first.add_done_callback(next_steps)
    t0 = time.monotonic()
    sent = [first] + [p.send_orderly_async("t", body, sharding_key="k") for _ in range(3)]  # a batch: ~16 KB
    other = p.send_orderly_async("t", b"other", sharding_key="other")
    sent[-1].result(2)  # the callback has run
    p.flush(2)
    assert time.monotonic() - t0 < 0.5  # nothing waited max_block_ms
    assert other.done() and all(f.done() for f in chained)
    offsets = [f.result(0).queue_offset for f in sent + chained]  # the key's, in call order
    assert offsets == sorted(offsets) and len(chained) == 4
    assert len(_log(p, "t")) == 4 + 1 + 4
    assert len(refused) == 1
    assert "from a future's done-callback found the producer's buffer full" in str(refused[0])
    assert "send it from another thread" in str(refused[0])
    p.close()


def test_a_topic_that_is_not_a_str_raises_as_send_orderly_does(settings) -> None:
    p = Producer(settings=settings, linger_ms=5)
    p.create_topic("t", queues=1)
    for topic in (["t"], None, b"t"):
        with pytest.raises(InvalidNameError, match="topic name must be a str"):
            p.send_orderly(topic, b"x", sharding_key="k")  # type: ignore[arg-type]
        with pytest.raises(InvalidNameError, match="topic name must be a str"):
            p.send_orderly_async(topic, b"x", sharding_key="k")  # type: ignore[arg-type]
    assert p._sender is None
    p.close()


def test_close_with_a_timeout_fails_what_is_unsent_and_leaves_the_batch_in_flight(settings, r: redis.Redis) -> None:
    """Kafka's ``close(timeout)``: a close that cannot finish in time (Redis hangs the batch being
    written) returns then; what was never sent fails at once (nothing of it stored), the batch in
    flight resolves when its round trip ends. Without the timeout close waits as long as the
    sender retries every batch still held."""
    p = Producer(settings=settings, linger_ms=0, batch_size=1)
    p.create_topic("t", queues=1)
    p.send_orderly_async("t", b"warm", sharding_key="k").result(5)
    for bad in (-1, float("nan"), "soon", True):
        with pytest.raises(ConfigError, match="timeout="):
            p.close(timeout=bad)  # type: ignore[arg-type]
    r.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # the sender's next round trip hangs
    try:
        in_flight = p.send_orderly_async("t", b"a", sharding_key="k")
        time.sleep(0.1)  # the sender took it: it is being written
        unsent = [p.send_orderly_async("t", b"b%d" % i, sharding_key="k") for i in range(5)]
        t0 = time.monotonic()
        p.close(timeout=0.3)
        assert time.monotonic() - t0 < 1.0
        for f in unsent:
            with pytest.raises(ProducerClosedError, match=r"close\(timeout=0.3\) gave up before this send was sent"):
                f.result(0)
        assert not in_flight.done()
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    assert in_flight.result(5).queue_offset == 1
    assert [body for _, body in _log(p, "t").values()] == [b"warm", b"a"]

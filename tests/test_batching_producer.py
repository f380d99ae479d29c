"""The batching producer (``Producer.send_orderly_async``, ``mqorder.client.batching``) against a
real redis-server: order and offsets under 32 threads, linger and batch size, refusals that fail
only their own futures, flush and close, a full buffer, a fork, interpreter exit, bad input."""

from __future__ import annotations

import os
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
    plain = p.send_orderly_async("t", b"plain", sharding_key="42")  # no key: a call of its own
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

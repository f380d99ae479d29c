"""Producer and topic routes against a real redis-server: sends, selectors, and bad input."""

from __future__ import annotations

import json
import time
import zlib

import pytest
import redis

from mqorder import Producer, keys
from mqorder.errors import (
    BrokerRefusedError,
    BrokerUnavailableError,
    ConfigError,
    InvalidNameError,
    MessageError,
    MessageTooLargeError,
    TopicExistsError,
    TopicNotFoundError,
    TopicNotWritableError,
)
from mqorder.model import MessageModel, MessageQueue
from mqorder.store.log import MessageLog


@pytest.fixture
def producer(settings):
    p = Producer(settings=settings)
    p.create_topic("orders", queues=8)
    yield p
    p.close()


def test_send_orderly_uses_crc32_mod_queue_count_and_contiguous_offsets(producer: Producer) -> None:
    results = [producer.send_orderly("orders", f"{i}".encode(), sharding_key="order-42") for i in range(5)]
    expected = zlib.crc32(b"order-42") % 8
    assert {r.message_queue.queue_id for r in results} == {expected}
    assert [r.queue_offset for r in results] == [0, 1, 2, 3, 4]
    assert len({r.msg_id for r in results}) == 5
    stored = MessageLog(producer.brokers).read(results[0].message_queue, 0, 10)
    assert [m.body for m in stored] == [b"0", b"1", b"2", b"3", b"4"]
    assert stored[0].store_timestamp >= stored[0].born_timestamp - 5000


def test_send_round_robins_over_queues(producer: Producer) -> None:
    qids = [producer.send("orders", b"x").message_queue.queue_id for _ in range(16)]
    assert sorted(set(qids)) == list(range(8))


def test_custom_selector_may_return_a_queue_or_an_index(producer: Producer) -> None:
    r1 = producer.send_orderly("orders", b"x", sharding_key="a", selector=lambda qs, k, b: qs[3])
    r2 = producer.send_orderly("orders", b"x", sharding_key="a", selector=lambda qs, k, b: 5)
    assert (r1.message_queue.queue_id, r2.message_queue.queue_id) == (3, 5)
    with pytest.raises(MessageError, match="index 99"):
        producer.send_orderly("orders", b"x", sharding_key="a", selector=lambda qs, k, b: 99)


def test_keys_tags_and_properties_are_stored(producer: Producer) -> None:
    r = producer.send_orderly("orders", b"x", sharding_key="k", keys=["k1", "k2"], tags="paid",
                              properties={"trace": "abc"})
    (m,) = MessageLog(producer.brokers).read(r.message_queue, r.queue_offset, 1)
    assert (m.keys, m.tags, m.properties, m.msg_id) == (["k1", "k2"], "paid", {"trace": "abc"}, r.msg_id)


def test_batch_keeps_per_key_order_and_refuses_whole_batch_on_bad_item(producer: Producer) -> None:
    items = [(f"k{i % 3}", f"{i}".encode()) for i in range(30)]
    results = producer.send_orderly_batch("orders", items)
    assert len(results) == 30
    log = MessageLog(producer.brokers)
    for key in ("k0", "k1", "k2"):
        mq = MessageQueue("orders", "broker-a", zlib.crc32(key.encode()) % 8)
        bodies = [int(m.body) for m in log.read(mq, 0, 100) if int(m.body) % 3 == int(key[1])]
        assert bodies == sorted(bodies) and len(bodies) == 10
    before = sum(log.max_offset(mq) for mq in producer.describe_topic("orders").message_queues)
    with pytest.raises(MessageError, match="item 2"):
        producer.send_orderly_batch("orders", [("a", b"1"), ("b", b"2"), ("c", "not bytes")])
    after = sum(log.max_offset(mq) for mq in producer.describe_topic("orders").message_queues)
    assert before == after  # nothing half-written


def test_keys_of_another_type_are_refused_and_a_batchs_keys_are_checked_as_sharding_keys(producer: Producer) -> None:
    """A producer's walk-through: keys={"order": 1} was stored as the text "{'order': 1}", a batch's
    list or surrogate sharding key was reported as `keys`, and a bytes one stored as "b'...'"."""
    log = MessageLog(producer.brokers)
    for bad in ({"order": 1}, {"a"}, b"k1", 1.5):
        with pytest.raises(MessageError, match=r"keys must be a str or a list of str, got"):
            producer.send_orderly("orders", b"x", sharding_key="k", keys=bad)
    r = producer.send_orderly("orders", b"x", sharding_key="k", keys=7)  # an int: as it hashes
    assert log.read(r.message_queue, r.queue_offset, 1)[0].keys == ["7"]
    with pytest.raises(MessageError, match=r"item 0: sharding_key must be a str, bytes or int, got list"):
        producer.send_orderly_batch("orders", [([1], b"x")])
    with pytest.raises(MessageError, match=r"item 0: sharding_key is not valid UTF-8 text"):
        producer.send_orderly_batch("orders", [("\ud800", b"x")])
    res = producer.send_orderly_batch("orders", [(b"k1", b"x"), (b"\xff\xfe", b"y"), (5, b"z")])
    assert [log.read(x.message_queue, x.queue_offset, 1)[0].keys for x in res] == [["k1"], [], ["5"]]


def test_create_topic_of_an_existing_topic_says_it_keeps_its_retention_and_perm(producer: Producer, caplog) -> None:
    """It kept them without a word: a deploy that changed its retention in code saw it ignored."""
    import logging

    producer.create_topic("kept", queues=1, retention_ms=1000)
    with caplog.at_level(logging.WARNING, logger="mqorder.store.topics"):
        producer.create_topic("kept", queues=1)  # the same: nothing to say
        assert caplog.text == ""
        route = producer.create_topic("kept", queues=1, retention_ms=999_999, perm="r")
    assert route.retention.retention_ms == 1000 and route.perm == "rw"  # kept, as documented
    assert "create_topic('kept'): the topic exists and keeps its perm 'rw' (asked 'r') and retention" in caplog.text
    assert "`mqorder topic retention`" in caplog.text


def test_every_send_after_close_is_refused_as_the_async_one_is(settings) -> None:
    """A producer's walk-through: after close(), send_orderly_async raised ProducerClosedError but
    send_orderly reconnected and sent (Kafka's producer refuses every send after close)."""
    from mqorder.client.transaction import LocalTransactionState, TransactionProducer
    from mqorder.errors import ProducerClosedError

    p = TransactionProducer(settings=settings)
    p.create_topic("orders", queues=8)
    p.close()
    for call in (lambda: p.send_orderly("orders", b"x", sharding_key="k"),
                 lambda: p.send("orders", b"x"),
                 lambda: p.send_orderly_batch("orders", [("k", b"x")]),
                 lambda: p.send_orderly_async("orders", b"x", sharding_key="k"),
                 lambda: p.send_in_transaction("orders", b"x", sharding_key="k",
                                               executor=lambda m, a: LocalTransactionState.COMMIT)):
        with pytest.raises(ProducerClosedError, match="this producer is closed"):
            call()
    with Producer(settings=settings) as fresh:
        assert all(fresh.topics.describe_topic("orders").message_queues)
        assert sum(MessageLog(fresh.brokers).max_offset(mq) for mq in fresh.describe_topic("orders").message_queues) == 0


def test_a_redis_that_comes_back_without_its_data_has_no_topics_for_the_producer() -> None:
    """An adversarial walk-through: after Redis restarted empty, a producer whose sends had failed
    meanwhile went on acknowledging sends into the vanished topic for up to its 30 s route cache."""
    from mqorder.errors import BrokerUnavailableError
    from mqorder.settings import load_settings
    from mqorder.testing.embedded import RedisServer, free_port

    port = free_port()
    srv = RedisServer(port=port).start()
    p = Producer(settings=load_settings(redis_url=f"redis://127.0.0.1:{port}/0", send_msg_timeout_ms=500))
    try:
        p.create_topic("w", queues=2)
        assert p.send_orderly("w", b"x", sharding_key="k").queue_offset == 0
        srv.stop()
        with pytest.raises(BrokerUnavailableError):
            p.send_orderly("w", b"x", sharding_key="k")
        srv = RedisServer(port=port).start()  # the same address, no data
        for _ in range(2):
            with pytest.raises(TopicNotFoundError, match="does not exist"):
                p.send_orderly("w", b"x", sharding_key="k")
    finally:
        p.close()
        srv.stop()


def test_unknown_topic_is_refused_with_how_to_create_it(producer: Producer) -> None:
    with pytest.raises(TopicNotFoundError, match="create_topic"):
        producer.send_orderly("nope", b"x", sharding_key="k")


@pytest.mark.parametrize("queues", [0, -1, 1025, "8", 2.5, True])
def test_bad_queue_counts_are_refused(producer: Producer, queues: object) -> None:
    with pytest.raises(ConfigError, match="queues"):
        producer.create_topic("other", queues=queues)  # type: ignore[arg-type]


def test_recreating_a_topic_with_another_layout_is_refused(producer: Producer) -> None:
    assert producer.create_topic("orders", queues=8).queue_count == 8
    with pytest.raises(TopicExistsError, match="already exists"):
        producer.create_topic("orders", queues=4)


@pytest.mark.parametrize("name", ["", "has space", "a{b}", "x" * 200, "%DLQ%mine"])
def test_bad_topic_names_are_refused(producer: Producer, name: str) -> None:
    with pytest.raises(InvalidNameError):
        producer.create_topic(name, queues=1)


def test_oversized_body_is_refused_and_nothing_is_written(settings) -> None:
    p = Producer(settings=settings, max_message_size=1024)
    p.create_topic("orders", queues=1)
    with pytest.raises(MessageTooLargeError, match="1,025 bytes"):
        p.send_orderly("orders", b"x" * 1025, sharding_key="k")
    assert MessageLog(p.brokers).max_offset(MessageQueue("orders", "broker-a", 0)) == 0
    assert p.send_orderly("orders", b"x" * 1024, sharding_key="k").queue_offset == 0


@pytest.mark.parametrize("body", ["text", 42, None, {"a": 1}])
def test_non_bytes_body_is_refused_with_a_hint(producer: Producer, body: object) -> None:
    with pytest.raises(MessageError, match="must be bytes"):
        producer.send_orderly("orders", body, sharding_key="k")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [None, 1.5, ["a"], True])
def test_bad_sharding_keys_are_refused(producer: Producer, key: object) -> None:
    with pytest.raises(MessageError):
        producer.send_orderly("orders", b"x", sharding_key=key)


def test_unreachable_redis_gives_a_clear_error() -> None:
    from mqorder.testing.embedded import free_port

    p = Producer(f"redis://127.0.0.1:{free_port()}/0", send_msg_timeout_ms=500)
    with pytest.raises(BrokerUnavailableError, match="could not be reached"):
        p.create_topic("orders", queues=1)


def test_a_redis_that_refuses_writes_gives_a_clear_error_and_stores_nothing() -> None:
    """E.g. a full disk (MISCONF) or maxmemory reached (OOM): say so, and store nothing.

    The producer's capacity guard (``BrokerFullError``) usually answers first; here its memory
    reading is still the cached one from before the limit dropped (it is trusted for about a
    second), so Redis's own refusal is what reaches the caller, and it must be as clear."""
    from mqorder.testing.embedded import RedisServer

    with RedisServer() as srv:
        p = Producer(srv.url)
        try:
            p.create_topic("orders", queues=2)
            r = redis.Redis.from_url(srv.url)
            r.config_set("maxmemory-policy", "noeviction")
            for name in p.brokers.names:  # the guard reads memory now: no limit yet
                p.appender.guard.before_send(p.brokers.get(name))
            r.config_set("maxmemory", 1)
            with pytest.raises(BrokerRefusedError, match="refused the write, so nothing was stored: OOM"):
                p.send_orderly("orders", b"x", sharding_key="k")
            with pytest.raises(BrokerRefusedError, match="OOM"):
                p.send_orderly_batch("orders", [("k", b"y"), ("j", b"z")])
            r.config_set("maxmemory", 0)
            log = MessageLog(p.brokers)
            mqs = p.describe_topic("orders").message_queues
            assert [log.max_offset(mq) for mq in mqs] == [0, 0]
            assert p.send_orderly("orders", b"x", sharding_key="k").queue_offset == 0
            r.close()
        finally:
            p.close()


def test_a_batch_refused_on_one_queue_after_others_were_stored_says_what_was_stored(
    settings, r: redis.Redis, redis_server,
) -> None:
    """Redis judges each call of a round trip on arrival: queues 0-2 of a batch stored, queue 3's
    call refused (NOPERM here; OOM near maxmemory alike). The error said "nothing was stored", and
    the resend it invited stored queues 0-2 twice."""
    from mqorder.client.selector import queue_index
    from mqorder.settings import load_settings

    admin = Producer(settings=settings)
    admin.create_topic("t", queues=4)
    admin.send_orderly("t", b"warm", sharding_key="warm")  # send.lua loaded, as on any running Redis
    r.acl_setuser("limited", enabled=True, passwords=["+pw"], commands=["+@all"],
                  keys=["mqorder:[^{]*", "mqorder:{t:broker-a:[012]}*"])
    p = Producer(settings=load_settings(redis_url=f"redis://limited:pw@127.0.0.1:{redis_server.port}/0"))
    try:
        ks = [next(f"k{i}" for i in range(1000) if queue_index(f"k{i}", 4) == q) for q in range(4)]
        with pytest.raises(BrokerRefusedError, match="refused a write of this batch: NOPERM.*Part of the batch is "
                                                     "stored: 3 message.s. of the batch ARE stored. Resending the "
                                                     "whole batch stores those again unless its sends have dedup keys"):
            p.send_orderly_batch("t", [(k, b"m-" + k.encode()) for k in ks])
        # Refused whole (every call): nothing of it stored, and the error says that.
        r.config_set("min-replicas-to-write", 1)
        try:
            with pytest.raises(BrokerRefusedError, match="refused the write, so nothing was stored: NOREPLICAS"):
                admin.send_orderly_batch("t", [(k, b"never") for k in ks])
        finally:
            r.config_set("min-replicas-to-write", 0)
        with pytest.raises(BrokerRefusedError, match="refused the write, so nothing was stored: NOPERM"):
            p.send_orderly("t", b"alone", sharding_key=ks[3])  # one call: nothing stored, as said
    finally:
        p.close()
        r.acl_deluser("limited")
        admin.close()


def test_password_never_appears_in_errors(redis_server) -> None:
    from mqorder.testing.embedded import free_port

    p = Producer(f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0", send_msg_timeout_ms=500)
    with pytest.raises(BrokerUnavailableError) as exc:
        p.create_topic("orders", queues=1)
    assert "s3cret-pw" not in str(exc.value) and "***" in str(exc.value)


def test_send_wakes_the_owner_once_per_idle_queue(producer: Producer, r: redis.Redis) -> None:
    mq = MessageQueue("orders", "broker-a", zlib.crc32(b"k") % 8)
    producer.topics.subscribe("g", "orders", MessageModel.CLUSTERING)
    sec, _ = r.time()
    r.hset(keys.sub_state(mq.tag, "g"), mapping={"owner": "w1", "lease": (sec + 60) * 1000})
    ps = r.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.wake_channel("w1"))
    producer.appender._subs.clear()
    for _ in range(5):
        producer.send_orderly("orders", b"x", sharding_key="k")
    wakes = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        m = ps.get_message(timeout=0.1)
        if m is not None:
            wakes.append(m)
    assert len(wakes) == 1  # one pending ConsumeRequest per queue, not one per message
    sub, mq_key, token = json.loads(wakes[0]["data"])
    assert (sub, mq_key) == ("g", mq.key)
    assert r.hget(keys.sub_state(mq.tag, "g"), "pending").decode() == token


def test_wake_nobody_heard_leaves_the_queue_to_the_sweep(producer: Producer, r: redis.Redis) -> None:
    mq = MessageQueue("orders", "broker-a", zlib.crc32(b"k") % 8)
    producer.topics.subscribe("g", "orders", MessageModel.CLUSTERING)
    sec, _ = r.time()
    r.hset(keys.sub_state(mq.tag, "g"), mapping={"owner": "w-offline", "lease": (sec + 60) * 1000})
    producer.appender._subs.clear()
    producer.send_orderly("orders", b"x", sharding_key="k")
    # No subscriber on the owner's wake channel: no pending token that nobody would act on.
    assert r.hget(keys.sub_state(mq.tag, "g"), "pending") in (None, b"")


def test_a_read_only_topic_refuses_sends_and_stores_nothing(producer: Producer) -> None:
    producer.create_topic("ro", queues=2, perm="r")
    with pytest.raises(TopicNotWritableError, match="read-only.*mqorder topic perm ro rw"):
        producer.send_orderly("ro", b"x", sharding_key="k")
    with pytest.raises(TopicNotWritableError):
        producer.send_orderly_batch("ro", [("k", b"x")])
    log = MessageLog(producer.brokers)
    assert all(log.max_offset(mq) == 0 for mq in producer.describe_topic("ro").message_queues)


@pytest.mark.parametrize("perm", ["", "x", "wr", "RW", None, 6])
def test_bad_topic_permissions_are_refused_with_the_choices(producer: Producer, perm: object) -> None:
    if perm is None:  # create_topic's default (rw); update_perm needs one
        assert producer.create_topic("p", queues=1, perm=perm).perm == "rw"
    else:
        with pytest.raises(ConfigError, match="rw, r, w"):
            producer.create_topic("p", queues=1, perm=perm)  # type: ignore[arg-type]
    producer.create_topic("p", queues=1)
    with pytest.raises(ConfigError, match="rw, r, w"):
        producer.topics.update_perm("p", perm)  # type: ignore[arg-type]


def test_perm_of_an_unknown_topic_cannot_be_changed(producer: Producer) -> None:
    with pytest.raises(TopicNotFoundError):
        producer.topics.update_perm("nope", "rw")


def test_a_send_whose_subscription_read_fails_says_the_broker_is_unavailable() -> None:
    """The append reads the topic's subscriptions (cached for a second) before its script: when
    Redis is gone by then, the caller gets ``BrokerUnavailableError``, not redis-py's error (seen as
    raw ``ConnectionError`` from ``send_orderly`` during a Sentinel failover)."""
    from mqorder.errors import BrokerUnavailableError
    from mqorder.settings import load_settings
    from mqorder.testing.embedded import RedisServer

    srv = RedisServer().start()
    try:
        p = Producer(settings=load_settings(redis_url=srv.url, send_msg_timeout_ms=500))
        p.create_topic("t", queues=1)
        p.send_orderly("t", b"1", sharding_key="k")  # the route and subscriptions are cached now
        srv.kill()
        p.appender._subs.clear()  # the subscription cache expired (SUBS_TTL), the route's not yet
        with pytest.raises(BrokerUnavailableError, match="could not be reached"):
            p.send_orderly("t", b"2", sharding_key="k")
        p.close()
    finally:
        srv.stop()

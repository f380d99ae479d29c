"""Producer idempotence against a real redis-server: dedup keys, their window, and retries after a
lost reply (a proxy drops Redis's answer: stored, but the producer times out) that neither
duplicate nor reorder."""

from __future__ import annotations

import time

import pytest
import redis

from mqorder import Producer, keys
from mqorder.errors import BrokerUnavailableError, ConfigError, MessageError
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog


@pytest.fixture
def producer(settings):
    p = Producer(settings=settings)
    p.create_topic("orders", queues=4)
    yield p
    p.close()


def bodies(p: Producer, mq: MessageQueue) -> list[bytes]:
    return [m.body for m in MessageLog(p.brokers).read(mq, 0, 1000)]


def test_a_resend_of_a_key_returns_the_first_result_and_stores_nothing(producer: Producer) -> None:
    first = producer.send_orderly("orders", b"paid", sharding_key="42", dedup_key="evt-1")
    again = producer.send_orderly("orders", b"paid (resent)", sharding_key="42", dedup_key="evt-1")
    other = producer.send_orderly("orders", b"shipped", sharding_key="42", dedup_key="evt-2")
    assert again == first
    assert other.queue_offset == first.queue_offset + 1
    assert bodies(producer, first.message_queue) == [b"paid", b"shipped"]


def test_a_resent_batch_returns_the_first_results_and_stores_nothing(producer: Producer) -> None:
    items = [(f"k{i % 3}", f"{i}".encode()) for i in range(9)]
    keys_ = [f"evt-{i}" for i in range(9)]
    first = producer.send_orderly_batch("orders", items, dedup_keys=keys_)
    again = producer.send_orderly_batch("orders", items + [("k0", b"new")], dedup_keys=keys_ + ["evt-9"])
    assert again[:9] == first
    assert again[9].queue_offset == max(r.queue_offset for r in first if r.message_queue == again[9].message_queue) + 1
    total = sum(MessageLog(producer.brokers).max_offset(mq) for mq in producer.describe_topic("orders").message_queues)
    assert total == 10
    twice = producer.send_orderly_batch("orders", [("k", b"a"), ("k", b"a again")], dedup_keys=["same", "same"])
    assert twice[0] == twice[1]
    with pytest.raises(MessageError, match="one key per item"):
        producer.send_orderly_batch("orders", items, dedup_keys=keys_[:3])


def test_keyed_send_without_sharding_key_picks_its_queue_by_key(producer: Producer) -> None:
    a = producer.send("orders", b"x", dedup_key="k-1")
    b = producer.send("orders", b"x again", dedup_key="k-1")
    assert a == b
    assert sum(MessageLog(producer.brokers).max_offset(mq) for mq in producer.describe_topic("orders").message_queues) == 1


def test_the_window_forgets_keys_and_stays_bounded(settings, r: redis.Redis) -> None:
    p = Producer(settings=settings, dedup_window_ms=1000)
    p.create_topic("orders", queues=1)
    mq = p.describe_topic("orders").message_queues[0]
    for i in range(50):
        p.send_orderly("orders", b"x", sharding_key="k", dedup_key=f"evt-{i}")
    assert r.hlen(keys.queue_dedup(mq.tag)) == 50
    assert 0 < r.pttl(keys.queue_dedup(mq.tag)) <= 1000
    assert r.hlen(keys.queue_ids(mq.tag)) == 0  # the Spark writer's permanent ids are untouched
    time.sleep(0.6)
    p.send_orderly("orders", b"x", sharding_key="k", dedup_key="late")  # keeps the keys alive 1 s more
    time.sleep(0.5)  # the first 50 are out of their window, "late" is not
    again = p.send_orderly("orders", b"x", sharding_key="k", dedup_key="evt-0")
    assert again.queue_offset == 51  # stored again: its window ended
    # One send forgets at most 2n + 16 = 18 expired keys: bounded work per call, and it only shrinks.
    assert r.zcard(keys.queue_dedup_expiry(mq.tag)) == 51 - 18 + 1
    assert r.hlen(keys.queue_dedup(mq.tag)) == 51 - 18 + 1
    for i in range(3):
        p.send_orderly("orders", b"x", sharding_key="k", dedup_key=f"new-{i}")
    assert r.hlen(keys.queue_dedup(mq.tag)) == 5  # the 32 expired gone after two sends; 5 live keys
    time.sleep(1.1)
    assert not r.exists(keys.queue_dedup(mq.tag), keys.queue_dedup_expiry(mq.tag))  # idle: nothing kept
    p.close()


def test_content_based_dedup_drops_an_identical_body(settings) -> None:
    p = Producer(settings=settings, dedup_derive="content")
    p.create_topic("orders", queues=2)
    a = p.send_orderly("orders", b"same", sharding_key="k")
    b = p.send_orderly("orders", b"same", sharding_key="k")
    c = p.send_orderly("orders", b"different", sharding_key="k")
    assert a == b and c.queue_offset == a.queue_offset + 1
    p.close()


def test_bad_dedup_settings_and_keys_are_refused_clearly(settings, producer: Producer) -> None:
    with pytest.raises(ConfigError, match="MQORDER_DEDUP_DERIVE"):
        Producer(settings=settings, dedup_derive="sha1")
    with pytest.raises(MessageError, match="dedup_key must be a non-empty str"):
        producer.send_orderly("orders", b"x", sharding_key="k", dedup_key="")
    with pytest.raises(MessageError, match="over 128"):
        producer.send_orderly("orders", b"x", sharding_key="k", dedup_key="x" * 129)
    with pytest.raises(MessageError, match="dedup_key is not valid UTF-8"):
        producer.send_orderly("orders", b"x", sharding_key="k", dedup_key="evt-\ud800")


def test_a_bad_dedup_key_fails_at_the_call_not_the_batch_it_would_have_joined(settings) -> None:
    """Once a lone surrogate passed the check and failed only when the batching sender packed the
    round trip: every other send of the batch (other keys, other queues) failed with it."""
    p = Producer(settings=settings, linger_ms=200)
    p.create_topic("t", queues=4)
    good = [p.send_orderly_async("t", b"m%d" % i, sharding_key=f"k{i}") for i in range(6)]
    with pytest.raises(MessageError, match="not valid UTF-8"):
        p.send_orderly_async("t", b"bad", sharding_key="x", dedup_key="evt-\ud800")
    assert all(f.result(timeout=10).queue_offset >= 0 for f in good)
    p.close()


def test_a_batch_mixing_dedup_keys_and_none_dedups_only_the_keyed_items(producer: Producer) -> None:
    """Once the first item decided for the batch: after a key, every None became the dedup id
    'None' (items dropped as duplicates of each other, SEND_OK with another's result); after a
    None, the keys given were ignored (their resends stored twice)."""
    res = producer.send_orderly_batch("orders", [("k", b"one"), ("k", b"two"), ("k", b"three")],
                                      dedup_keys=["a", None, None])
    producer.send_orderly_batch("orders", [("k", b"four"), ("k", b"five")], dedup_keys=["b", None])
    producer.send_orderly_batch("orders", [("k", b"six"), ("k", b"seven")], dedup_keys=[None, "c"])
    again = producer.send_orderly_batch("orders", [("k", b"seven"), ("k", b"one")], dedup_keys=["c", "a"])
    mq = res[0].message_queue
    assert bodies(producer, mq) == [b"one", b"two", b"three", b"four", b"five", b"six", b"seven"]
    assert [r.queue_offset for r in res] == [0, 1, 2]
    assert [r.queue_offset for r in again] == [6, 0]  # the first sends' results


def test_a_batch_alternating_keyed_and_plain_items_is_one_script_call(producer: Producer, r: redis.Redis) -> None:
    """Runs alike in having a key went in calls of their own, one round trip after the other on
    one queue: a batch alternating the two took a round trip per item (177 ms for 1,000 items
    against 46 ms unkeyed). Now one call, and only the keyed items are remembered."""
    items = [("k", b"%d" % i) for i in range(40)]
    keys_ = [f"evt-{i}" if i % 2 == 0 else None for i in range(40)]
    producer.send_orderly("orders", b"warm", sharding_key="k")  # routes and scripts loaded
    calls = r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    res = producer.send_orderly_batch("orders", items, dedup_keys=keys_)
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] - calls == 1
    assert [x.queue_offset for x in res] == list(range(1, 41))
    again = producer.send_orderly_batch("orders", items, dedup_keys=keys_)
    # The keyed items are duplicates (their first results); the plain ones are stored again.
    assert [x.queue_offset for x in again[0::2]] == list(range(1, 41, 2))
    assert [x.queue_offset for x in again[1::2]] == list(range(41, 61))
    assert bodies(producer, res[0].message_queue)[41:] == [b"%d" % i for i in range(1, 40, 2)]


def test_an_id_past_its_window_is_new_even_before_the_window_is_trimmed(settings) -> None:
    """The expired backlog is trimmed 2n + 16 ids per keyed send; after a burst, an id past its
    window still waited there and a send reusing it was dropped as a duplicate."""
    p = Producer(settings=settings, dedup_window_ms=300)
    p.create_topic("t", queues=1)
    for b in range(3):  # a burst of 600 keyed sends
        p.send_orderly_batch("t", [("k", b"burst")] * 200, dedup_keys=[f"evt-{b * 200 + i}" for i in range(200)])
    # A trickle of keyed sends keeps the window's keys alive (each trims 18 expired ids) until
    # every burst id's window ended; then an old id is sent again.
    for i in range(5):
        time.sleep(0.1)
        p.send_orderly("t", b"trickle", sharding_key="k", dedup_key=f"trickle-{i}")
    res = p.send_orderly("t", b"evt-599 again", sharding_key="k", dedup_key="evt-599")
    assert res.queue_offset == 605
    assert bodies(p, res.message_queue)[-1] == b"evt-599 again"
    p.close()


def test_a_shorter_window_of_another_producer_does_not_cut_a_longer_one(settings) -> None:
    """Each keyed send set the whole dedup HASH's expiry to its own window: a producer with a
    200 ms window made another's 300 s window forget its ids (a resend 0.5 s later stored twice)."""
    long_p = Producer(settings=settings, dedup_window_ms=300_000)
    short_p = Producer(settings=settings, dedup_window_ms=200)
    long_p.create_topic("t", queues=1)
    first = long_p.send_orderly("t", b"paid", sharding_key="42", dedup_key="evt-9")
    short_p.send_orderly("t", b"other", sharding_key="42", dedup_key="evt-other")
    time.sleep(0.5)
    again = long_p.send_orderly("t", b"paid", sharding_key="42", dedup_key="evt-9")
    assert again.queue_offset == first.queue_offset
    assert bodies(long_p, first.message_queue) == [b"paid", b"other"]
    long_p.close()
    short_p.close()


@pytest.fixture
def proxy(redis_url: str):
    from urllib.parse import urlsplit

    from tests.lossy_proxy import LossyProxy

    u = urlsplit(redis_url)
    px = LossyProxy(u.hostname or "127.0.0.1", u.port or 6379)
    yield px
    px.close()


def test_retries_after_a_lost_reply_neither_duplicate_nor_reorder(settings, proxy) -> None:
    """Redis stores A1 but its reply is lost twice: the producer times out, sends again, and gets
    the first send's result; A2 follows A1 and nothing is stored twice."""
    p = Producer(settings=settings, redis_url=proxy.url(), send_msg_timeout_ms=500, dedup_derive="msg_id")
    p.create_topic("orders", queues=1)
    mq = p.describe_topic("orders").message_queues[0]
    p.send_orderly("orders", b"A0", sharding_key="k")
    proxy.lose_next_replies(2)
    a1 = p.send_orderly("orders", b"A1", sharding_key="k")
    a2 = p.send_orderly("orders", b"A2", sharding_key="k")
    assert bodies(p, mq) == [b"A0", b"A1", b"A2"]
    assert (a1.queue_offset, a2.queue_offset) == (1, 2)
    (stored,) = MessageLog(p.brokers).read(mq, 1, 1)
    assert a1.msg_id == stored.msg_id
    p.close()


def test_a_batch_whose_reply_was_lost_is_sent_again_without_duplicates(settings, proxy) -> None:
    p = Producer(settings=settings, redis_url=proxy.url(), send_msg_timeout_ms=500, dedup_derive="msg_id")
    p.create_topic("orders", queues=1)
    mq = p.describe_topic("orders").message_queues[0]
    p.send_orderly("orders", b"A0", sharding_key="k")
    proxy.lose_next_replies(1)
    results = p.send_orderly_batch("orders", [("k", b"A1"), ("k", b"A2")])
    assert bodies(p, mq) == [b"A0", b"A1", b"A2"]
    assert [r.queue_offset for r in results] == [1, 2]
    assert [r.msg_id for r in results] == [m.msg_id for m in MessageLog(p.brokers).read(mq, 1, 2)]
    p.close()


def test_without_a_key_a_lost_reply_stores_the_send_twice(settings, proxy) -> None:
    """The failure a dedup key prevents: the same lost reply, and a retry (redis-py's own, here)."""
    p = Producer(settings=settings, redis_url=proxy.url(), send_msg_timeout_ms=500)
    p.create_topic("orders", queues=1)
    mq = p.describe_topic("orders").message_queues[0]
    p.send_orderly("orders", b"A0", sharding_key="k")
    proxy.lose_next_replies(1)
    try:
        p.send_orderly("orders", b"A1", sharding_key="k")
    except BrokerUnavailableError:
        p.send_orderly("orders", b"A1", sharding_key="k")  # what an application does after a timeout
    assert bodies(p, mq) == [b"A0", b"A1", b"A1"]
    p.close()

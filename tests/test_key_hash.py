"""The sharding key's hash is stored with every message, on every append path (issue 14, key mode).

Key-ordered listeners (``ordering="key"``) tell the keys of one queue apart by header field ``h``
= ``crc32(utf8(key))``: the producer's ``send_orderly`` and ``send_orderly_batch``, the Spark
writer, the DLQ writer and a DLQ replay must all write the same number for the same key.
"""

from __future__ import annotations

import json
import zlib

import pytest

from mqorder import Producer
from mqorder.client.selector import key_hash
from mqorder.codec import decode_entries, encode_header
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog

MQ = MessageQueue("orders", "broker-a", 3)


def _entry(offset: int, header: bytes) -> tuple:
    return (f"{offset}-1".encode(), [b"h", header, b"b", b"x", b"s", b"1"])


def test_key_hash_is_crc32_of_the_keys_utf8_bytes() -> None:
    assert key_hash("order-42") == zlib.crc32(b"order-42")
    assert key_hash(42) == zlib.crc32(b"42")  # an int key hashes like its decimal text
    assert key_hash("é") == zlib.crc32("é".encode())
    assert key_hash(object()) is None  # a custom selector's key: one key per queue


def test_header_round_trips_the_key_hash() -> None:
    [m] = decode_entries(MQ, [_entry(0, encode_header("M1", key_hash=123456))])
    assert m.key_hash == 123456 and m.decode_error is None
    [m] = decode_entries(MQ, [_entry(0, encode_header("M2", properties={"a": "1"}, key_hash=7))])
    assert m.key_hash == 7 and m.decode_error is None  # the careful path keeps it too
    [m] = decode_entries(MQ, [_entry(0, encode_header("M3"))])
    assert m.key_hash is None


def test_a_non_integer_key_hash_makes_a_poison_message_with_a_reason() -> None:
    [m] = decode_entries(MQ, [_entry(0, json.dumps({"i": "M", "b": 1, "h": "abc"}).encode())])
    assert m.decode_error == "header field 'h' (sharding key hash) is not an integer"


@pytest.fixture
def producer(settings):
    p = Producer(settings=settings)
    p.create_topic("orders", queues=4)
    yield p
    p.close()


def test_send_orderly_and_send_orderly_batch_store_the_key_hash(producer: Producer) -> None:
    a = producer.send_orderly("orders", b"1", sharding_key="acct-1")
    producer.send_orderly_batch("orders", [("acct-1", b"2"), (77, b"3")])
    plain = producer.send("orders", b"no key")
    log = MessageLog(producer.brokers)
    stored = log.read(a.message_queue, 0, 10)
    assert [(m.body, m.key_hash) for m in stored[:2]] == [(b"1", zlib.crc32(b"acct-1")), (b"2", zlib.crc32(b"acct-1"))]
    q77 = producer.describe_topic("orders").message_queues[zlib.crc32(b"77") % 4]
    assert [m.key_hash for m in log.read(q77, 0, 10) if m.body == b"3"] == [zlib.crc32(b"77")]
    [m] = [m for m in log.read(plain.message_queue, plain.queue_offset, 1)]
    assert m.key_hash is None  # sent without a key: one key per queue


def test_the_dlq_writer_keeps_the_key_hash_for_a_replay(producer: Producer, settings) -> None:
    from mqorder.consumer.engine import ConsumerEngine

    res = producer.send_orderly("orders", b"poison", sharding_key="k9")
    [m] = MessageLog(producer.brokers).read(res.message_queue, res.queue_offset, 1)
    engine = ConsumerEngine(settings, "w1@test")
    engine.dlq.send("billing", m, "test", 1)
    dlq = MessageQueue("%DLQ%billing", producer.brokers.default_name, 0)
    [dead] = MessageLog(producer.brokers).read(dlq, 0, 1)
    assert dead.key_hash == zlib.crc32(b"k9")

"""Unit tests of the message queue selectors (no Redis, no Celery)."""

from __future__ import annotations

import enum
import zlib

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mqorder.client.selector import key_bytes, key_hash, queue_index, resolve, select_by_hash
from mqorder.errors import MessageError
from mqorder.model import MessageQueue

QUEUE_COUNTS = st.integers(1, 1024)


def topic_queues(n: int) -> list[MessageQueue]:
    return [MessageQueue("orders", "broker-a", i) for i in range(n)]


# -- queue_index ----------------------------------------------------------------------------------


def test_queue_index_matches_spark_crc32_of_known_value() -> None:
    # Spark's documentation: SELECT crc32('Spark') -> 1557323817; pmod(1557323817, 16) == 9
    assert queue_index("Spark", 16) == 1557323817 % 16 == 9
    assert queue_index("Spark", 1) == 0


@given(key=st.text(), n=QUEUE_COUNTS)
@example(key="", n=8)
@example(key="订单-42", n=16)
@example(key="ключ", n=7)
@example(key="🚀 emoji", n=5)
@example(key="e\u0301", n=3)  # combining accent: hashed as given, never normalised
def test_str_key_index_is_crc32_of_utf8_mod_queue_count(key: str, n: int) -> None:
    idx = queue_index(key, n)
    assert idx == zlib.crc32(key.encode("utf-8")) % n
    assert 0 <= idx < n


def test_empty_str_key_goes_to_queue_zero() -> None:
    assert queue_index("", 16) == 0  # crc32(b"") == 0


@given(key=st.binary(), n=QUEUE_COUNTS)
def test_bytes_key_is_hashed_as_is(key: bytes, n: int) -> None:
    assert queue_index(key, n) == zlib.crc32(key) % n


def test_non_utf8_bytes_key_is_accepted() -> None:
    assert queue_index(b"\xff\xfe\x00", 10) == zlib.crc32(b"\xff\xfe\x00") % 10


@given(key=st.integers(), n=QUEUE_COUNTS)
@example(key=0, n=4)
@example(key=-17, n=4)
def test_int_key_hashes_like_its_decimal_string(key: int, n: int) -> None:
    assert queue_index(key, n) == zlib.crc32(str(key).encode("ascii")) % n
    assert queue_index(key, n) == queue_index(str(key), n)


class Shop(int, enum.Enum):
    BERLIN = 7


def test_an_int_subclass_key_hashes_as_its_number_not_its_name() -> None:
    """``str(Shop.BERLIN)`` is ``'Shop.BERLIN'``: hashed so, the key 7 went to two queues (and two
    key lanes) depending on how it was spelt, and Spark's ``crc32`` of the number disagreed."""
    assert Shop.BERLIN == 7
    assert queue_index(Shop.BERLIN, 8) == queue_index(7, 8)
    assert key_hash(Shop.BERLIN) == key_hash(7) == key_hash("7")


@pytest.mark.parametrize(
    ("key", "type_name"),
    [(1.5, "float"), (None, "NoneType"), (["a"], "list"), ({"a": 1}, "dict"), (bytearray(b"a"), "bytearray")],
)
def test_unsupported_key_types_raise_message_error_naming_the_type(key: object, type_name: str) -> None:
    with pytest.raises(MessageError, match=r"sharding_key must be a str, bytes or int") as info:
        queue_index(key, 8)
    assert f"got {type_name}" in str(info.value)
    assert "string" in str(info.value)  # tells the user what to pass instead


@pytest.mark.parametrize("key", [True, False])
def test_bool_key_is_refused_although_bool_is_an_int(key: bool) -> None:
    with pytest.raises(MessageError, match="not bool"):
        queue_index(key, 8)
    with pytest.raises(MessageError):
        key_bytes(key)


@pytest.mark.parametrize("key", [1.0, float("nan")])
def test_float_key_is_refused_even_when_integral(key: float) -> None:
    with pytest.raises(MessageError, match="got float"):
        queue_index(key, 8)


# -- select_by_hash -------------------------------------------------------------------------------


@given(key=st.one_of(st.text(), st.binary(), st.integers()), n=st.integers(1, 64))
def test_select_by_hash_picks_the_queue_at_the_hashed_index(key: object, n: int) -> None:
    qs = topic_queues(n)
    mq = select_by_hash(qs, key, b"body")
    assert mq is qs[queue_index(key, n)]
    assert mq.queue_id == zlib.crc32(key_bytes(key)) % n


def test_select_by_hash_ignores_the_body() -> None:
    qs = topic_queues(8)
    assert select_by_hash(qs, "order-42", b"a") is select_by_hash(qs, "order-42", b"something else")
    assert select_by_hash(qs, "order-42", b"a") is qs[1475806942 % 8]


def test_select_by_hash_refuses_bad_key_type() -> None:
    with pytest.raises(MessageError):
        select_by_hash(topic_queues(4), 3.14, b"")


# -- resolve --------------------------------------------------------------------------------------


def test_resolve_accepts_a_queue_of_the_list() -> None:
    qs = topic_queues(4)
    assert resolve(qs[2], qs) is qs[2]
    # an equal (not identical) MessageQueue is the same queue
    assert resolve(MessageQueue("orders", "broker-a", 3), qs) == qs[3]


@pytest.mark.parametrize(
    "foreign",
    [
        MessageQueue("orders", "broker-a", 4),
        MessageQueue("orders", "broker-b", 0),
        MessageQueue("other", "broker-a", 0),
    ],
)
def test_resolve_refuses_a_queue_not_of_the_topic(foreign: MessageQueue) -> None:
    with pytest.raises(MessageError, match="not a queue of this topic"):
        resolve(foreign, topic_queues(4))


@given(n=st.integers(1, 64), data=st.data())
def test_resolve_accepts_every_valid_index(n: int, data: st.DataObject) -> None:
    qs = topic_queues(n)
    i = data.draw(st.integers(0, n - 1))
    assert resolve(i, qs) is qs[i]


@pytest.mark.parametrize("index", [-1, 4, 100])
def test_resolve_refuses_out_of_range_index(index: int) -> None:
    with pytest.raises(MessageError, match=f"index {index}; the topic has 4 queues"):
        resolve(index, topic_queues(4))


@pytest.mark.parametrize("selected", [True, False, 1.0, "1", None, b"\x01", [0], "orders:broker-a:0"])
def test_resolve_refuses_anything_but_a_queue_or_int(selected: object) -> None:
    with pytest.raises(MessageError, match="must return a MessageQueue or an int index"):
        resolve(selected, topic_queues(4))


def test_send_orderly_batch_stores_an_int_subclass_key_as_its_number(settings) -> None:
    from mqorder import Producer
    from mqorder.store.log import MessageLog

    p = Producer(settings=settings)
    try:
        p.create_topic("t-enum", queues=4)
        p.send_orderly_batch("t-enum", [(Shop.BERLIN, b"x"), (7, b"y")])
        log = MessageLog(p.brokers)
        msgs = [m for mq in p.describe_topic("t-enum").message_queues for m in log.read(mq, 0, 10)]
        assert [m.keys for m in msgs] == [["7"], ["7"]] and len({m.key_hash for m in msgs}) == 1
    finally:
        p.close()

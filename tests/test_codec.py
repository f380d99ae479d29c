"""Unit tests of message encoding into stream entries and back (no Redis, no Celery)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from redis._parsers.helpers import parse_stream_list

from mqorder.codec import (
    DEFAULT_MAX_MESSAGE_SIZE,
    MAX_HEADER_SIZE,
    MsgIdGenerator,
    check_body,
    decode_entries,
    encode_header,
)
from mqorder.errors import MessageError, MessageTooLargeError
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog

MQ = MessageQueue("orders", "broker-a", 3)


def entry(offset: int, header: bytes, body: bytes = b"body", store_ms: int = 1_700_000_000_123) -> tuple:
    """One entry the way XRANGE returns it (``h``, ``b``, ``s`` in the order the send script writes)."""
    return (f"{offset}-1".encode(), [b"h", header, b"b", body, b"s", str(store_ms).encode()])


def header_of(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


# -- round trip -----------------------------------------------------------------------------------


def test_encode_then_decode_round_trips_every_field() -> None:
    header = encode_header("MSG-1", ["k1", "k2"], "TagA", {"a": "1", "b": "2"}, born_ms=1_699_999_999_000)
    [msg] = decode_entries(MQ, [entry(42, header, b"\x00\xffpayload", 1_700_000_000_123)])
    assert msg.decode_error is None
    assert msg.msg_id == "MSG-1"
    assert (msg.topic, msg.broker_name, msg.queue_id, msg.queue_offset) == ("orders", "broker-a", 3, 42)
    assert msg.message_queue == MQ
    assert msg.body == b"\x00\xffpayload"
    assert msg.keys == ["k1", "k2"]
    assert msg.tags == "TagA"
    assert msg.properties == {"a": "1", "b": "2"}
    assert msg.born_timestamp == 1_699_999_999_000
    assert msg.store_timestamp == 1_700_000_000_123
    assert msg.reconsume_times == 0


def test_minimal_header_decodes_to_empty_metadata() -> None:
    [msg] = decode_entries(MQ, [entry(0, encode_header("MSG-2", born_ms=5))])
    assert msg.decode_error is None
    assert (msg.keys, msg.tags, msg.properties, msg.born_timestamp) == ([], None, {}, 5)


def test_encode_header_defaults_born_time_to_now() -> None:
    h = json.loads(encode_header("MSG-3"))
    assert isinstance(h["b"], int) and h["b"] > 1_600_000_000_000


def test_single_str_key_becomes_a_one_element_list() -> None:
    [msg] = decode_entries(MQ, [entry(0, encode_header("id", "order-42"))])
    assert msg.keys == ["order-42"]
    [msg] = decode_entries(MQ, [entry(0, encode_header("id", ("a", "b")))])
    assert msg.keys == ["a", "b"]


@settings(max_examples=200)
@given(
    msg_id=st.text(min_size=1),
    keys=st.lists(st.text(), max_size=5),
    tags=st.one_of(st.none(), st.text(min_size=1)),
    properties=st.dictionaries(st.text(), st.text(), max_size=5),
    body=st.binary(max_size=256),
    born=st.integers(0, 2**53),
    store=st.integers(0, 2**53),
    offset=st.integers(0, 2**62),
)
def test_keys_tags_properties_and_body_survive_the_round_trip(
    msg_id: str,
    keys: list[str],
    tags: str | None,
    properties: dict[str, str],
    body: bytes,
    born: int,
    store: int,
    offset: int,
) -> None:
    header = encode_header(msg_id, keys, tags, properties, born_ms=born)
    [msg] = decode_entries(MQ, [entry(offset, header, body, store)])
    assert msg.decode_error is None
    assert msg.msg_id == msg_id
    assert msg.keys == keys
    assert msg.tags == tags
    assert msg.properties == properties
    assert msg.body == body
    assert (msg.queue_offset, msg.born_timestamp, msg.store_timestamp) == (offset, born, store)


def test_fields_in_another_order_still_decode() -> None:
    header = encode_header("id-x", ["k"], "T", born_ms=1)
    [msg] = decode_entries(MQ, [(b"7-1", [b"s", b"99", b"b", b"zz", b"h", header])])
    assert msg.decode_error is None
    assert (msg.msg_id, msg.body, msg.store_timestamp, msg.queue_offset) == ("id-x", b"zz", 99, 7)


def test_missing_store_time_defaults_to_zero() -> None:
    [msg] = decode_entries(MQ, [(b"7-1", [b"h", encode_header("id-y"), b"b", b"zz"])])
    assert msg.decode_error is None
    assert msg.store_timestamp == 0


def test_entries_keep_their_order_and_offsets() -> None:
    raw = [entry(o, encode_header(f"id-{o}")) for o in (3, 4, 10)]
    assert [(m.queue_offset, m.msg_id) for m in decode_entries(MQ, raw)] == [(3, "id-3"), (4, "id-4"), (10, "id-10")]


def test_message_log_read_decodes_entries_as_redis_py_xrange_returns_them() -> None:
    # MessageLog.read passes the result of redis-py's ``xrange`` to decode_entries; redis-py's
    # XRANGE response callback (parse_stream_list) turns each entry's field list into a dict.
    raw_reply = [[b"5-1", [b"h", encode_header("MSG-5", ["k"], born_ms=1), b"b", b"hello", b"s", b"77"]]]
    parsed = parse_stream_list(raw_reply)
    client = SimpleNamespace(xrange=lambda *a, **kw: parsed)
    brokers = SimpleNamespace(get=lambda name: SimpleNamespace(client=client))
    [msg] = MessageLog(brokers).read(MQ, 5, 10)
    assert msg.decode_error is None
    assert (msg.msg_id, msg.body, msg.keys, msg.store_timestamp, msg.queue_offset) == ("MSG-5", b"hello", ["k"], 77, 5)


# -- retries --------------------------------------------------------------------------------------


def test_retries_mapping_sets_reconsume_times_by_offset() -> None:
    raw = [entry(o, encode_header(f"id-{o}")) for o in (5, 6, 7)]
    msgs = decode_entries(MQ, raw, retries={5: 3, 7: 16, 99: 1})
    assert [m.reconsume_times for m in msgs] == [3, 0, 16]
    assert [m.reconsume_times for m in decode_entries(MQ, raw, retries=None)] == [0, 0, 0]
    assert [m.reconsume_times for m in decode_entries(MQ, raw, retries={})] == [0, 0, 0]


def test_retries_apply_to_undecodable_entries_too() -> None:
    [msg] = decode_entries(MQ, [entry(5, b"not json")], retries={5: 2})
    assert msg.decode_error
    assert msg.reconsume_times == 2


# -- check_body -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "type_name"), [("text", "str"), (42, "int"), (None, "NoneType"), ([1], "list")])
def test_check_body_refuses_non_bytes_and_says_to_encode(body: object, type_name: str) -> None:
    with pytest.raises(MessageError, match=f"message body must be bytes, got {type_name}") as info:
        check_body(body, DEFAULT_MAX_MESSAGE_SIZE)
    assert not isinstance(info.value, MessageTooLargeError)
    assert "encode" in str(info.value)


@pytest.mark.parametrize("body", [bytearray(b"abc"), memoryview(b"abc")])
def test_check_body_accepts_bytearray_and_memoryview_as_bytes(body: object) -> None:
    out = check_body(body, 10)
    assert type(out) is bytes
    assert out == b"abc"


def test_check_body_accepts_exactly_max_size_and_refuses_one_more() -> None:
    assert check_body(b"x" * 100, 100) == b"x" * 100
    with pytest.raises(MessageTooLargeError, match="101 bytes, over max_message_size 100"):
        check_body(b"x" * 101, 100)
    with pytest.raises(MessageTooLargeError):
        check_body(bytearray(101), 100)


def test_check_body_accepts_empty_body() -> None:
    assert check_body(b"", 1) == b""


# -- encode_header refusals -----------------------------------------------------------------------


@pytest.mark.parametrize("tags", [5, b"TagA", ["TagA"], 1.0])
def test_encode_header_refuses_non_str_tags(tags: object) -> None:
    with pytest.raises(MessageError, match="tags must be a str or None"):
        encode_header("id", tags=tags)


@pytest.mark.parametrize("properties", [{"a": 1}, {"a": None}, {"a": b"1"}, {1: "a"}])
def test_encode_header_refuses_non_str_property_keys_or_values(properties: object) -> None:
    with pytest.raises(MessageError, match="properties must map str to str"):
        encode_header("id", properties=properties)


@pytest.mark.parametrize("properties", [["a", "b"], "a=b", 5])
def test_encode_header_refuses_properties_that_are_not_a_mapping(properties: object) -> None:
    with pytest.raises(MessageError, match="properties must be a dict"):
        encode_header("id", properties=properties)


@pytest.mark.parametrize("keys", [5, {"k": "v"}, {"a"}, ["a", 1], [b"a"], b"a"])
def test_encode_header_refuses_keys_that_are_not_a_list_of_str(keys: object) -> None:
    with pytest.raises(MessageError, match="keys must be a str or a list of str"):
        encode_header("id", keys)


def test_encode_header_refuses_headers_over_64_kib() -> None:
    with pytest.raises(MessageTooLargeError, match="over 65,536"):
        encode_header("id", ["x" * MAX_HEADER_SIZE])
    with pytest.raises(MessageTooLargeError):
        encode_header("id", properties={"p": "y" * MAX_HEADER_SIZE})
    # comfortably below the limit is fine
    assert len(encode_header("id", ["x" * (MAX_HEADER_SIZE - 1000)])) <= MAX_HEADER_SIZE


def test_encode_header_counts_utf8_bytes_not_characters() -> None:
    # 30,000 three-byte characters: 90,000 bytes although fewer than 64 Ki characters
    with pytest.raises(MessageTooLargeError):
        encode_header("id", ["订" * 30_000])


# -- decode never raises on garbage ---------------------------------------------------------------


def _is_valid_header(raw: bytes) -> bool:
    try:
        h = json.loads(raw)
    except ValueError:
        return False
    return isinstance(h, dict) and "i" in h


@settings(max_examples=300)
@given(garbage=st.binary(max_size=64), offset=st.integers(0, 2**62))
def test_random_header_bytes_set_decode_error_instead_of_raising(garbage: bytes, offset: int) -> None:
    assume(not _is_valid_header(garbage))
    [msg] = decode_entries(MQ, [entry(offset, garbage)])
    assert isinstance(msg.decode_error, str) and msg.decode_error
    assert msg.queue_offset == offset
    assert msg.message_queue == MQ


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param([], id="no-fields"),
        pytest.param([b"h", b'{"i":"x"}'], id="no-body"),
        pytest.param([b"b", b"body", b"s", b"1"], id="no-header"),
        pytest.param([b"h", b'{"i":"x"}', b"b"], id="odd-length"),
        pytest.param([b"h", b'{"i":"x"}', b"b", b"body", b"s", b"soon"], id="non-numeric-store-time"),
        pytest.param([b"h", b"[1, 2]", b"b", b"body", b"s", b"1"], id="header-is-a-list"),
        pytest.param([b"h", b'"text"', b"b", b"body", b"s", b"1"], id="header-is-a-string"),
        pytest.param([b"h", b"{}", b"b", b"body", b"s", b"1"], id="header-without-id"),
        pytest.param([b"h", b'{"i":5}', b"b", b"body", b"s", b"1"], id="non-str-id"),
        pytest.param([b"h", b'{"i":"x","k":"one"}', b"b", b"body", b"s", b"1"], id="keys-not-a-list"),
        pytest.param([b"h", b"\xff\xfe\x00\x01", b"b", b"body", b"s", b"1"], id="header-not-text"),
        pytest.param([b"h", b"[" * 100_000, b"b", b"body", b"s", b"1"], id="deeply-nested-header"),
        pytest.param(None, id="fields-none"),
        pytest.param(b"h-b-s", id="fields-bytes"),
        pytest.param({b"h": b'{"i":"x"}'}, id="dict-without-body"),
    ],
)
def test_malformed_entry_sets_decode_error_and_keeps_offset(fields: object) -> None:
    [msg] = decode_entries(MQ, [(b"12-1", fields)])
    assert isinstance(msg.decode_error, str) and msg.decode_error
    assert len(msg.decode_error) <= 500
    assert msg.queue_offset == 12


@pytest.mark.parametrize(
    "header",
    [
        pytest.param({"i": "x", "t": 5}, id="tags-int"),
        pytest.param({"i": "x", "t": ["a"]}, id="tags-list"),
        pytest.param({"i": "x", "p": ["a", "b"]}, id="properties-list"),
        pytest.param({"i": "x", "p": {"a": 1}}, id="property-value-int"),
        pytest.param({"i": "x", "k": [1, 2]}, id="key-elements-int"),
        pytest.param({"i": "x", "b": "yesterday"}, id="born-time-str"),
    ],
)
def test_header_with_wrong_typed_fields_sets_decode_error(header: dict[str, Any]) -> None:
    # a stored header whose fields do not have MessageExt's types is a poison message: it must go
    # to the DLQ with a reason, not reach a listener (nor the DLQ re-encoder) with e.g. int tags
    [msg] = decode_entries(MQ, [entry(3, header_of(**header))])
    assert msg.decode_error, f"decoded {header} without decode_error: {msg!r}"
    assert msg.queue_offset == 3


def test_one_bad_entry_does_not_affect_its_neighbours() -> None:
    raw = [entry(1, encode_header("ok-1")), entry(2, b"{broken"), entry(3, encode_header("ok-3"))]
    msgs = decode_entries(MQ, raw)
    assert [m.queue_offset for m in msgs] == [1, 2, 3]
    assert [m.decode_error is None for m in msgs] == [True, False, True]
    assert [m.msg_id for m in msgs] == ["ok-1", "", "ok-3"]
    assert "JSONDecodeError" in msgs[1].decode_error


FIELD_PARTS = st.sampled_from([b"h", b"b", b"s", encode_header("VALID"), b"payload", b"123", b"", b"\x00garbage"])


@settings(max_examples=300)
@given(fields=st.lists(st.one_of(FIELD_PARTS, st.binary(max_size=16)), max_size=8), offset=st.integers(0, 2**40))
def test_random_field_layouts_never_raise(fields: list[bytes], offset: int) -> None:
    [msg] = decode_entries(MQ, [(f"{offset}-0".encode(), fields)])
    assert msg.queue_offset == offset
    if msg.decode_error is None:
        # only a layout holding a real header and body decodes, and then to that header
        assert msg.msg_id == "VALID"
        assert b"h" in fields and b"b" in fields
    else:
        assert isinstance(msg.decode_error, str) and msg.decode_error


def test_body_over_max_message_size_sets_decode_error() -> None:
    header = encode_header("big")
    [ok, big] = decode_entries(MQ, [entry(0, header, b"x" * 10), entry(1, header, b"x" * 11)], max_message_size=10)
    assert ok.decode_error is None
    assert big.decode_error and "over max_message_size 10" in big.decode_error
    assert big.queue_offset == 1


# -- message ids ----------------------------------------------------------------------------------


def test_msg_id_generator_ids_are_unique_over_10k_calls() -> None:
    gen = MsgIdGenerator()
    ids = [gen.next() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9A-F]{34}", i) for i in ids)


def test_two_generators_do_not_collide() -> None:
    a, b = MsgIdGenerator(), MsgIdGenerator()
    ids = [a.next() for _ in range(1000)] + [b.next() for _ in range(1000)]
    assert len(set(ids)) == 2000
    assert a.next()[:16] != b.next()[:16]  # different random prefixes


def test_header_bytes_are_the_compact_utf8_json_of_the_stdlib_and_a_surrogate_is_refused() -> None:
    """Headers are written with orjson: byte for byte what ``json`` writes with ``ensure_ascii=False``
    and compact separators (stored headers look the same whichever wrote them), and text no UTF-8
    can carry (a lone surrogate) is a ``MessageError``, not a crash."""
    import json

    import pytest

    from mqorder.codec import encode_header
    from mqorder.errors import MessageError

    raw = encode_header("ID1", keys=["a", "é✓"], tags="tag", properties={"x": "ü", "y": "\u2028"}, born_ms=5,
                        key_hash=4294967295)
    expected = {"i": "ID1", "b": 5, "k": ["a", "é✓"], "t": "tag", "p": {"x": "ü", "y": "\u2028"}, "h": 4294967295}
    assert raw == json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode()
    with pytest.raises(MessageError, match="not valid UTF-8"):
        encode_header("ID2", keys=["\ud800"])


@pytest.mark.parametrize(("fields", "why"), [
    ([b"x", b"1"], "the entry has no 'h' and 'b' field (not written by an mqorder producer; fields: ['x'])"),
    ([], "the entry has no fields (not written by an mqorder producer)"),
    ([b"h", b"[1]", b"b", b"x", b"s", b"0"], "its header is JSON an array, not an object with the message id 'i'"),
    ([b"h", b"null", b"b", b"x", b"s", b"0"], "its header is JSON null, not an object with the message id 'i'"),
    ([b"h", b'{"b":1}', b"b", b"x", b"s", b"0"], "its header has no message id 'i'"),
])
def test_an_undecodable_entry_says_what_is_wrong_in_words(fields: list[bytes], why: str) -> None:
    """An adversarial walk-through: the dead letters of such entries read "KeyError: b'h'" or
    "list indices must be integers or slices, not str"."""
    (msg,) = decode_entries(MessageQueue("t", "b", 0), [(b"3-1", fields)])
    assert msg.decode_error == f"undecodable entry: {why}"

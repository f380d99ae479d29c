"""Reads of topics with large messages (``maxMessageSize`` goes up to 512 MB) against a real
redis-server: a page whose values pass ``resp_pages.MAX_BATCH_BYTES`` becomes several Arrow batches,
each within it (a larger message alone), every message once and in offset order; positions past
``headers.INT64_OFFSETS_FROM`` (2 GiB) are gathered with int64 offsets. Both limits are lowered here
so megabytes stand in for gigabytes; the reader is driven directly (no Spark session)."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import orjson
import pyarrow as pa
import pytest
import redis

from mqorder import Producer, keys
from mqorder.errors import MessageError
from mqorder.spark import headers, resp_pages
from mqorder.spark import reader as R
from mqorder.spark.ledger import read_ledger
from mqorder.spark.options import Connection
from mqorder.spark.stored_index import read_index
from tests.support import use_parsers

MB = 1 << 20


#: Every byte but ``*``: a page whose bodies hold many is left to hiredis (``resp_pages._STARS_PER_ENTRY``).
_NO_STARS = bytes.maketrans(b"*", b"+")


def _body(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size).translate(_NO_STARS)


def _topic(redis_url: str, topic: str, sizes: list[int], properties: bool = False) -> list[bytes]:
    """``sizes`` messages into a one-queue topic, in order; their bodies."""
    bodies = [_body(i, n) for i, n in enumerate(sizes)]
    with Producer(redis_url, max_message_size=16 * MB) as p:
        p.create_topic(topic, queues=1)
        for i, b in enumerate(bodies):
            p.send_orderly(topic, b, sharding_key="k", keys=f"k{i}", properties={"n": str(i)} if properties else None)
    return bodies


def _group(redis_url: str, topic: str) -> R.RangeGroup:
    spans, limits = R.topic_layout(Connection(redis_url), topic)
    (group,) = R.plan_partitions(topic, spans, {0: limits[0][0]}, {0: limits[0][1]}, 10**9, 1)
    return group


def _spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str,
         calls: list[tuple[object, ...]] | None = None) -> list[object]:
    """Record what ``module.name`` returns from here on (and its arguments into ``calls``)."""
    real: Callable[..., object] = getattr(module, name)
    seen: list[object] = []

    def spy(*args: object) -> object:
        if calls is not None:
            calls.append(args)
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(module, name, spy)
    return seen


def _check(batches: list[pa.RecordBatch], bodies: list[bytes], cap: int) -> None:
    """Every body once, in offset order, byte for byte; every batch of several rows within ``cap``."""
    rows = pa.Table.from_batches(batches)
    assert rows.column("offset").to_pylist() == list(range(len(bodies)))
    got = rows.column("body").to_pylist()
    assert [len(b) for b in got] == [len(b) for b in bodies]
    assert got == bodies
    assert rows.column("key").to_pylist() == [f"k{i}" for i in range(len(bodies))]
    for b in batches:
        assert b.schema == R.ARROW_SCHEMA
        assert b.num_rows == 1 or b.column("body").nbytes <= cap, (b.num_rows, b.column("body").nbytes)


#: Small messages first (the first page, 64 of them, sizes the next page at 20,000 entries), then a
#: jump to megabytes, with small ones among them to share a batch.
SIZES = [100] * 70 + [3 * MB, 50_000, 60_000, int(2.5 * MB), 300_000, 300_000, 300_000, 2 * MB, 10]


def test_a_page_over_the_cap_comes_as_batches_within_it(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = _topic(redis_url, "big", SIZES)
    monkeypatch.setattr(resp_pages, "MAX_BATCH_BYTES", MB)
    cuts = _spy(monkeypatch, resp_pages, "cut")
    batches = list(R.read_group(Connection(redis_url), _group(redis_url, "big")))
    _check(batches, bodies, MB)
    # The first page (64 small messages) is one batch; the second, raw-cut, is split.
    assert isinstance(cuts[0], resp_pages.RawColumns) and isinstance(cuts[1], resp_pages.SplitPage)
    assert [b.num_rows for b in batches] == [64, 6, 1, 2, 1, 3, 1, 1]
    # The audit's index reads the same pieces.
    index = list(read_index(Connection(redis_url), _group(redis_url, "big"), None))
    assert [b.num_rows for b in index] == [b.num_rows for b in batches]
    assert pa.Table.from_batches(index).column("offset").to_pylist() == list(range(len(bodies)))


def test_a_page_within_the_cap_is_one_batch_as_before(redis_url: str) -> None:
    bodies = _topic(redis_url, "big", SIZES)
    batches = list(R.read_range(Connection(redis_url), R.QueueRange("big", R.QueueRef(0, "broker-a", 0), 0, len(SIZES))))
    _check(batches, bodies, resp_pages.MAX_BATCH_BYTES)
    assert [b.num_rows for b in batches] == [64, len(SIZES) - 64]


@pytest.mark.parametrize("cutter", ["native", "numpy"])
@pytest.mark.parametrize("cap", [resp_pages.MAX_BATCH_BYTES, MB])
def test_positions_past_the_int32_limit_are_gathered_with_int64_offsets(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, cap: int, cutter: str
) -> None:
    """With the limit lowered to 1 MB the second page's values lie past it: gathered through
    ``large_binary``, cast back to ``binary`` (the compiled gather reads any position), the same rows."""
    use_parsers(cutter, monkeypatch)
    bodies = _topic(redis_url, f"big-{cutter}", SIZES)
    monkeypatch.setattr(headers, "INT64_OFFSETS_FROM", MB)
    monkeypatch.setattr(resp_pages, "MAX_BATCH_BYTES", cap)
    args: list[tuple[object, ...]] = []
    gathered = _spy(monkeypatch, headers, "gather", args)
    batches = list(R.read_group(Connection(redis_url), _group(redis_url, f"big-{cutter}")))
    _check(batches, bodies, cap)
    assert all(isinstance(a, pa.BinaryArray) and a.type == pa.binary() for a in gathered)
    assert any(int(ends[-1]) >= MB for _, _, ends in args)  # type: ignore[index]
    assert len(batches) == (2 if cap > 10 * MB else 8)


@pytest.mark.parametrize("cutter", ["native", "numpy"])
def test_gather_past_2_gib_uses_int64_offsets(monkeypatch: pytest.MonkeyPatch, cutter: str) -> None:
    """The real limit, on a buffer of 2 GiB and more that is allocated but never touched (so it
    costs a few pages of memory): int32 offsets there were negative, and Arrow refused them."""
    use_parsers(cutter, monkeypatch)
    size = 2**31 + 8192
    data = np.empty(size, dtype=np.uint8)
    starts = np.array([10, 2**31 - 4, 2**31 + 100], dtype=np.int64)
    ends = starts + np.array([3, 8, 50])
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        data[a:b] = i + 1
    got = headers.gather(pa.py_buffer(data), starts, ends)
    assert got.type == pa.binary()
    assert got.to_pylist() == [bytes([1]) * 3, bytes([2]) * 8, bytes([3]) * 50]


@pytest.mark.parametrize("cutter", ["native", "numpy"])
def test_hiredis_pages_split_the_same_way(redis_url: str, monkeypatch: pytest.MonkeyPatch, cutter: str) -> None:
    """Bodies of 10 MB and more have 8-digit lengths, which numpy's raw cut leaves to hiredis:
    the careful path (``_fields``, ``_headers_python`` for the properties) builds each piece's
    batch on its own. The compiled cut (up to 10 digits) cuts the same pages into the same pieces."""
    use_parsers(cutter, monkeypatch)
    sizes = [10 * MB + 7, 200_000, 300_000, 400_000, 10 * MB + 1, 5]
    bodies = _topic(redis_url, f"huge-{cutter}", sizes, properties=True)
    monkeypatch.setattr(resp_pages, "MAX_BATCH_BYTES", MB)
    cuts = _spy(monkeypatch, resp_pages, "cut")
    splits = _spy(monkeypatch, resp_pages, "split_entries")
    batches = list(R.read_group(Connection(redis_url), _group(redis_url, f"huge-{cutter}")))
    _check(batches, bodies, MB)
    if cutter == "numpy":
        assert cuts and all(c is None for c in cuts) and isinstance(splits[0], resp_pages.SplitPage)
    else:
        assert cuts and all(c is not None for c in cuts) and not splits
        assert any(isinstance(c, resp_pages.SplitPage) for c in cuts)
    assert [b.num_rows for b in batches] == [1, 3, 1, 1]
    props = pa.Table.from_batches(batches).column("properties").to_pylist()
    assert props == [[("n", str(i))] for i in range(len(sizes))]


def test_a_client_read_through_xrange_splits_too(redis_url: str, r: redis.Redis,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that is not a plain ``redis.Redis`` (a cluster client) reads with ``xrange``."""

    class Other(redis.Redis):
        pass

    for i in range(6):
        r.xadd("s:big", {b"h": b"{}", b"b": _body(i, 300_000), b"s": b"1"}, id=f"{i + 1}-0")
    monkeypatch.setattr(resp_pages, "MAX_BATCH_BYTES", MB)
    client = Other.from_url(redis_url)
    client.set_response_callback("XRANGE", lambda resp, **_: resp)
    pages = resp_pages.RawPages(client)
    try:
        page = pages.xrange("s:big", "-", "+", 100)
        assert isinstance(page, resp_pages.SplitPage)
        assert [len(p) for p in resp_pages.pieces(page)] == [3, 3]
        assert page.entries() == client.xrange("s:big")
    finally:
        pages.close()
        client.close()


def _ledger_record(i: int) -> bytes:
    """A consumption ledger record of group ``g``, offset ``i`` (as the engine writes one)."""
    return orjson.dumps({"group": "g", "topic": "t", "broker": "broker-a", "queue": 0, "offset": i, "msg_id": "",
                         "key": f"key-{i}", "key_hash": i, "born_ms": 1_795_685_582_089, "start_ms": 1.5, "end_ms": 2.5,
                         "attempt": 0, "epoch": 1, "client": "c@h", "run": "r-1", "outcome": "SUCCESS"})


def test_ledger_pages_split_too(redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(300):
        r.xadd(keys.ledger("g"), {b"r": _ledger_record(i)})
    monkeypatch.setattr(resp_pages, "MAX_BATCH_BYTES", 4096)
    cuts = _spy(monkeypatch, resp_pages, "cut")
    rows = read_ledger("g", redis_url=redis_url)
    assert [row["offset"] for row in rows] == list(range(300))
    assert isinstance(cuts[0], resp_pages.SplitPage) and len(cuts[0].parts) > 5


def test_ledger_pages_after_a_dropped_reply_read_on_to_the_end(
        redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # A ledger page asks for READ_PAGE (10,000) records; with the reply limit lowered below that
    # many, each reply is dropped and a shorter page read, which must not end the read.
    from mqorder.spark import ledger

    pipe = r.pipeline(transaction=False)
    for i in range(25_000):
        pipe.xadd(keys.ledger("g"), {b"r": _ledger_record(i)})
    pipe.execute()
    monkeypatch.setattr(resp_pages, "MAX_REPLY_BYTES", MB)
    packed: list[tuple[object, ...]] = []
    _spy(monkeypatch, resp_pages.hiredis, "pack_command", packed)
    rows = read_ledger("g", redis_url=redis_url)
    assert [row["offset"] for row in rows] == list(range(25_000))
    counts = [int(args[0][5]) for args in packed if args[0][0] == "XRANGE"]
    assert ledger.READ_PAGE in counts and min(counts) < ledger.READ_PAGE, counts  # replies were dropped


def test_split_points_and_first_page() -> None:
    assert resp_pages.split_points(np.array([5, 5, 5, 20, 1, 1]), 10) == [0, 2, 3, 4, 6]
    assert resp_pages.split_points(np.array([0, 0, 0]), 10) == [0, 3]
    assert resp_pages.split_points(np.array([], dtype=np.int64), 10) == [0]
    assert R.first_page(4 * MB) == R.FIRST_PAGE == 64  # the default largest message: as before
    assert R.first_page(1024) == 64
    assert R.first_page(40 * MB) == 6  # 64 x 40 MB was a 2.5 GB reply
    assert R.first_page(512 * MB) == 1


def test_the_first_page_follows_max_message_size(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _topic(redis_url, "big", [1000] * 20)
    asked = _spy_counts(monkeypatch)
    conn = Connection(redis_url, max_message_size=128 * MB)
    assert sum(b.num_rows for b in R.read_group(conn, _group(redis_url, "big"))) == 20
    assert asked[0] == 2


def _spy_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``count`` of every ``XRANGE`` the raw pages ask for."""
    real = resp_pages.RawPages.xrange
    counts: list[int] = []

    def xrange(self: resp_pages.RawPages, key: str, lo: str, hi: str, count: int) -> resp_pages.Page:
        counts.append(count)
        return real(self, key, lo, hi, count)

    monkeypatch.setattr(resp_pages.RawPages, "xrange", xrange)
    return counts


def test_reads_take_max_message_size_as_an_option(redis_url: str) -> None:
    """The process that plans a read (a Connect server, say) may not have the driver's environment:
    ``maxMessageSize`` on a read (and the audit's index read) sets what sizes the first page."""
    from mqorder.spark.options import read_options
    from mqorder.spark.stored_index import index_options

    opts = read_options({"topic": "big", "redisUrl": redis_url, "maxMessageSize": str(40 * MB)}, streaming=False)
    assert opts.conn.max_message_size == 40 * MB and R.first_page(opts.conn.max_message_size) == 6
    assert index_options({"topic": "big", "redisUrl": redis_url, "maxMessageSize": str(40 * MB)}).conn.max_message_size == 40 * MB


def test_a_reply_past_the_limit_is_dropped_and_asked_again_with_fewer_entries(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # With 4 MB pages, after 64 small messages the next page asks for ~19,000 entries: the ~9 MB of
    # large ones that follow pass the (lowered) 4 MB limit, so that reply is dropped before it is
    # all in memory and the page asked again with 16 times fewer entries, until it fits.
    bodies = _topic(redis_url, "big", SIZES)
    monkeypatch.setattr(R, "PAGE_BYTES", 4 * MB)
    monkeypatch.setattr(resp_pages, "MAX_REPLY_BYTES", 4 * MB)
    packed: list[tuple[object, ...]] = []
    _spy(monkeypatch, resp_pages.hiredis, "pack_command", packed)
    batches = list(R.read_group(Connection(redis_url), _group(redis_url, "big")))
    _check(batches, bodies, resp_pages.MAX_BATCH_BYTES)
    counts = [int(args[0][5]) for args in packed if args[0][0] == "XRANGE"]
    c = counts[1]  # sized from the 64 small messages: thousands
    assert counts[0] == 64 and c > 10_000, counts
    assert counts[1:5] == [c, c // 16, c // 256, c // 4096], counts  # dropped thrice, then a few entries fit


def test_one_entry_past_the_reply_limit_is_a_clear_error(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _topic(redis_url, "big", SIZES)
    monkeypatch.setattr(resp_pages, "MAX_REPLY_BYTES", 2 * MB)  # below the 3 MB message: never in practice
    with pytest.raises(MessageError, match="over 2,097,152 bytes"):
        list(R.read_group(Connection(redis_url), _group(redis_url, "big")))

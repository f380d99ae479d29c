"""Raw ``XRANGE`` pages (``mqorder.spark.resp_pages``) against hiredis: a page cut into columns
holds exactly what hiredis parses from the same bytes, and every reply that is not a complete page
of ``append_entries``' layout is left to hiredis (``cut`` gives None), whatever its bodies hold.
Every test runs twice: with the compiled cut (``mqorder.spark._resp``, which ``make install``
builds) and with the numpy cut that stands in where it could not be built."""

from __future__ import annotations

import random
import time

import hiredis
import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mqorder.spark import resp_pages
from mqorder.spark.resp_pages import LEDGER, Layout, RawColumns, RawPages, cut
from tests.support import damaged, use_parsers

_PONG = b"+PONG\r\n"


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _reply(entries: list[tuple[bytes, list[bytes]]]) -> bytes:
    out = [b"*%d\r\n" % len(entries)]
    for entry_id, fields in entries:
        out.append(b"*2\r\n" + _bulk(entry_id) + b"*%d\r\n" % len(fields) + b"".join(map(_bulk, fields)))
    return b"".join(out)


def _entry(offset: int, header: bytes, body: bytes, store: bytes = b"1795693411078") -> tuple[bytes, list[bytes]]:
    return b"%d-0" % offset, [b"h", header, b"b", body, b"s", store]


def _cut(raw: bytes, layout: Layout = resp_pages.TOPIC) -> RawColumns | None:
    return cut(np.frombuffer(raw + _PONG + bytes(8), dtype=np.uint8), len(raw), layout)


def _hiredis(raw: bytes) -> object:
    reader = hiredis.Reader()
    reader.feed(raw)
    return reader.gets()


def _agrees(raw: bytes, layout: Layout = resp_pages.TOPIC) -> RawColumns | None:
    """``cut`` of ``raw``: None, or columns holding what hiredis parses."""
    got = _cut(raw, layout)
    if got is not None:
        assert got.entries() == _hiredis(raw)
    return got


@pytest.fixture(autouse=True, params=["native", "numpy"])
def cutter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which cut ``resp_pages.cut`` uses: the compiled one, or numpy's (``use_parsers``)."""
    use_parsers(request.param, monkeypatch)
    return request.param


_FAKE = _reply([_entry(9, b"{}", b"x")])[4:]  # a whole entry's bytes, to hide in a body


def test_common_pages_cut_as_hiredis_parses() -> None:
    rng = random.Random(29)
    for _ in range(200):
        n = rng.randint(1, 40)
        entries = [
            _entry(
                rng.randint(0, 10**12),
                b'{"i":"%d","k":["k%d"]}' % (i, i),
                bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 9, 10, 99, 100, 1000)))),
                str(rng.randint(0, 10**13)).encode(),
            )
            for i in range(n)
        ]
        assert _agrees(_reply(entries)) is not None


def test_bodies_that_look_like_entries_never_mislead_the_cut() -> None:
    for body in (
        _FAKE,
        b"*2\r\n$",
        b"*2\r\n$3\r\n",
        b"x" + _FAKE,
        _FAKE + _FAKE,
        b"\r\n" + _FAKE[:-2],
        b"*2\r\n$99999999\r\n",
        _PONG,
        b"*",
        b"*2\r\n$1\r\nh\r\n",
    ):
        for where in range(3):
            entries = [_entry(i, b"{}", body if i == where else b"plain") for i in range(3)]
            _agrees(_reply(entries))  # None (hiredis' turn) or the same entries


def test_ledger_pages_cut_as_hiredis_parses() -> None:
    records = [
        (b"%d-%d" % (1795693410955 + i // 3, i % 3), [b"r", b'{"group":"g","offset":%d}' % i]) for i in range(50)
    ]
    got = _agrees(_reply(records), LEDGER)
    assert got is not None and len(got) == 50
    assert _cut(_reply(records), resp_pages.TOPIC) is None
    assert _cut(_reply([(b"1-0", [b"x", b"{}"])]), LEDGER) is None


def test_long_values_cut_and_longer_ones_fall_back(cutter: str) -> None:
    big = _reply([_entry(1, b"{}", b"a" * 1_234_567), _entry(2, b"{}", b"b")])
    assert _agrees(big) is not None
    longer = _reply([_entry(1, b"{}", b"a" * 10_000_000)])  # 8 digits of length
    if cutter == "native":
        assert _agrees(longer) is not None  # the compiled cut reads up to 10 digits
    else:
        assert _cut(longer) is None  # numpy's reads 7 at most: hiredis' turn


def test_lengths_past_ten_digits_or_past_the_reply_are_left_to_hiredis() -> None:
    one = _reply([_entry(1, b"{}", b"x")])
    assert _cut(one.replace(b"$1\r\nx\r\n", b"$10000000000\r\nx\r\n")) is None  # 11 digits
    assert _cut(one.replace(b"$1\r\nx\r\n", b"$1000000000\r\nx\r\n")) is None  # 10, past the end
    assert _cut(b"*01\r\n" + one[4:]) is None  # a count with a leading zero (hiredis refuses it)
    assert _cut(one.replace(b"$1\r\nx\r\n", b"$9\r\nx\r\n")) is None  # past the end
    assert _cut(one.replace(b"$1\r\nx\r\n", b"$-1\r\nx\r\n")) is None  # a null is no value
    assert _cut(one.replace(b"$1\r\nx\r\n", b"$01\r\nx\r\n")) is None  # a leading zero (hiredis refuses it)
    assert _cut(b"*999999\r\n" + one[4:]) is None  # more entries than the bytes can hold


def test_damaged_replies_are_cut_as_hiredis_parses_them_or_left_to_it() -> None:
    """Random bytes changed, dropped or doubled anywhere in a page: the cut is None, or exactly
    what hiredis parses from the damaged bytes."""
    rng = random.Random(31)
    cuts = 0
    for _ in range(3_000):
        entries = [_entry(rng.randint(0, 10**6), b'{"i":"%d"}' % i, b"b" * rng.randint(0, 30)) for i in range(3)]
        cuts += _agrees(damaged(rng, _reply(entries), b"0123456789*$\r\n-+hbsx")) is not None
    assert cuts > 100  # some damage leaves a valid page (a digit of an id or a body byte changed)


@pytest.mark.parametrize(
    "raw",
    [
        b"*0\r\n",
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        _reply([(b"1-0", [b"h", b"{}", b"b", b"x"])]),  # no store time
        _reply([(b"1-0", [b"h", b"{}", b"b", b"x", b"s", b"1", b"p", b"{}"])]),  # another field
        _reply([(b"1-0", [b"b", b"x", b"h", b"{}", b"s", b"1"])]),  # another order
        _reply([_entry(1, b"{}", b"x")])[:-3],  # cut short
        _reply([_entry(1, b"{}", b"x"), _entry(2, b"{}", b"y")]).replace(b"*2\r\n$", b"*3\r\n$", 1),
    ],
)
def test_other_replies_are_left_to_hiredis(raw: bytes) -> None:
    assert _cut(raw) is None


def test_a_value_ending_in_pong_reads_on() -> None:
    """A read that stops right after a value ending in ``+PONG`` is not taken for the whole reply."""
    raw = _reply([_entry(1, b"{}", b"x+PONG"), _entry(2, b"{}", b"y")]) + _PONG
    stop = raw.index(b"+PONG") + len(_PONG)
    buf = np.frombuffer(raw + bytes(64), dtype=np.uint8)
    pages = RawPages(object())
    assert pages._parsed(buf, stop) is None
    assert pages._parsed(buf, len(raw)).entries() == _hiredis(raw[: -len(_PONG)])


def _stream(r: redis.Redis, key: str, n: int, **extra: bytes) -> None:
    for i in range(n):
        r.xadd(key, {b"h": b'{"i":"%d"}' % i, b"b": b"body-%d" % i, b"s": b"%d" % (1000 + i), **extra}, id=f"{i + 1}-0")


def test_raw_pages_read_what_xrange_reads(r: redis.Redis, redis_url: str) -> None:
    _stream(r, "s:common", 5000)
    _stream(r, "s:other", 10, p=b"{}")
    client = redis.Redis.from_url(redis_url)
    client.set_response_callback("XRANGE", lambda resp, **_: resp)
    pages = RawPages(client)
    try:
        common = pages.xrange("s:common", "-", "+", 5000)
        assert isinstance(common, RawColumns)
        assert common.entries() == client.xrange("s:common", count=5000)
        other = pages.xrange("s:other", "2", "5", 100)
        assert other == client.xrange("s:other", min="2", max="5")
        assert pages.xrange("s:none", "-", "+", 10) == []
        r.set("s:string", "x")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            pages.xrange("s:string", "-", "+", 10)
        assert isinstance(pages.xrange("s:common", "10", "20", 100), RawColumns)  # the connection still aligned
    finally:
        pages.close()
    assert len(client.connection_pool._in_use_connections) == 0


def _client_ids(r: redis.Redis) -> set[int]:
    return {c["id"] for c in r.client_list()}


def test_a_page_sent_ahead_is_the_page_asked_for_and_nothing_else(r: redis.Redis, redis_url: str) -> None:
    """``prefetch`` sends an ``XRANGE`` before it is asked for; the ``xrange`` with the same
    arguments reads its reply (one request, not two), one with other arguments drops it (its
    connection closed: an unread reply never answers a later request), and ``close`` with one
    unread gives no connection with a reply pending back to the pool."""
    _stream(r, "s:ahead", 300)
    client = redis.Redis.from_url(redis_url)
    client.set_response_callback("XRANGE", lambda resp, **_: resp)
    expected = client.xrange("s:ahead", count=300)
    sent: list[tuple[object, ...]] = []
    real = hiredis.pack_command

    def spy(args: tuple[object, ...]) -> bytes:
        sent.append(args)
        return real(args)

    pages = RawPages(client)
    try:
        first = pages.xrange("s:ahead", "-", "+", 100)
        pages.prefetch("s:ahead", "(100-0", "+", 100)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(resp_pages.hiredis, "pack_command", spy)
            second = pages.xrange("s:ahead", "(100-0", "+", 100)
        assert sent == []  # read, not asked again
        assert first.entries() + second.entries() == expected[:200]  # type: ignore[union-attr]
        before = _client_ids(r)
        pages.prefetch("s:ahead", "(200-0", "+", 100)
        other = pages.xrange("s:ahead", "(250-0", "+", 10)  # not what was sent ahead
        assert other.entries() == expected[250:260]  # type: ignore[union-attr]
        assert _client_ids(r) != before  # the connection holding the unread reply was closed
        pages.prefetch("s:ahead", "(260-0", "+", 100)
    finally:
        pages.close()
    # The connection with a reply unread was closed before it went back: the pool's next user reads
    # its own reply, not that page.
    assert client.xrange("s:ahead", min="1-0", max="1-0") == expected[:1]
    assert client.ping() is True


def test_a_connection_dropped_after_a_page_was_sent_ahead_asks_again(r: redis.Redis, redis_url: str) -> None:
    _stream(r, "s:ahead-drop", 50)
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 1))
    client.set_response_callback("XRANGE", lambda resp, **_: resp)
    pages = RawPages(client)
    try:
        pages.xrange("s:ahead-drop", "-", "+", 10)
        pages.prefetch("s:ahead-drop", "(10-0", "+", 40)
        r.client_kill_filter(skipme=True, _type="normal")  # the reader's connection, with its request
        got = pages.xrange("s:ahead-drop", "(10-0", "+", 40)
    finally:
        pages.close()
    assert got.entries() == client.xrange("s:ahead-drop", count=50)[10:]  # type: ignore[union-attr]


def test_a_send_ahead_interrupted_after_its_bytes_left_never_leaves_its_reply_to_the_pool(
        r: redis.Redis, redis_url: str) -> None:
    """A ``KeyboardInterrupt`` (a signal's exception) right after ``prefetch``'s bytes went out: the
    request is already marked, so ``close`` closes its connection rather than giving a reply nobody
    will read to the pool's next user (whose ``PING`` would get the page)."""
    _stream(r, "s:interrupted", 100)
    client = redis.Redis.from_url(redis_url)
    pages = RawPages(client)
    pages.xrange("s:interrupted", "-", "+", 10)
    conn = pages._conn
    real = conn.send_packed_command

    def sent_then_interrupted(command: object, check_health: bool = True) -> None:
        real(command, check_health)
        raise KeyboardInterrupt

    conn.send_packed_command = sent_then_interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            pages.prefetch("s:interrupted", "(10-0", "+", 10)
    finally:
        del conn.send_packed_command
        pages.close()
    time.sleep(0.05)  # the page would be in this socket's buffer by now
    assert client.ping() is True


def test_pages_of_messages_about_a_page_each_are_not_asked_for_ahead(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply sent ahead waits in Redis's memory while the page before is converted: with entries
    about a page each (large messages), the next one is asked for only when it is read."""
    from mqorder import Producer
    from mqorder.spark import reader as R
    from mqorder.spark.options import Connection

    p = Producer(redis_url)
    try:
        p.create_topic("ahead-big", queues=1)
        p.send_orderly_batch("ahead-big", [("k", b"x" * 4096) for _ in range(200)])
    finally:
        p.close()
    prefetched: list[object] = []
    real = RawPages.prefetch
    monkeypatch.setattr(RawPages, "prefetch", lambda self, *a: (prefetched.append(a), real(self, *a))[1])
    conn = Connection(redis_url)
    spans, limits = R.topic_layout(conn, "ahead-big")
    group = R.RangeGroup(tuple(R.QueueRange("ahead-big", s, *limits[s.index]) for s in spans))
    assert sum(b.num_rows for b in R.read_group(conn, group)) == 200
    assert len(prefetched) > 0  # 1 MB pages of 4 KB messages: the next page asked for ahead
    prefetched.clear()
    monkeypatch.setattr(R, "PAGE_BYTES", 4096)  # now each message is about a page
    assert sum(b.num_rows for b in R.read_group(conn, group)) == 200
    assert prefetched == []


def test_a_dropped_connection_is_retried_as_the_client_says(
    r: redis.Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stream(r, "s:retry", 100)
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 1))
    pages = RawPages(client)
    calls = {"n": 0}
    real = RawPages._round_trip

    def flaky(self: RawPages, conn: object, packed: bytes, size: int, send: bool = True) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            conn.disconnect()  # type: ignore[attr-defined]
            raise redis.ConnectionError("dropped")
        return real(self, conn, packed, size, send)

    monkeypatch.setattr(resp_pages.RawPages, "_round_trip", flaky)
    try:
        got = pages.xrange("s:retry", "-", "+", 1000)
    finally:
        pages.close()
    assert isinstance(got, RawColumns) and len(got) == 100 and calls["n"] == 2


def test_bodies_dense_in_stars_go_to_hiredis_and_a_few_stars_still_cut(cutter: str) -> None:
    """Each ``*`` of a page costs numpy's cut several 8-byte positions: a page whose bodies are
    mostly ``*`` (a 100 MB page took 2.2 GB and 7 s) is left to hiredis; bodies with a few are cut.
    The compiled cut walks the reply once and cuts both."""
    dense = _reply([_entry(i, b'{"i":"%d"}' % i, b"*" * 20_000) for i in range(20)])
    if cutter == "native":
        assert _agrees(dense) is not None
    else:
        assert _cut(dense) is None
    few = _reply([_entry(i, b'{"i":"%d"}' % i, b"a*b*c") for i in range(2000)])
    assert _agrees(few) is not None


def test_a_user_without_ping_reads_at_once_and_sees_real_errors(r: redis.Redis, redis_url: str) -> None:
    """The page's end is marked by a PING. An ACL user allowed ``+@read`` only is refused it
    (NOPERM): the read used to wait for a "+PONG" that never came, then fail on the socket's
    timeout, hiding the real error. The error line ends the read now; the client reads its
    later pages without the PING."""
    _stream(r, "s:acl", 300)
    r.acl_setuser("pages-reader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@read"], reset=True)
    host, port = r.connection_pool.connection_kwargs["host"], r.connection_pool.connection_kwargs["port"]
    client = redis.Redis(host=host, port=port, username="pages-reader", password="pw", socket_timeout=5)
    client.set_response_callback("XRANGE", lambda resp, **_: resp)
    pages = RawPages(client)
    try:
        with pytest.raises(redis.ResponseError, match="no permissions to run the 'ping' command"):
            client.ping()  # the user's rights are as the test means them
        t0 = time.monotonic()
        first = pages.xrange("s:acl", "-", "+", 100)
        later = pages.xrange("s:acl", "101", "+", 1000)
        took = time.monotonic() - t0
        assert list(first) == client.xrange("s:acl", count=100)
        assert list(later) == client.xrange("s:acl", min="101", max="+", count=1000)
        assert took < 4, took  # not the 5 s socket timeout
    finally:
        pages.close()
        client.close()
        r.acl_deluser("pages-reader")


def test_the_compiled_functions_refuse_buffers_smaller_than_they_are_told() -> None:
    """Counts that would overflow a size computed by multiplying (and ranges out of the data) are
    refused with a ValueError, never read or written past a buffer (a review found both)."""
    from mqorder.spark.native import _resp

    assert _resp is not None, "mqorder.spark._resp is not built: run `make install`"
    entry = _reply([(b"1-0", [b"r", b"{}"])])[4:]
    none = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="int64 items"):
        _resp.cut_spans(entry, 0, len(entry), 2**59, b"r", none)
    with pytest.raises(ValueError, match="n \\+ 1 int64"):
        _resp.parse_template(b"{}", np.array([0]), 2**61, (b"{", b"}"), b"i", none, none)
    with pytest.raises(ValueError, match="byte 0xff"):
        _resp.parse_template(b"{}", np.array([0, 2]), 1, (b"{", b"}"), b"\xff", none, none)
    with pytest.raises(ValueError, match="string value 0"):
        _resp.parse_template(b"{}", np.array([0, 2]), 1, (b"{", b"}"), b"s", none, none)
    with pytest.raises(ValueError, match="not within"):
        _resp.gather(b"abc", np.array([1], dtype=np.int64), np.array([9], dtype=np.int64))
    with pytest.raises(OverflowError):
        big = np.array([0] * 3, dtype=np.int64)
        _resp.gather(np.empty(2**30, dtype=np.uint8), big, big + 2**30)

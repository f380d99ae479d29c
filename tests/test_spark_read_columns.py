"""The readers' column parsers (``mqorder.spark.headers``, ``mqorder.spark.ledger_parse``) against
the JSON readers they stand in for: the same values for every page they accept, and None (the
JSON reader's turn) for every page that is not exactly the common shape. Pure pyarrow: no Spark."""

from __future__ import annotations

import io
import random
import re

import orjson
import pyarrow as pa
import pyarrow.json as pj
import pytest

from mqorder.codec import encode_header
from mqorder.spark import headers, ledger, ledger_parse
from mqorder.spark import reader as R
from tests.support import damaged, use_parsers


@pytest.fixture(autouse=True, params=["native", "numpy"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled header parse and gather, or numpy's (``use_parsers``)."""
    use_parsers(request.param, monkeypatch)
    return request.param


def _json_headers(heads: list[bytes]) -> list[pa.Array] | str:
    """The columns the reader built before the numpy path (Arrow's JSON reader, else Python)."""
    saved = headers.parse
    headers.parse = lambda h: None  # type: ignore[assignment]
    try:
        return R._headers_arrow(heads) or R._headers_python(heads)
    except pa.ArrowInvalid as exc:
        return f"ArrowInvalid: {exc}"
    finally:
        headers.parse = saved  # type: ignore[assignment]


def _fast_headers(heads: list[bytes]) -> list[pa.Array] | str:
    try:
        return R._headers_arrow(heads) or R._headers_python(heads)
    except pa.ArrowInvalid as exc:
        return f"ArrowInvalid: {exc}"


def _same(a: list[pa.Array] | str, b: list[pa.Array] | str) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return all(x.equals(y) for x, y in zip(a, b, strict=True))


GOOD_HEADERS = [encode_header(f"ID{i:030X}", keys=[f"key-{i}"], born_ms=1_700_000_000_000 + i, key_hash=i * 7919)
                for i in range(500)] + [
    encode_header("é-ü", keys=["ключ 🙂"], born_ms=0, key_hash=0),
    encode_header("", keys=[""], born_ms=5, key_hash=-3),
    b'{"i":"a","b":-0,"k":["x"],"h":-7}',
]

BAD_HEADERS = [
    b'{"i":"a","b":1,"k":["x"],"h":01}', b'{"i":"a","b":01,"k":["x"],"h":1}', b'{"i":"a","b":0x1,"k":["x"],"h":1}',
    b'{"i":"a","b":1,"k":["x","y"],"h":1}', b'{"i":"a","b":1,"k":["x"],"t":"z","h":1}',
    b'{"i":"a\\"","b":1,"k":["x"],"h":1}', b'{"i":"a","b":1, "k":["x"],"h":1}', b'{"i":"a","b":1,"k":["x"],"h":1} ',
    b'{"i":"a","b":1.0,"k":["x"],"h":1}', b'{"i":"a","b":-,"k":["x"],"h":1}', b'{"i":"a","b":1,"k":["x"],"h":}',
    b'{"i":"a","b":1,"k":["x"],"q":1}', b'{"j":"a","b":1,"k":["x"],"h":1}', b'{"i":"a","b":1,"k":["\xff"],"h":1}',
    b'{"i":"a","b":1,"k":["x"],"p":{"n":"1"}}', b'{"i":"a","b":1,"k":["x\x01"],"h":1}', b'{"i":"a","b":1,"k":["x"],"h":1',
    b'{"i":"a","b":1,"k":["x"]"h":1}', b'{"b":1,"i":"a","k":["x"],"h":1}', b"", b"[]",
    b'{"i":"a","b":1234567890123456789,"k":["x"],"h":1}', b'{"i":"a","b":99999999999999999999,"k":["x"],"h":1}',
    encode_header("m", keys=None, born_ms=1), encode_header("m", keys=["k"], tags="t", born_ms=1, key_hash=1),
]


def test_common_headers_parse_as_json_does() -> None:
    assert headers.parse(GOOD_HEADERS) is not None
    assert _same(_fast_headers(GOOD_HEADERS), _json_headers(GOOD_HEADERS))


@pytest.mark.parametrize("bad", BAD_HEADERS)
def test_other_headers_fall_back_or_agree(bad: bytes) -> None:
    for page in ([bad], [*GOOD_HEADERS[:3], bad], [bad, *GOOD_HEADERS[:3]]):
        if bad != BAD_HEADERS[-4]:  # a born time past Spark's range: accepted by both, refused by both
            assert headers.parse(page) is None, page
        assert _same(_fast_headers(page), _json_headers(page))


#: The common shape, as a regular expression: what ``headers.parse`` may accept, and all of it
#: (with both numbers within int64 and the strings UTF-8).
_SHAPE = re.compile(rb'\{"i":"([^"\\\x00-\x1f]*)","b":(-?(?:0|[1-9][0-9]*)),"k":\["([^"\\\x00-\x1f]*)"\],'
                    rb'"h":(-?(?:0|[1-9][0-9]*))\}')


def _shape(h: bytes) -> tuple[str, str, int, int] | None:
    m = _SHAPE.fullmatch(h)
    if m is None or not all(-(2**63) <= int(m[g]) < 2**63 for g in (2, 4)):
        return None
    try:
        return m[1].decode(), m[3].decode(), int(m[2]), int(m[4])
    except UnicodeDecodeError:
        return None


def test_damaged_headers_parse_only_when_of_the_shape() -> None:
    """Bytes of common headers changed, dropped or doubled at random: a page parses exactly when
    every header is of the shape (``_SHAPE``), to the values the expression reads from it."""
    rng = random.Random(37)
    alphabet = b'{}[]":,-0123456789ikbhx\\\x01\xff '
    parsed = 0
    for _ in range(3_000):
        page = [encode_header(f"id{rng.randint(0, 99)}", keys=[f"k{rng.randint(0, 9)}"],
                              born_ms=rng.randint(-(2**63), 2**63 - 1), key_hash=rng.randint(-5, 5))
                for _ in range(rng.randint(1, 3))]
        i = rng.randrange(len(page))
        page[i] = damaged(rng, page[i], alphabet, least=0)
        want = [_shape(x) for x in page]
        got = headers.parse(page)
        if any(w is None for w in want):
            assert got is None, page
        else:
            assert got is not None, page
            ids, first_keys, born, hashes = got
            assert list(zip(ids.to_pylist(), first_keys.to_pylist(), born.to_pylist(), hashes.to_pylist(),
                            strict=True)) == want
            parsed += 1
    assert parsed > 500


def test_entry_ids_and_store_times() -> None:
    ids = [b"0-1", b"17-0", b"9223372036854775806-5"]
    assert headers.entry_offsets(ids).to_pylist() == [0, 17, 9223372036854775806]
    for bad in ([b"1-2-3"], [b"12"], [b"-1"], [b"a-1"], [b""]):
        assert headers.entry_offsets(bad) is None
    assert headers.digit_integers([b"1795685507930", b"0"]).to_pylist() == [1795685507930, 0]
    for bad in ([b"-1"], [b"0x1"], [b""], [b"1", b""], [b"\xd9\xa3"], [b"99999999999999999999"], [b" 1"]):
        assert headers.digit_integers(bad) is None


def _record(rng: random.Random, **over: object) -> bytes:
    rec = {"group": "g", "topic": "t", "broker": "broker-a", "queue": rng.randrange(16), "offset": rng.randrange(10**9),
           "msg_id": "", "key": f"key-{rng.randrange(999)}", "key_hash": rng.randrange(-1, 2**32),
           "born_ms": 1_795_685_582_089 + rng.randrange(10**6),
           "start_ms": round(1_795_685_582_089 + rng.random() * 1e6, 3),
           "end_ms": round(1_795_685_582_089.0 + rng.randrange(1000), 3), "attempt": 0, "epoch": rng.randrange(5),
           "client": "c@h", "run": "r-1", "outcome": rng.choice(["SUCCESS", "DLQ", "RETRY"])}
    rec.update(over)
    return orjson.dumps(rec)


def _both(raws: list[bytes], columns: tuple[str, ...] = tuple(ledger.LEDGER_ARROW_SCHEMA.names)) -> tuple[object, object]:
    parse = ledger._json_options(columns, "t")
    fast = ledger_parse.parse(raws, parse.explicit_schema)
    try:
        slow: object = pj.read_json(io.BytesIO(b"\n".join(raws)), parse_options=parse, read_options=ledger._JSON_READ)
    except pa.ArrowInvalid as exc:
        slow = str(exc)
    return fast, slow


def test_engine_ledger_records_parse_as_json_does() -> None:
    rng = random.Random(3)
    good = [_record(rng) for _ in range(2000)] + [
        _record(rng, key="ключ é", start_ms=0.5, end_ms=-12.25, queue=0, born_ms=-1, msg_id="x y", attempt=-0)]
    for columns in (tuple(ledger.LEDGER_ARROW_SCHEMA.names), ("broker", "queue", "offset", "key", "start_ms", "outcome")):
        fast, slow = _both(good, columns)
        assert isinstance(fast, pa.Table) and isinstance(slow, pa.Table)
        assert fast.equals(slow)


def test_other_ledger_records_fall_back() -> None:
    rng = random.Random(4)
    rec = _record(rng)
    bad = [_record(rng, key=None), _record(rng, born_ms=None), _record(rng, start_ms=1e20), _record(rng, start_ms=5),
           _record(rng, key='a"b'), _record(rng, key="a\\b"), _record(rng, key="\x01"), _record(rng, queue=2**40),
           _record(rng, start_ms=1e-7), rec.replace(b'"start_ms":', b'"start_ms": '), rec.replace(b'"epoch"', b'"epocj"'),
           rec.replace(b'"queue":', b'"queue":0'), rec.replace(b'"attempt":0', b'"attempt":0.0'), rec + b" ",
           rec.replace(b'"end_ms":', b'"end_ms":0'), rec.replace(b'"end_ms":', b'"end_ms":+'),
           rec.replace(b'"end_ms":', b'"end_ms":.'), rec.replace(b"SUCCESS", b"\xff\xfe").replace(b"DLQ", b"\xff\xfe"),
           rec.replace(b'"attempt":0', b'"attempt":1e2'), rec.replace(b'"outcome"', b'"outcomes"'),
           rec.replace(b'"queue":', b'"queue":""'), _record(rng, key_hash=None), b"{}", b"",
           orjson.dumps({k: v for k, v in orjson.loads(rec).items() if k != "key_hash"})]  # an older engine's
    for b in bad:
        for page in ([b], [_record(rng) for _ in range(3)] + [b]):
            assert ledger_parse.parse(page, ledger._json_options(tuple(ledger.LEDGER_ARROW_SCHEMA.names), "t")
                                      .explicit_schema) is None, b


def test_damaged_ledger_records_parse_as_json_does_or_fall_back() -> None:
    """Bytes of engine records changed, dropped or doubled at random: a page the fast parse takes
    holds exactly what Arrow's JSON reader reads from it, and many damaged pages are taken (a digit
    or a letter of a value changed) or refused."""
    rng = random.Random(41)
    alphabet = b'{}":,.-0123456789eE+aq\\\x01\xff '
    taken = 0
    for _ in range(1_500):
        page = [_record(rng) for _ in range(rng.randint(1, 3))]
        i = rng.randrange(len(page))
        page[i] = damaged(rng, page[i], alphabet)
        # The whole schema, or a projection: the numbers it leaves out are checked all the same.
        fast, slow = _both(page) if rng.random() < 0.5 else _both(page, ("broker", "queue", "key", "outcome"))
        if fast is not None:
            assert isinstance(slow, pa.Table) and fast.equals(slow), page
            taken += 1
    assert taken > 150


def test_pages_of_large_messages_stay_near_page_bytes() -> None:
    """A page after the first asks for about ``PAGE_BYTES`` of entries the size of the last page's,
    down to one entry: it once asked for at least 1,000, 4 GB of 4 MB messages (and past 2 GiB a
    page cannot become an Arrow binary column)."""
    big = [[b"%d-0" % i, [b"h", b"{}", b"b", b"x" * (4 << 20), b"s", b"1"]] for i in range(2)]
    assert R.page_rows(big) == 1
    medium = [[b"%d-0" % i, [b"h", b"{}", b"b", b"x" * (64 << 10), b"s", b"1"]] for i in range(2)]
    assert R.PAGE_BYTES // (65 << 10) <= R.page_rows(medium) <= R.PAGE_BYTES // (64 << 10)  # of 64 KB entries
    hundred = [[b"%d-0" % i, [b"h", b"{}", b"b", b"x" * 100, b"s", b"1"]] for i in range(2)]
    assert R.PAGE_BYTES // 120 <= R.page_rows(hundred) <= R.PAGE_BYTES // 100
    tiny = [[b"%d-0" % i, [b"h", b"{}", b"b", b"x", b"s", b"1"]] for i in range(2)]
    assert R.page_rows(tiny) == R.MAX_PAGE
    assert R.FIRST_PAGE * (4 << 20) < 2**31  # the first page of the default largest messages fits

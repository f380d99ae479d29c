"""Reading a topic into Spark: one row per stored message, one Spark partition per queue range.

Offsets follow Spark's Kafka source: ``startingOffsets`` / ``endingOffsets`` are ``earliest``,
``latest``, or JSON giving an offset per queue index (``{"0": 12, "3": -2}``, or Kafka's
``{"<topic>": {...}}``), ``-2`` meaning earliest and ``-1`` latest. A range is half open,
``[start, end)``, and never goes past what is stored when it is planned (the queue's next offset):
what is read is fixed at planning, so a retried task reads the same rows.

Rows are built as Arrow record batches straight from the raw ``XRANGE`` replies, a page at a time
and column by column: the reply's bytes are cut into binary columns with numpy, never becoming
Python objects (``resp_pages``), offsets and store times are cast by Arrow compute, headers of the
common shape are cut with numpy (``headers``, else Arrow's JSON reader) and bodies are passed
through untouched, so no Python code runs per message. A page that holds anything else
(properties, a damaged header, another field layout) is parsed by hiredis and takes the careful
path, message by message, and gives the same rows. Pages are sized from the stored entries: the
first ``XRANGE`` of a range fetches ``FIRST_PAGE`` entries (fewer if ``maxMessageSize`` is over
4 MB: ``first_page``), and later ones about ``PAGE_BYTES`` of entries of that size. A page makes
one Arrow batch, or several if its values pass ``resp_pages.MAX_BATCH_BYTES`` (large messages, or
their size jumping between pages): no batch holds more, so none overflows Arrow's 2 GiB binary
columns.

Python's cyclic garbage collector is paused while a page is fetched and converted: a reply hiredis parses is
thousands of small lists and strings that only reference counting frees, and a collection walking
them on every allocation threshold cost more than the parsing itself (2-3x on a 100-byte body).
"""

from __future__ import annotations

import gc
import io
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeAlias

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
from pyspark.sql.datasource import DataSourceReader, InputPartition

from mqorder import keys
from mqorder.errors import ConfigError
from mqorder.model import MessageQueue
from mqorder.spark import headers, resp_pages
from mqorder.spark.options import Connection, ReadOptions
from mqorder.spark.queues import QueueRef
from mqorder.spark.resp_pages import RawColumns, RawPages, SplitPage, pieces
from mqorder.spark.worker_gc import freeze_imports
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager

#: The schema of ``spark.read.format("mqorder")`` (as DDL for ``DataSource.schema``).
SCHEMA_DDL = (
    "topic STRING, queue INT, offset BIGINT, msg_id STRING, key STRING, tags STRING, "
    "properties MAP<STRING, STRING>, body BINARY, born_timestamp TIMESTAMP, store_timestamp TIMESTAMP"
)
#: Spark's timestamps are microseconds, UTC; stored times are milliseconds.
_TS = pa.timestamp("us", tz="UTC")
_TS_MS = pa.timestamp("ms", tz="UTC")
ARROW_SCHEMA = pa.schema([
    ("topic", pa.string()),
    ("queue", pa.int32()),
    ("offset", pa.int64()),
    ("msg_id", pa.string()),
    ("key", pa.string()),
    ("tags", pa.string()),
    ("properties", pa.map_(pa.string(), pa.string())),
    ("body", pa.binary()),
    ("born_timestamp", _TS),
    ("store_timestamp", _TS),
])
#: Entries the first ``XRANGE`` of a range fetches (it sizes the next pages): few, since their size
#: is not known yet (2,000 messages of 4 MB, the default largest, were an 8 GB reply; a page over
#: 2 GiB cannot become an Arrow binary column at all). One round trip more per range.
FIRST_PAGE = 64
#: Bytes the first page may reach with every message as large as ``maxMessageSize`` allows:
#: ``FIRST_PAGE`` of the default 4 MB. A larger limit asks for fewer (``first_page``): 64 messages
#: of 40 MB were a 2.5 GB reply, read whole before any of it is split into batches.
FIRST_PAGE_BYTES = FIRST_PAGE * (4 << 20)
#: Bytes of stream entries a later page aims at, and its bounds in entries: big pages mean fewer
#: round trips and Arrow batches, but one ``XRANGE`` holds the broker for its whole page, and
#: Redis builds the whole reply before it writes any: a 1 MB reply stays in its caches where a
#: 4 MB one did not (the same 300,000 messages cost Redis 0.14-0.15 CPU s read in 1 MB pages
#: against 0.20 s in 4 MB pages, the reader's own CPU about the same; a count 1.11x faster).
#: The lower bound is one entry: a page of large messages stays near ``PAGE_BYTES`` (it once
#: had to hold 1,000 of them, 4 GB of 4 MB messages).
PAGE_BYTES = 1 << 20
MIN_PAGE, MAX_PAGE = 1, 20_000
EARLIEST, LATEST = -2, -1


@dataclass(frozen=True)
class QueueRange(InputPartition):
    """Offsets ``[start, end)`` of one queue: the unit a read task reads."""

    topic: str
    span: QueueRef
    start: int
    end: int


def queue_spans(brokers: BrokerRegistry, topic: str) -> list[QueueRef]:
    """The topic's queues in route order; ``TopicNotFoundError`` (with a hint) if it does not exist."""
    route = TopicManager(brokers).describe_topic(topic)
    return [QueueRef(i, mq.broker_name, mq.queue_id) for i, mq in enumerate(route.message_queues)]


def _mq(topic: str, span: QueueRef) -> MessageQueue:
    return MessageQueue(topic, span.broker, span.queue_id)


def bounds(brokers: BrokerRegistry, topic: str, spans: Sequence[QueueRef]) -> dict[int, tuple[int, int]]:
    """(earliest stored offset, next offset) of every queue, in one round trip per broker."""
    out: dict[int, tuple[int, int]] = {}
    for name, group in group_by_broker(spans, lambda s: _mq(topic, s)).items():
        pipe = brokers.get(name).client.pipeline(transaction=False)
        for s in group:
            tag = _mq(topic, s).tag
            pipe.get(keys.queue_next(tag))
            pipe.xrange(keys.queue_log(tag), count=1)
        replies = pipe.execute()
        for j, s in enumerate(group):
            nxt = int(replies[2 * j] or 0)
            first = replies[2 * j + 1]
            earliest = int(first[0][0].split(b"-", 1)[0]) if first else nxt
            out[s.index] = (earliest, nxt)
    return out


def parse_offsets(spec: str, topic: str, spans: Sequence[QueueRef], default: int, what: str) -> dict[int, int]:
    """``earliest`` / ``latest`` / JSON into {queue index: offset or EARLIEST / LATEST}."""
    s = spec.strip()
    if s.lower() == "earliest":
        return {q.index: EARLIEST for q in spans}
    if s.lower() == "latest":
        return {q.index: LATEST for q in spans}
    try:
        raw = json.loads(s)
    except ValueError:
        raise ConfigError(f"{what}={spec!r}: use earliest, latest, or JSON such as "
                          f"'{{\"0\": 42, \"1\": -2}}' (queue index -> offset; -2 earliest, -1 latest)") from None
    if isinstance(raw, dict) and set(raw) == {topic} and isinstance(raw[topic], dict):
        raw = raw[topic]  # Kafka's {"topic": {"partition": offset}}
    elif isinstance(raw, dict) and raw and all(isinstance(v, dict) for v in raw.values()):
        # Kafka's form naming other topics (a copied option, a typo): it said "not a queue index".
        raise ConfigError(f"{what} names topic(s) {sorted(raw)!r}, but this read is of topic {topic!r}: give "
                          f"'{{\"{topic}\": {{\"0\": 42}}}}' or just '{{\"0\": 42}}' (queue index -> offset)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} must be a JSON object of queue index to offset, got {spec!r}")
    out = {q.index: default for q in spans}
    for k, v in raw.items():
        try:
            index = int(k)
        except ValueError:
            raise ConfigError(f"{what}: {k!r} is not a queue index of topic {topic!r} (0..{len(spans) - 1})") from None
        if index not in out:
            raise ConfigError(f"{what}: topic {topic!r} has no queue {index} (it has {len(spans)})")
        if isinstance(v, bool) or not isinstance(v, int) or v < EARLIEST:
            raise ConfigError(f"{what}: offset of queue {index} must be an integer >= -2, got {v!r}")
        out[index] = v
    return out


def check_batch_range(topic: str, first: Mapping[int, int], last: Mapping[int, int]) -> None:
    """A batch read whose start is past its end for some queue (both given as offsets), refused as
    Kafka's source refuses it: it once gave an empty DataFrame without a word. ``latest`` as a
    start or ``earliest`` as an end stay what the docs say (a queue read from its end: nothing)."""
    past = sorted(i for i, v in first.items() if v >= 0 and last.get(i, LATEST) >= 0 and v > last[i])
    if past:
        shown = ", ".join(f"queue {i}: {first[i]} > {last[i]}" for i in past[:5])
        raise ConfigError(f"startingOffsets is past endingOffsets for topic {topic!r} ({shown}); the start of a "
                          "range must not be after its end")


def resolve(offsets: Mapping[int, int], limits: Mapping[int, tuple[int, int]]) -> dict[int, int]:
    """Concrete offsets: EARLIEST / LATEST looked up, anything else clamped into what is stored."""
    out = {}
    for index, off in offsets.items():
        earliest, nxt = limits[index]
        if off == EARLIEST:
            out[index] = earliest
        elif off == LATEST:
            out[index] = nxt
        else:
            out[index] = min(max(off, 0), nxt)
    return out


def split(topic: str, spans: Sequence[QueueRef], start: Mapping[int, int], end: Mapping[int, int],
          max_rows: int) -> list[QueueRange]:
    """One range per queue with something to read, large ranges cut into ``max_rows`` pieces."""
    parts = []
    for s in spans:
        a, b = start.get(s.index, 0), end.get(s.index, 0)
        while a < b:
            parts.append(QueueRange(topic, s, a, min(b, a + max_rows)))
            a += max_rows
    return parts


@dataclass(frozen=True)
class RangeGroup(InputPartition):
    """The queue ranges one read task reads, one after the other, on one connection per broker.

    A task costs about as much as reading tens of thousands of messages (a Python runner started
    and fed by the JVM, its plan and projection built, its result sent back), whatever it reads:
    with a partition per queue, a 16-queue topic of 300,000 messages cost 16 of them, and a count of
    3,000 messages took as long as one of 300,000. Groups cut that to what keeps the cores busy."""

    ranges: tuple[QueueRange, ...]


def partition_count(rows: int, max_rows: int, min_partitions: int) -> int:
    """Read tasks for ``rows`` offsets: at least ``min_partitions`` (the cores to keep busy), at most
    ``max_rows`` each, rounded up to a multiple of ``min_partitions`` so the last round of tasks is
    as full as the first; never more than there are offsets."""
    m = max(1, min_partitions)
    n = max(m, math.ceil(rows / max(1, max_rows)))
    return max(1, min(rows, math.ceil(n / m) * m))


def default_min_partitions() -> int:
    """The cores of the process planning the read (the driver's machine; a Connect server's): what
    ``local[*]`` runs on. A cluster with more cores than its driver sets ``minPartitions``."""
    return os.cpu_count() or 2


def plan_partitions(topic: str, spans: Sequence[QueueRef], start: Mapping[int, int], end: Mapping[int, int],
                    max_rows: int, min_partitions: int | None = None) -> list[RangeGroup]:
    """The offsets ``[start, end)`` of every queue, in queue order, dealt into ``partition_count``
    groups of equal size, give or take one (a queue's range cut where a group is full): every offset in exactly one
    group, and a group's ranges in queue and offset order. Depends only on its arguments, so a
    stream's replayed micro-batch gets the same groups."""
    ranges = split(topic, spans, start, end, 2**62)
    total = sum(r.end - r.start for r in ranges)
    if not total:
        return []
    n = partition_count(total, max_rows, default_min_partitions() if min_partitions is None else min_partitions)
    sizes = [total // n + (1 if i < total % n else 0) for i in range(n)]  # n groups, within one of each other
    groups: list[RangeGroup] = []
    cur: list[QueueRange] = []
    room = sizes[0]
    for r in ranges:
        a = r.start
        while a < r.end:
            take = min(r.end - a, room)
            cur.append(QueueRange(topic, r.span, a, a + take))
            a, room = a + take, room - take
            if not room:
                groups.append(RangeGroup(tuple(cur)))
                cur, room = [], sizes[len(groups)] if len(groups) < n else 0
    return groups


#: A page of stream entries, or a piece of one whose values pass ``resp_pages.MAX_BATCH_BYTES``:
#: cut into columns from the raw reply (``resp_pages``), or hiredis' lists
#: ``[[id, [field, value, ...]], ...]`` for a page of another layout.
Page: TypeAlias = resp_pages.Piece


def first_page(max_message_size: int) -> int:
    """Entries the first ``XRANGE`` of a range asks for: ``FIRST_PAGE``, fewer when that many
    messages of ``max_message_size`` would pass ``FIRST_PAGE_BYTES``; at least one."""
    return max(MIN_PAGE, min(FIRST_PAGE, FIRST_PAGE_BYTES // max(1, max_message_size)))


def page_rows(entries: resp_pages.Page) -> int:
    """How many entries the next ``XRANGE`` asks for: about ``PAGE_BYTES`` of entries the size of
    these (id and field values counted; the reply's framing is small beside them)."""
    if isinstance(entries, SplitPage):
        size = entries.nbytes / len(entries)
    elif isinstance(entries, RawColumns):
        size = sum(a.nbytes for a in (entries.ids, *entries.values)) / len(entries)
    else:
        size = sum(map(resp_pages.entry_bytes, entries[:64])) / min(len(entries), 64)
    return max(MIN_PAGE, min(MAX_PAGE, int(PAGE_BYTES / max(size, 1.0))))


def last_offset(entries: Page) -> int:
    """The offset of a page's last entry (its id is ``<offset>-<seq>``)."""
    last = entries.ids[-1].as_py() if isinstance(entries, RawColumns) else entries[-1][0]
    return int(text(last).split("-", 1)[0])


def as_entries(entries: Page) -> list[Any]:
    """A page as hiredis' lists, for a careful path that reads entry by entry."""
    return entries.entries() if isinstance(entries, RawColumns) else entries


def read_pages(conn: Connection, part: QueueRange) -> Iterator[Page]:
    """The stream entries of ``part`` in offset order, a page per ``XRANGE`` (``first_page``, then
    sized by ``page_rows``), shared by the topic reader and the audit's stored index. A page whose
    values pass ``resp_pages.MAX_BATCH_BYTES`` comes as several pieces (``resp_pages.SplitPage``),
    in order, each within it (a larger entry alone): one Arrow batch each.

    The cyclic collector is off while a page is fetched (see the module docstring), on again while
    the caller holds it: the caller converts it at once, under ``PausedGC`` too."""
    for _, entries in group_pages(conn, RangeGroup((part,))):
        yield entries


def group_pages(conn: Connection, group: RangeGroup) -> Iterator[tuple[QueueRange, Page]]:
    """``read_pages`` of each range of ``group`` in turn, on one connection per broker (read raw:
    ``resp_pages``)."""
    brokers = conn.registry()
    raw: dict[str, RawPages] = {}
    first = first_page(conn.max_message_size)
    try:
        for part in group.ranges:
            name = part.span.broker
            if name not in raw:
                raw[name] = RawPages(brokers.get(name).client)
            for entries in _pages(raw[name], part, first):
                yield part, entries
    finally:
        for pages in raw.values():
            pages.close()
        brokers.close()


def _pages(raw: RawPages, part: QueueRange, first: int) -> Iterator[Page]:
    log_key = keys.queue_log(_mq(part.topic, part.span).tag)
    hi = f"{part.end - 1}-18446744073709551615"
    nxt, count = part.start, first
    while nxt < part.end:
        with PausedGC():
            page = raw.xrange(log_key, f"{nxt}-0", hi, count)
        if not len(page):
            break
        parts = pieces(page)
        nxt = last_offset(parts[-1]) + 1
        count = page_rows(page)
        # Redis builds the next page while this one is converted and consumed, unless its entries
        # are each about a page (large messages): a reply sent ahead waits in Redis's memory.
        if nxt < part.end and count > MIN_PAGE:
            raw.prefetch(log_key, f"{nxt}-0", hi, count)
        yield from parts


class PausedGC:
    """Pause Python's cyclic garbage collector for a block (re-entrant; restores what it found)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was:
            gc.enable()


def read_range(conn: Connection, part: QueueRange) -> Iterator[pa.RecordBatch]:
    """The messages of ``part`` as Arrow batches, one per page (or piece of one: ``read_pages``)."""
    return read_group(conn, RangeGroup((part,)))


def read_group(conn: Connection, group: RangeGroup) -> Iterator[pa.RecordBatch]:
    """The messages of every range of ``group`` as Arrow batches, one per page (or piece of one:
    ``read_pages``)."""
    for part, entries in group_pages(conn, group):
        with PausedGC():
            batch = _batch(part, entries)
            del entries
        yield batch


def topic_layout(conn: Connection, topic: str) -> tuple[list[QueueRef], dict[int, tuple[int, int]]]:
    """The topic's queues and each one's (earliest stored offset, next offset), read once when a
    read is planned (shared by the topic reader and the audit's stored index)."""
    brokers = conn.registry()
    try:
        spans = queue_spans(brokers, topic)
        return spans, bounds(brokers, topic, spans)
    finally:
        brokers.close()


_Header = tuple[str | None, str | None, str | None, list[tuple[str, str]], int | None, int | None]


def _from_dict(h: dict) -> _Header:
    """(msg id, first key, tags, properties, born ms, key hash) of a parsed header; None for what
    is not there or not of its type (a damaged header still gives its row: a reader never drops one)."""
    mid, k, t, p, b, kh = h.get("i"), h.get("k"), h.get("t"), h.get("p"), h.get("b"), h.get("h")
    return (
        mid if type(mid) is str else None,
        k[0] if type(k) is list and k and type(k[0]) is str else None,
        t if type(t) is str else None,
        [(a, v) for a, v in p.items() if type(v) is str] if type(p) is dict else [],
        b if type(b) is int else None,
        kh if type(kh) is int and -(2**63) <= kh < 2**63 else None,
    )


def _header(raw: bytes) -> _Header:
    try:
        h = orjson.loads(raw)
    except orjson.JSONDecodeError:
        h = None
    return _from_dict(h) if type(h) is dict else (None, None, None, [], None, None)


def _fields(entries: list) -> tuple[list[int], list[bytes], list[bytes], list[int | None]]:
    """Offsets, raw headers, bodies and store times of raw ``XRANGE`` entries, one by one."""
    offsets, heads, bodies, stored = [], [], [], []
    for entry_id, fields in entries:
        if len(fields) == 6 and fields[0] == b"h" and fields[2] == b"b" and fields[4] == b"s":
            raw_h, body, raw_s = fields[1], fields[3], fields[5]  # the layout append_entries writes
        else:
            f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=False))
            raw_h, body, raw_s = f.get(b"h", b"{}"), f.get(b"b", b""), f.get(b"s", b"")
        offsets.append(int(entry_id.split(b"-", 1)[0]))
        heads.append(raw_h)
        bodies.append(body)
        stored.append(int(raw_s) if raw_s.isdigit() else None)
    return offsets, heads, bodies, stored


_LAYOUT = ({b"h"}, {b"b"}, {b"s"})


def columns(entries: Page) -> tuple[pa.Array, headers.Binaries, headers.Binaries, pa.Array] | None:
    """(offsets, raw headers, bodies, store times) of a page in the layout ``append_entries``
    writes (fields h, b, s in that order, store times in digits), the numbers parsed as whole
    columns (``headers``): no Python code per entry. A raw page (``resp_pages``) is in that layout
    already; hiredis' lists are flattened with ``chain`` and cut by strided slices. None for any
    other page (then ``_fields``)."""
    if isinstance(entries, RawColumns):
        heads, bodies, stores = entries.values
        return _typed(entries.ids, heads, bodies, stores)
    if set(map(len, entries)) != {2}:
        return None
    flat = list(chain.from_iterable(entries))  # [id, fields, id, fields, ...]: strided slices below
    ids, fields = flat[0::2], flat[1::2]
    del flat
    if set(map(len, fields)) != {6}:
        return None
    values = list(chain.from_iterable(fields))
    if (set(values[0::6]), set(values[2::6]), set(values[4::6])) != _LAYOUT:
        return None
    heads, bodies, stores = values[1::6], values[3::6], values[5::6]
    del values, fields
    return _typed(ids, heads, bodies, stores)


def _typed(ids: headers.Binaries, heads: headers.Binaries, bodies: headers.Binaries, stores: headers.Binaries
           ) -> tuple[pa.Array, headers.Binaries, headers.Binaries, pa.Array] | None:
    store_ms, offsets = headers.digit_integers(stores), headers.entry_offsets(ids)
    if store_ms is None or offsets is None:
        return None
    try:
        return offsets, heads, bodies, store_ms.cast(_TS_MS).cast(_TS)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


#: The header fields parsed by Arrow's JSON reader (C++); a page with properties, or a header
#: Arrow refuses, is parsed in Python field by field instead.
_HEADER_SCHEMA = pa.schema([("i", pa.string()), ("b", pa.int64()), ("k", pa.list_(pa.string())), ("t", pa.string()),
                            ("h", pa.int64())])
_HEADER_PARSE = pa_json.ParseOptions(explicit_schema=_HEADER_SCHEMA, unexpected_field_behavior="ignore")
_HEADER_READ = pa_json.ReadOptions(use_threads=False, block_size=64 * 1024 * 1024)


def _no_properties(n: int) -> pa.MapArray:
    return pa.MapArray.from_arrays(pa.repeat(pa.scalar(0, pa.int32()), n + 1), pa.array([], pa.string()),
                                   pa.array([], pa.string()))


def _headers_arrow(heads: headers.Binaries) -> list[pa.Array] | None:
    """msg id, first key, tags, properties, born time and key hash (``h``, int64, null where absent)
    columns, or None to take the careful path. Headers of the common shape are cut with numpy
    (``headers.parse``), others read by Arrow's JSON reader."""
    common = headers.parse(heads)
    if common is not None:
        ids, first_keys, born, hashes = common
        n = len(heads)
        try:
            return [ids, first_keys, pa.nulls(n, pa.string()), _no_properties(n), born.cast(_TS_MS).cast(_TS), hashes]
        except pa.ArrowInvalid:  # a born time out of Spark's range: the JSON path says so
            pass
    joined = b"\n".join(headers.as_bytes(heads))
    if b'"p"' in joined or joined.count(b"\n") != len(heads) - 1:
        return None
    try:
        t = pa_json.read_json(io.BytesIO(joined), read_options=_HEADER_READ, parse_options=_HEADER_PARSE)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if t.num_rows != len(heads):
        return None
    n = len(heads)
    # A header without keys has k null: make it [null] so every row keeps one (null) first key.
    k = pc.fill_null(t.column("k").combine_chunks(), pa.scalar([None], pa.list_(pa.string())))
    first_key = pc.list_slice(k, 0, 1, return_fixed_size_list=True).flatten()
    if len(first_key) != n:
        return None
    return [t.column("i").combine_chunks(), first_key, t.column("t").combine_chunks(), _no_properties(n),
            t.column("b").combine_chunks().cast(_TS_MS).cast(_TS), t.column("h").combine_chunks()]


def _headers_python(heads: headers.Binaries) -> list[pa.Array]:
    n = len(heads)
    ids, keys_, tags, props, born, hashes = (zip(*(_header(h) for h in headers.as_bytes(heads)), strict=True) if n
                                             else ([], [], [], [], [], []))
    return [pa.array(ids, pa.string()), pa.array(keys_, pa.string()), pa.array(tags, pa.string()),
            pa.array(props, pa.map_(pa.string(), pa.string())), pa.array(born, _TS_MS).cast(_TS),
            pa.array(hashes, pa.int64())]


def _batch(part: QueueRange, entries: Page) -> pa.RecordBatch:
    n = len(entries)
    cols = columns(entries) if n else None
    heads: headers.Binaries
    bodies: headers.Binaries
    if cols is None:
        offs, heads, bodies, stored = _fields(as_entries(entries))
        offsets, store_times = pa.array(offs, pa.int64()), pa.array(stored, _TS_MS).cast(_TS)
    else:
        offsets, heads, bodies, store_times = cols
    ids, keys_, tags, props, born = ((_headers_arrow(heads) if n else None) or _headers_python(heads))[:5]
    return pa.RecordBatch.from_arrays([
        pa.repeat(pa.scalar(part.topic, pa.string()), n),
        pa.repeat(pa.scalar(part.span.index, pa.int32()), n),
        offsets,
        ids,
        keys_,
        tags,
        props,
        bodies if isinstance(bodies, pa.Array) else pa.array(bodies, pa.binary()),
        born,
        store_times,
    ], schema=ARROW_SCHEMA)


class MQOrderReader(DataSourceReader):
    """``spark.read.format("mqorder")``: the ranges are fixed here, on the planning side."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        spans, limits = topic_layout(opts.conn, opts.topic)
        first = parse_offsets(opts.starting, opts.topic, spans, EARLIEST, "startingOffsets")
        last = parse_offsets(opts.ending, opts.topic, spans, LATEST, "endingOffsets")
        check_batch_range(opts.topic, first, last)
        start, end = resolve(first, limits), resolve(last, limits)
        self.ranges = plan_partitions(opts.topic, spans, start, end, opts.max_rows_per_partition,
                                      opts.min_partitions)

    def partitions(self) -> Sequence[InputPartition]:
        return self.ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        freeze_imports()
        if isinstance(partition, RangeGroup):  # nothing to read gives Spark's placeholder partition
            yield from read_group(self.opts.conn, partition)

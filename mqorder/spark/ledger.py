"""Reading the consumption ledger: ``spark.read.format("mqorder").option("ledger", group).load()``.

The engine writes one record per handled message into ``keys.ledger(group)`` on the broker that
holds the message's queue (``mqorder/consumer/ledger.py``), so a group's ledger is one Redis
stream *per broker*: every broker is read. One row per record, typed columns (``LEDGER_SCHEMA``:
the record's ``FIELDS`` plus ``entry``, the stream entry id).

What a read covers is fixed when it is planned: each broker's stream is cut by entry id into
slices of about ``maxRowsPerPartition`` records (the ids are ``<ms>-<seq>``, so a slice is a time
range, planned from the stream's first and last ids), and the last slice ends at the last id seen
at planning. A retried task therefore reads the same records; records written after planning
belong to the next read. Option ``topic`` keeps only the records of one topic (a group may consume
several), so an audit ships no other topic's rows.

``read_ledger`` is the same read in plain Python (no Spark), for small ledgers and tests.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import redis
from pyspark.sql.datasource import DataSourceReader, InputPartition

from mqorder import keys
from mqorder.consumer.ledger import FIELDS
from mqorder.errors import BrokerUnavailableError, ConfigError, MQOrderError, TopicNotFoundError
from mqorder.names import check_name, check_topic
from mqorder.spark import ledger_parse
from mqorder.spark.headers import Binaries, as_bytes
from mqorder.spark.options import Connection, check_known, connection, lower_options, min_partitions
from mqorder.spark.reader import PausedGC
from mqorder.spark.resp_pages import LEDGER, Piece, RawColumns, RawPages, pieces
from mqorder.spark.worker_gc import freeze_imports
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager

#: The schema of a ledger read, as DDL for ``DataSource.schema`` (``FIELDS`` in order, then ``entry``).
LEDGER_SCHEMA_DDL = (
    "`group` STRING, topic STRING, broker STRING, queue INT, offset BIGINT, msg_id STRING, key STRING, "
    "key_hash BIGINT, born_ms BIGINT, start_ms DOUBLE, end_ms DOUBLE, attempt INT, epoch BIGINT, client STRING, run STRING, "
    "outcome STRING, entry STRING"
)
LEDGER_ARROW_SCHEMA = pa.schema([
    ("group", pa.string()),
    ("topic", pa.string()),
    ("broker", pa.string()),
    ("queue", pa.int32()),
    ("offset", pa.int64()),
    ("msg_id", pa.string()),
    ("key", pa.string()),
    ("key_hash", pa.int64()),
    ("born_ms", pa.int64()),
    ("start_ms", pa.float64()),
    ("end_ms", pa.float64()),
    ("attempt", pa.int32()),
    ("epoch", pa.int64()),
    ("client", pa.string()),
    ("run", pa.string()),
    ("outcome", pa.string()),
    ("entry", pa.string()),
])
assert tuple(LEDGER_ARROW_SCHEMA.names[: len(FIELDS)]) == FIELDS, "the reader's columns follow ledger.FIELDS"

#: Records fetched per ``XRANGE`` (and rows per Arrow batch): a record is about 250 bytes.
READ_PAGE = 10_000
#: A broker's ledger is cut into Spark partitions of about this many records.
DEFAULT_MAX_ROWS_PER_PARTITION = 250_000
_KNOWN = ("ledger", "topic", "redisurl", "brokers", "maxrowsperpartition", "minpartitions", "path")
_JSON_READ = pj.ReadOptions(use_threads=False, block_size=64 << 20)
_INT_FIELDS = {"queue", "offset", "key_hash", "born_ms", "attempt", "epoch"}
_FLOAT_FIELDS = {"start_ms", "end_ms"}


class LedgerNotFoundError(MQOrderError, LookupError):
    """No broker holds a ledger for the group: it was never switched on, or nothing was consumed."""


@dataclass(frozen=True)
class LedgerOptions:
    group: str
    topic: str | None
    max_rows_per_partition: int
    conn: Connection
    #: Slices at least, over all brokers (``minPartitions``; the audit passes its parallelism), so
    #: a ledger smaller than ``maxRowsPerPartition`` is not read by one task while the other cores wait.
    min_partitions: int = 1


def ledger_options(options: Mapping[str, Any]) -> LedgerOptions:
    """The options of a ledger read, checked before anything runs (names arrive lower-cased)."""
    opts = lower_options(options)
    check_known(opts, _KNOWN, "ledger read")
    group = check_name("group", opts.get("ledger", ""))
    topic = check_topic(opts["topic"], allow_dlq=True, allow_retry=True) if opts.get("topic") else None
    raw = opts.get("maxrowsperpartition") or str(DEFAULT_MAX_ROWS_PER_PARTITION)
    try:
        max_rows = int(raw)
    except ValueError:
        raise ConfigError(f"option maxRowsPerPartition={raw!r} must be an integer") from None
    if max_rows < 1:
        raise ConfigError(f"option maxRowsPerPartition={max_rows} must be at least 1")
    return LedgerOptions(group, topic, max_rows, connection(opts), min_partitions(opts) or 1)


@dataclass(frozen=True)
class LedgerStream:
    """One broker's ledger stream as planned: its length, first and last ids, and whether Redis
    trimmed records from its head (``MAXLEN ~``): then the oldest handled messages have no record."""

    broker: str
    length: int
    first_id: str
    last_id: str
    trimmed: int
    #: Whether its oldest and newest records have ``key_hash`` (else an engine that writes none
    #: wrote them: the audit then takes key lanes from first keys, ``audit_frames.KEY_LANES``).
    key_hashed: bool = True


@dataclass(frozen=True)
class LedgerSlice(InputPartition):
    """Records of one broker's ledger with ids in ``[start, end]`` (``end`` exclusive if it starts
    with ``(``): the unit a read task reads."""

    group: str
    broker: str
    start: str
    end: str
    topic: str | None


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def ledger_streams(brokers: BrokerRegistry, group: str) -> list[LedgerStream]:
    """Every broker's ledger stream of ``group`` (brokers without one are left out)."""
    out = []
    key = keys.ledger(group)
    for name in brokers.names:
        client = brokers.get(name).client
        try:
            info = client.xinfo_stream(key)
        except redis.ResponseError as exc:
            if "no such key" in str(exc).lower():
                continue
            raise
        except redis.RedisError as exc:
            raise BrokerUnavailableError(
                f"cannot read the ledger of group {group!r} on broker {name!r} at {brokers.get(name).safe_url}: "
                f"{exc}. Start redis-server or point MQORDER_REDIS_URL at a running one") from exc
        length = int(info.get("length", 0))
        if not length:
            continue
        first, last = info["first-entry"][0], info["last-entry"][0]
        added = int(info.get("entries-added", length) or length)
        hashed = _key_hashed(info["first-entry"][1]) and _key_hashed(info["last-entry"][1])
        out.append(LedgerStream(name, length, _text(first), _text(last), max(0, added - length), hashed))
    return out


def _key_hashed(fields: Any) -> bool:
    """Whether a stream entry's record has ``key_hash``: the oldest and the newest record are
    looked at, so a ledger an older engine began, or one an older worker still writes to during a
    rolling upgrade, is audited by first key throughout."""
    raw = (fields or {}).get(b"r", (fields or {}).get("r", b""))
    return b'"key_hash":' in (raw.encode() if isinstance(raw, str) else raw)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def plan_slices(group: str, streams: Sequence[LedgerStream], max_rows: int, topic: str | None = None,
                min_slices: int = 1) -> list[LedgerSlice]:
    """Cut each stream into ``ceil(length / max_rows)`` id ranges of equal time span (of equal
    sequence span, for a stream written within one millisecond), and into at least its share of
    ``min_slices`` (by length) so every core gets a slice.

    Equal time spans hold about equal record counts when records arrive at a steady pace; a burst
    makes one slice bigger, never wrong: together the slices cover ``[first_id, last_id]`` exactly.
    """
    out: list[LedgerSlice] = []
    total = sum(s.length for s in streams) or 1
    for s in streams:
        (lo_ms, lo_seq), (hi_ms, hi_seq) = _id(s.first_id), _id(s.last_id)
        want = max(math.ceil(s.length / max_rows), math.ceil(min_slices * s.length / total))
        if lo_ms < hi_ms:
            n = max(1, min(want, hi_ms - lo_ms + 1))
            cuts = [f"{lo_ms + (hi_ms - lo_ms + 1) * i // n}-0" for i in range(1, n)]
        else:
            n = max(1, min(want, hi_seq - lo_seq + 1))
            cuts = [f"{lo_ms}-{lo_seq + (hi_seq - lo_seq + 1) * i // n}" for i in range(1, n)]
        starts = [s.first_id, *cuts]
        ends = [*(f"({c}" for c in cuts), s.last_id]
        out.extend(LedgerSlice(group, s.broker, a, b, topic) for a, b in zip(starts, ends, strict=True))
    return out


def _records(client: redis.Redis, group: str, start: str, end: str) -> Iterator[tuple[Binaries, Binaries]]:
    """Pages of (entry ids, raw records) from ``start`` to ``end``, ``READ_PAGE`` at a time.

    A page of records in the engine's layout (one field ``r``) is cut from the raw reply as two
    binary columns (``resp_pages``: no Python object per record); any other page is parsed by
    hiredis and transposed with ``zip``, the cyclic collector paused meanwhile (``reader.PausedGC``:
    it would walk the page's thousands of lists over and over).

    A page is ``READ_PAGE`` records of about 250 bytes (a key, at most the 64 KB a header may hold,
    is the only unbounded part), far from 2 GiB; one whose records still pass
    ``resp_pages.MAX_BATCH_BYTES`` comes in pieces within it (``resp_pages.pieces``), as topic
    pages do, and each piece is parsed and yielded on its own."""
    key = keys.ledger(group)
    nxt = start
    pages = RawPages(client, LEDGER)
    try:
        while True:
            with PausedGC():
                page = pages.xrange(key, nxt, end, READ_PAGE)
                n = len(page)
                parts = [_ids_and_records(piece) for piece in pieces(page)] if n else []
                del page
            done = n < pages.asked  # fewer than asked for: the range is read (a dropped reply asks for fewer)
            if not done:
                last = parts[-1][0][-1]
                nxt = "(" + _text(last.as_py() if isinstance(last, pa.Scalar) else last)
                pages.prefetch(key, nxt, end, READ_PAGE)  # Redis builds it while these are consumed
            yield from parts
            if done:
                return
    finally:
        pages.close()


def _ids_and_records(page: Piece) -> tuple[Binaries, Binaries]:
    if isinstance(page, RawColumns):
        return page.ids, page.values[0]
    ids, fields = zip(*page, strict=True)
    names: Sequence[bytes] = ()
    if set(map(len, fields)) == {2}:
        names, raws = zip(*fields, strict=True)
    if set(names) != {b"r"}:
        raws = tuple(f[1] if len(f) >= 2 and f[0] == b"r" else dict(zip(f[::2], f[1::2], strict=False)).get(b"r", b"")
                     for f in fields)
    return ids, raws


def _columns_of(schema: Any) -> tuple[str, ...]:
    """The ledger columns a read was asked for (a ``.schema(...)`` given to the reader), in order;
    all of them without one. A narrower schema is cheaper: fewer values parsed and moved to the JVM."""
    if schema is None:
        return tuple(LEDGER_ARROW_SCHEMA.names)
    names = tuple(f.name for f in schema.fields)
    unknown = [n for n in names if n not in LEDGER_ARROW_SCHEMA.names]
    if unknown:
        raise ConfigError(f"ledger reads have no column(s) {', '.join(map(repr, unknown))}; columns: "
                          f"{', '.join(LEDGER_ARROW_SCHEMA.names)}")
    return names


def _json_options(columns: Sequence[str], topic: str | None) -> pj.ParseOptions:
    wanted = set(columns) | ({"topic"} if topic is not None else set())
    return pj.ParseOptions(explicit_schema=pa.schema([f for f in LEDGER_ARROW_SCHEMA if f.name in wanted
                                                      and f.name != "entry"]), unexpected_field_behavior="ignore")


def _page_fast(ids: Binaries, raws: Binaries, parse: pj.ParseOptions, entry: bool) -> pa.Table:
    """A page parsed against the schema: records of the engine's exact shape as whole columns
    (``ledger_parse``), any other page in C++ by ``pyarrow.json``."""
    table = ledger_parse.parse(raws, parse.explicit_schema)
    if table is None:
        table = pj.read_json(io.BytesIO(b"\n".join(as_bytes(raws))), parse_options=parse, read_options=_JSON_READ)
    if table.num_rows != len(raws):
        raise pa.ArrowInvalid(f"{table.num_rows} rows parsed from {len(raws)} records")
    if not entry:
        return table
    return table.append_column("entry", ids.cast(pa.string()) if isinstance(ids, pa.Array) else pa.array(ids, pa.string()))


def _row(entry_id: bytes, raw: bytes) -> dict[str, Any]:
    """One record as typed values; a record that is not the engine's JSON keeps only its ``entry``
    (its ``outcome`` is null, which an audit counts as malformed) rather than failing the read."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError:
        rec = {}
    if not isinstance(rec, dict):
        rec = {}
    row: dict[str, Any] = {"entry": _text(entry_id)}
    for f in FIELDS:
        v = rec.get(f)
        if f in _INT_FIELDS:
            v = v if isinstance(v, int) and not isinstance(v, bool) else (int(v) if isinstance(v, float) else None)
        elif f in _FLOAT_FIELDS:
            v = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
        else:
            v = v if isinstance(v, str) else None
        row[f] = v
    return row


def _page_checked(ids: Binaries, raws: Binaries) -> pa.Table:
    """The slow path, record by record, for a page holding something that is not the engine's JSON."""
    rows = [_row(i, raw) for i, raw in zip(as_bytes(ids), as_bytes(raws), strict=True)]
    return pa.Table.from_batches([pa.RecordBatch.from_arrays(
        [pa.array([r[f.name] for r in rows], f.type) for f in LEDGER_ARROW_SCHEMA], schema=LEDGER_ARROW_SCHEMA)])


def read_slice(conn: Connection, part: LedgerSlice, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The records of ``part`` (of ``part.topic`` only, if set) as Arrow batches of ``columns``."""
    columns = tuple(columns or LEDGER_ARROW_SCHEMA.names)
    parse = _json_options(columns, part.topic)
    brokers = conn.registry()
    try:
        client = brokers.get(part.broker).client
        for ids, raws in _records(client, part.group, part.start, part.end):
            with PausedGC():
                try:
                    table = _page_fast(ids, raws, parse, "entry" in columns)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                    table = _page_checked(ids, raws)
                del ids, raws
                if part.topic is not None:
                    table = table.filter(pc.equal(table["topic"], part.topic))
                batches = table.select(list(columns)).combine_chunks().to_batches() if table.num_rows else []
            yield from batches
    finally:
        brokers.close()


def _check_topic(brokers: BrokerRegistry, group: str, topic: str) -> None:
    """Option ``topic`` names an existing topic: a misspelt one read 0 records, which an audit
    then reported as an empty ledger, not as the typo it was."""
    try:
        TopicManager(brokers).describe_topic(topic)
    except TopicNotFoundError:
        raise TopicNotFoundError(f"ledger read of group {group!r}: option topic {topic!r} names no topic (it has no "
                                 "route in Redis); check its spelling, or leave the option out to read the records "
                                 "of every topic the group consumed") from None


class LedgerReader(DataSourceReader):
    """``spark.read.format("mqorder").option("ledger", group)``: slices fixed at planning."""

    def __init__(self, opts: LedgerOptions, schema: Any = None) -> None:
        self.opts = opts
        self.columns = _columns_of(schema)
        brokers = opts.conn.registry()
        try:
            self.streams = ledger_streams(brokers, opts.group)
            if self.streams and opts.topic is not None:
                _check_topic(brokers, opts.group, opts.topic)
        finally:
            brokers.close()
        if not self.streams:
            raise LedgerNotFoundError(no_ledger_hint(opts.group))
        self.slices = plan_slices(opts.group, self.streams, opts.max_rows_per_partition, opts.topic,
                                  opts.min_partitions)

    def partitions(self) -> Sequence[InputPartition]:
        return self.slices

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LedgerSlice)
        freeze_imports()
        yield from read_slice(self.opts.conn, partition, self.columns)


def no_ledger_hint(group: str) -> str:
    return (f"no consumption ledger for group {group!r} on any broker: switch it on for the workers with "
            f"MQORDER_LEDGER=1 (or @orderly_listener(..., ledger=True)) and consume again; records are "
            f"kept in {keys.ledger(group)}")


def read_ledger(group: str, *, topic: str | None = None, redis_url: str | None = None,
                brokers: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Every record of ``group``'s ledger (of ``topic`` only, if given) as dicts, broker by broker,
    in entry order; ``LedgerNotFoundError`` if there is none. Loads everything in memory: for large
    ledgers read the DataFrame instead."""
    options: dict[str, str] = {"ledger": group}
    if topic:
        options["topic"] = topic
    if redis_url:
        options["redisUrl"] = redis_url
    if brokers:
        options["brokers"] = orjson.dumps(dict(brokers)).decode()
    reader = LedgerReader(ledger_options(options))
    out: list[dict[str, Any]] = []
    for part in reader.slices:
        for batch in read_slice(reader.opts.conn, part, reader.columns):
            out.extend(batch.to_pylist())
    return out

"""The audit's view of a topic: one row per stored message, with only what an audit needs.

``format("mqorder").option("topic", T)`` gives every column of a message, bodies and property maps
included; Python data sources cannot prune columns, so an audit reading it would move every body
into the JVM to use none of them (18-33 s for 1,000,000 messages on ``local[2]`` here, against
~7 s for this reader). This internal format, ``mqorder_audit_index``, yields queue index, offset,
first key, sharding key hash (header ``h``: a key-ordered listener's lane; null without one) and
message id, plus, with option ``orderField``, that field of each JSON body (as text:
numbers as written, strings unquoted; null when absent or not JSON).

Ranges are planned exactly as the topic reader plans them (``reader.queue_spans`` / ``bounds`` /
``plan_partitions``): from each queue's first stored offset to its next offset at planning, dealt
into groups of queue ranges.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from mqorder.errors import ConfigError
from mqorder.names import check_topic
from mqorder.spark.headers import as_bytes
from mqorder.spark.options import Connection, check_known, connection, lower_options, min_partitions
from mqorder.spark.reader import (
    Page,
    PausedGC,
    QueueRange,
    RangeGroup,
    _header,
    _headers_arrow,
    as_entries,
    columns,
    group_pages,
    plan_partitions,
    topic_layout,
)
from mqorder.spark.worker_gc import freeze_imports

FORMAT = "mqorder_audit_index"
SCHEMA_DDL = "qi INT, offset BIGINT, key STRING, key_hash BIGINT, msg_id STRING, field_value STRING"
ARROW_SCHEMA = pa.schema([("qi", pa.int32()), ("offset", pa.int64()), ("key", pa.string()), ("key_hash", pa.int64()),
                          ("msg_id", pa.string()), ("field_value", pa.string())])
#: Offsets per Spark partition (a queue longer than this is read by several tasks).
MAX_ROWS_PER_PARTITION = 250_000
_KNOWN = ("topic", "redisurl", "brokers", "orderfield", "minpartitions", "maxmessagesize", "path")
_REGISTERED = "_mqorder_audit_index_registered"


@dataclass(frozen=True)
class IndexOptions:
    topic: str
    order_field: str | None
    conn: Connection
    #: Read tasks at least (the audit passes its session's parallelism); None: the planner's cores.
    min_partitions: int | None = None


def index_options(options: Mapping[str, Any]) -> IndexOptions:
    opts = lower_options(options)
    check_known(opts, _KNOWN, "audit index read", FORMAT)
    if not opts.get("topic"):
        raise ConfigError(f"format('{FORMAT}') needs option('topic', <name>)")
    return IndexOptions(check_topic(opts["topic"]), opts.get("orderfield") or None, connection(opts),
                        min_partitions(opts))


def _field_text(body: bytes, name: str) -> str | None:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    v = doc.get(name) if isinstance(doc, dict) else None
    if v is None:
        return None
    if isinstance(v, str):
        return v
    return orjson.dumps(v).decode()


def read_index(conn: Connection, group: RangeGroup, order_field: str | None) -> Iterator[pa.RecordBatch]:
    """A batch per page of ``group``'s ranges, or per piece of a page whose values pass
    ``resp_pages.MAX_BATCH_BYTES`` (``reader.group_pages`` cuts those as the topic reader's)."""
    for part, entries in group_pages(conn, group):
        with PausedGC():
            batch = _batch(part, entries, order_field)
            del entries
        yield batch


def _batch(part: QueueRange, entries: Page, order_field: str | None) -> pa.RecordBatch:
    """The page's columns the way the topic reader cuts them (``reader.columns``, headers by Arrow's
    JSON reader), or message by message (``_batch_checked``) for a page they do not fit."""
    n = len(entries)
    cols = columns(entries) if n else None
    headers = _headers_arrow(cols[1]) if cols is not None else None
    if cols is None or headers is None:
        return _batch_checked(part, as_entries(entries), order_field)
    offsets, _, bodies, _ = cols
    values = (pa.array([_field_text(b, order_field) for b in as_bytes(bodies)], pa.string()) if order_field
              else pa.nulls(n, pa.string()))
    return pa.RecordBatch.from_arrays([pa.repeat(pa.scalar(part.span.index, pa.int32()), n), offsets, headers[1],
                                       headers[5], headers[0], values], schema=ARROW_SCHEMA)


def _batch_checked(part: QueueRange, entries: list, order_field: str | None) -> pa.RecordBatch:
    offsets, keys_, hashes, ids, values = [], [], [], [], []
    for entry_id, fields in entries:
        f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=False))
        offsets.append(int(entry_id.split(b"-", 1)[0]))
        msg_id, key, _, _, _, kh = _header(f.get(b"h", b"{}"))  # the topic reader's careful parse
        keys_.append(key)
        hashes.append(kh)
        ids.append(msg_id)
        values.append(_field_text(f.get(b"b", b""), order_field) if order_field else None)
    n = len(offsets)
    return pa.RecordBatch.from_arrays([
        pa.array([part.span.index] * n, pa.int32()), pa.array(offsets, pa.int64()), pa.array(keys_, pa.string()),
        pa.array(hashes, pa.int64()), pa.array(ids, pa.string()), pa.array(values, pa.string()),
    ], schema=ARROW_SCHEMA)


class StoredIndexReader(DataSourceReader):
    def __init__(self, opts: IndexOptions) -> None:
        self.opts = opts
        spans, limits = topic_layout(opts.conn, opts.topic)
        self.ranges = plan_partitions(opts.topic, spans, {i: lo for i, (lo, _) in limits.items()},
                                      {i: hi for i, (_, hi) in limits.items()}, MAX_ROWS_PER_PARTITION,
                                      opts.min_partitions)

    def partitions(self) -> Sequence[InputPartition]:
        return self.ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        freeze_imports()
        if isinstance(partition, RangeGroup):  # an empty topic gives Spark's placeholder partition
            yield from read_index(self.opts.conn, partition, self.opts.order_field)


class StoredIndexSource(DataSource):
    """``format("mqorder_audit_index")``: internal to the audit (batch reads only)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        return StoredIndexReader(index_options(self.options))


def register_index(spark: SparkSession) -> SparkSession:
    """Register the format on ``spark`` once."""
    if not getattr(spark, _REGISTERED, False):
        spark.dataSource.register(StoredIndexSource)
        setattr(spark, _REGISTERED, True)
    return spark

"""The write plan: options checked against the DataFrame's schema and the topic's route, once.

Built where Spark asks the source for a writer (before any task runs), so a missing column, a
column of the wrong type or an unknown topic fails the job before a single row is staged. The
plan is a plain picklable value: every task and the commit get the same one, with the same queue
count and the same job id.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from mqorder.errors import ConfigError
from mqorder.spark.options import BODY_JSON, Connection, WriteOptions
from mqorder.spark.queues import INTERNAL_PREFIX, QueueRef
from mqorder.store.durable import SendWait

_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
#: How an orderBy column is turned into order-preserving bytes (``mqorder.spark.encoding``).
_ORDER_KINDS: tuple[tuple[type[DataType] | tuple[type[DataType], ...], str], ...] = (
    (_INTEGRAL, "int"),
    ((FloatType, DoubleType), "float"),
    (BooleanType, "bool"),
    (StringType, "string"),
    (BinaryType, "binary"),
    (DateType, "date"),
    ((TimestampType, TimestampNTZType), "timestamp"),
)


@dataclass(frozen=True)
class WritePlan:
    topic: str
    queues: tuple[QueueRef, ...]
    key: str
    key_kind: str  # "string" | "int"
    order_by: str
    order_kind: str
    body: str | None  # a column, or None: the row as JSON
    body_kind: str  # "binary" | "string" | "json"
    id_column: str | None
    json_columns: tuple[str, ...]
    on_null: str
    staging_ttl_ms: int
    stage_chunk: int
    job_id: str
    conn: Connection
    #: What the commit waits for after publishing (option ``waitReplicas``); ``None``: nothing.
    wait: SendWait | None = None

    @property
    def queue_count(self) -> int:
        return len(self.queues)


def _column(schema: StructType, name: str, role: str) -> str:
    names = schema.fieldNames()
    if name in names:
        return name
    folded = [n for n in names if n.lower() == name.lower()]
    if len(folded) == 1:
        return folded[0]
    raise ConfigError(f"{role} column {name!r} is not in the DataFrame; its columns are: {', '.join(names)}")


def _order_kind(dt: DataType, name: str) -> str:
    for types, kind in _ORDER_KINDS:
        if isinstance(dt, types):
            return kind
    raise ConfigError(f"orderBy column {name!r} has type {dt.simpleString()}, which mqorder cannot order by; "
                      "cast it to a long, double, string, date or timestamp")


def _job_id(opts: WriteOptions) -> str:
    """A new id per batch job; per stream, one derived from its checkpoint and topic, because Spark
    builds a new writer for every micro-batch's commit (and a restarted query must find what the
    failed run staged under the same name)."""
    if opts.checkpoint:
        return hashlib.sha256(f"{opts.checkpoint}\0{opts.topic}".encode()).hexdigest()[:32]
    return uuid.uuid4().hex


#: What a whole-row JSON body holds (``encoding._bodies``: orjson, decimals as text, binary as hex),
#: nested in arrays, maps and structs at will.
_JSON_LEAVES = (StringType, BinaryType, BooleanType, *_INTEGRAL, FloatType, DoubleType, DecimalType, DateType,
                TimestampType, TimestampNTZType, NullType)


def _not_json(t: DataType) -> DataType | None:
    """The first type inside ``t`` a JSON body cannot hold (an interval, a variant...), or None."""
    if isinstance(t, ArrayType):
        return _not_json(t.elementType)
    if isinstance(t, MapType):
        return _not_json(t.keyType) or _not_json(t.valueType)
    if isinstance(t, StructType):
        return next((bad for f in t.fields if (bad := _not_json(f.dataType)) is not None), None)
    return None if isinstance(t, _JSON_LEAVES) else t


def build_plan(opts: WriteOptions, schema: StructType, queues: list[QueueRef], *, overwrite: bool) -> WritePlan:
    if overwrite:
        raise ConfigError("mode('overwrite') is not supported: a topic is an append-only log; use mode('append')")
    types = {f.name: f.dataType for f in schema.fields}
    key = _column(schema, opts.key, "key")
    if isinstance(types[key], StringType):
        key_kind = "string"
    elif isinstance(types[key], _INTEGRAL):
        key_kind = "int"
    else:
        raise ConfigError(f"key column {key!r} has type {types[key].simpleString()}; cast it to a string first "
                          "(mqorder.spark.publish does that for you), so the queue is crc32 of the same text "
                          "Producer.send_orderly hashes")
    order_by = _column(schema, opts.order_by, "orderBy")
    order_kind = _order_kind(types[order_by], order_by)
    body: str | None
    if opts.body.lower() == BODY_JSON and opts.body not in types:
        body, body_kind = None, "json"
        for f in schema.fields:
            bad = None if f.name.startswith(INTERNAL_PREFIX) else _not_json(f.dataType)
            if bad is not None:
                raise ConfigError(
                    f"column {f.name!r} has type {f.dataType.simpleString()}: a whole-row JSON body cannot hold "
                    f"a {bad.simpleString()}; cast it (to a string, a number) or drop it, or choose a body column "
                    "with option('body', ...)")
    else:
        body = _column(schema, opts.body, "body")
        if isinstance(types[body], BinaryType):
            body_kind = "binary"
        elif isinstance(types[body], StringType):
            body_kind = "string"
        else:
            raise ConfigError(f"body column {body!r} has type {types[body].simpleString()}; a body is a binary or "
                              "string column, or option('body', 'json') for the whole row as JSON")
    id_column = _column(schema, opts.id_column, "idColumn") if opts.id_column else None
    if not queues:
        raise ConfigError(f"topic {opts.topic!r} has no queues")
    return WritePlan(
        topic=opts.topic,
        queues=tuple(queues),
        key=key,
        key_kind=key_kind,
        order_by=order_by,
        order_kind=order_kind,
        body=body,
        body_kind=body_kind,
        id_column=id_column,
        json_columns=tuple(n for n in schema.fieldNames() if not n.startswith(INTERNAL_PREFIX)),
        on_null=opts.on_null,
        staging_ttl_ms=opts.staging_ttl_ms,
        stage_chunk=opts.stage_chunk,
        job_id=opts.job_id or _job_id(opts),
        conn=opts.conn,
        wait=opts.wait,
    )

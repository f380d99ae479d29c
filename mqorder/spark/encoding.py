"""Rows of one Spark partition (Arrow) → the messages to stage, grouped by queue and in order.

A task sees its whole partition before it stages anything, which gives three things:

* **Checks before anything is written.** Null keys / orderBy values / bodies / ids and bodies over
  ``max_message_size`` are counted over the whole partition; with any of them (``onNull=fail``)
  the task stages nothing and reports the counts, and the job's commit refuses the job with the
  totals of every partition.
* **One deterministic order.** Rows are sorted by (queue, sort key), the sort key being the
  orderBy value as order-preserving bytes followed by the message id. Every attempt of a task
  therefore produces the same sequence per queue, which is what makes staging idempotent by
  position (``stage.lua``) and lets the commit merge the runs of several partitions of one queue
  by comparing bytes (``publish_staged.lua``).
* **Deterministic ids.** Unless ``idColumn`` names one, a message's id is a hash of its key,
  orderBy value and body (plus, in a stream, the micro-batch id); identical rows of one queue get
  ``.1``, ``.2``... in turn. The same row published again, by a retried task, a speculative copy or
  a re-run of the whole job, has the same id, and the append skips ids a queue already holds.

Pure pyarrow and Python: testable without Spark.
"""

from __future__ import annotations

import hashlib
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, cast

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from mqorder.codec import MAX_HEADER_SIZE
from mqorder.spark.plan import WritePlan
from mqorder.spark.queues import QUEUE_COLUMN

#: One staged message: (sort key, message id, header JSON, body).
StagedRow = tuple[bytes, str, bytes, bytes]

_SIGN64 = 1 << 63
_pack_d = struct.Struct(">d").pack
_unpack_q = struct.Struct(">Q").unpack


@dataclass
class Refusal:
    """Why a partition (or, summed, a job) cannot be published. Every count is of rows."""

    null_key: int = 0
    null_order: int = 0
    null_body: int = 0
    null_id: int = 0
    too_large: int = 0
    largest: int = 0
    #: Rows whose header (message id and key) is over ``MAX_HEADER_SIZE``: a key that long, not a
    #: body over ``max_message_size``.
    header_too_large: int = 0
    largest_header: int = 0
    #: Rows whose key is not UTF-8 text (a binary column cast to a string): a sharding key is text.
    key_not_text: int = 0

    def __bool__(self) -> bool:
        return bool(self.null_key or self.null_order or self.null_body or self.null_id or self.too_large
                    or self.header_too_large or self.key_not_text)

    def add(self, other: Refusal) -> None:
        self.null_key += other.null_key
        self.null_order += other.null_order
        self.null_body += other.null_body
        self.null_id += other.null_id
        self.too_large += other.too_large
        self.largest = max(self.largest, other.largest)
        self.header_too_large += other.header_too_large
        self.largest_header = max(self.largest_header, other.largest_header)
        self.key_not_text += other.key_not_text

    def describe(self, plan_key: str, plan_order: str, max_size: int) -> str:
        parts = []
        if self.null_key:
            parts.append(f"{self.null_key:,} rows have a null key ({plan_key!r})")
        if self.null_order:
            parts.append(f"{self.null_order:,} rows have a null orderBy value ({plan_order!r})")
        if self.null_body:
            parts.append(f"{self.null_body:,} rows have a null body")
        if self.null_id:
            parts.append(f"{self.null_id:,} rows have a null idColumn value")
        if self.too_large:
            parts.append(f"{self.too_large:,} rows are over max_message_size {max_size:,} bytes "
                         f"(the largest is {self.largest:,})")
        if self.header_too_large:
            parts.append(f"{self.header_too_large:,} rows have a message header (their key and message id) of over "
                         f"{MAX_HEADER_SIZE:,} bytes (the largest is {self.largest_header:,}): shorten the key "
                         f"({plan_key!r})")
        if self.key_not_text:
            parts.append(f"{self.key_not_text:,} rows have a key that is not UTF-8 text ({plan_key!r}): a sharding "
                         "key is text; hex- or base64-encode binary keys first (F.hex, F.base64)")
        hint = ""
        if self.null_key or self.null_order or self.null_body or self.null_id:
            hint = ("; filter them out first, or leave them out, counted in the report: option('onNull', 'skip') "
                    "on df.write, on_null='skip' for publish(), --on-null skip for `mqorder pipeline publish`")
        return "; ".join(parts) + hint


@dataclass
class EncodedPartition:
    """The messages of one partition per queue index, each list in publishing order."""

    runs: dict[int, list[StagedRow]] = field(default_factory=dict)
    rows: int = 0
    skipped_nulls: int = 0
    refusal: Refusal = field(default_factory=Refusal)


# -- order-preserving bytes ---------------------------------------------------------------------------


def _enc_int(v: int) -> bytes:
    return (v + _SIGN64).to_bytes(8, "big")


def _enc_float(v: float) -> bytes:
    if v == 0.0:
        v = 0.0  # -0.0 sorts with 0.0, as in Spark
    (bits,) = _unpack_q(_pack_d(v))
    bits = bits ^ 0xFFFFFFFFFFFFFFFF if bits & _SIGN64 else bits | _SIGN64
    return bits.to_bytes(8, "big")


def _enc_bytes(v: bytes) -> bytes:
    # 0x00 escaped as 0x00 0xFF and a 0x00 0x00 terminator: shorter prefixes sort first, and the
    # message id that follows in the sort key can never change the order of two values.
    return v.replace(b"\x00", b"\x00\xff") + b"\x00\x00"


def _enc_str(v: str) -> bytes:
    return _enc_bytes(v.encode("utf-8"))


def _enc_bool(v: bool) -> bytes:
    return b"\x01" if v else b"\x00"


def order_values(column: pa.ChunkedArray | pa.Array, kind: str) -> tuple[list[Any], Callable[[Any], bytes]]:
    """The orderBy column as Python values and the function giving their order-preserving bytes."""
    if kind == "date" and pa.types.is_date32(column.type):
        # Days since the epoch; pyarrow casts date32 to int32 only (to int64 it raised in every
        # write task: the plan accepted a DATE orderBy, the job failed with a JVM stack trace).
        return column.cast(pa.int32()).cast(pa.int64()).to_pylist(), _enc_int
    if kind in ("int", "date", "timestamp"):
        return column.cast(pa.int64()).to_pylist(), _enc_int
    if kind == "float":
        return column.cast(pa.float64()).to_pylist(), _enc_float
    if kind == "bool":
        return column.to_pylist(), _enc_bool
    if kind == "string":
        return column.cast(pa.binary()).to_pylist(), _enc_bytes
    if kind == "binary":
        return column.to_pylist(), _enc_bytes
    raise ValueError(f"unknown orderBy kind {kind!r}")


# -- the partition ------------------------------------------------------------------------------------


def _json_default(v: Any) -> Any:
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    raise TypeError(f"cannot put a {type(v).__name__} into a JSON body")


def _bodies(table: pa.Table, plan: WritePlan) -> list[bytes | None]:
    if plan.body is None:
        rows = table.select(list(plan.json_columns)).to_pylist()
        dumps = orjson.dumps
        return [dumps(r, default=_json_default, option=orjson.OPT_NON_STR_KEYS) for r in rows]
    col = table.column(plan.body)
    if plan.body_kind == "string":
        col = col.cast(pa.binary())
    return col.to_pylist()


def _valid_mask(table: pa.Table, names: list[str]) -> pa.ChunkedArray | None:
    mask = None
    for n in names:
        v = pc.is_valid(table.column(n))
        mask = v if mask is None else pc.and_(mask, v)
    return mask


def encode_partition(table: pa.Table, plan: WritePlan, *, id_prefix: str = "", born_ms: int | None = None,
                     max_message_size: int | None = None) -> EncodedPartition:
    """Check, order and encode one partition. ``id_prefix`` makes a stream's ids per micro-batch."""
    out = EncodedPartition()
    max_size = plan.conn.max_message_size if max_message_size is None else max_message_size
    nullable = [plan.key, plan.order_by] + ([plan.body] if plan.body else []) + ([plan.id_column] if plan.id_column else [])
    nulls = {n: table.column(n).null_count for n in nullable}
    if any(nulls.values()):
        if plan.on_null == "skip":
            before = table.num_rows
            table = table.filter(_valid_mask(table, nullable))
            out.skipped_nulls = before - table.num_rows
        else:
            out.refusal.null_key = nulls[plan.key]
            out.refusal.null_order = nulls[plan.order_by]
            out.refusal.null_body = nulls.get(plan.body, 0) if plan.body else 0
            out.refusal.null_id = nulls.get(plan.id_column, 0) if plan.id_column else 0
    n = table.num_rows
    out.rows = n
    if n == 0:
        return out

    bodies = _bodies(table, plan)
    sizes = [len(b) for b in bodies if b is not None]
    largest = max(sizes, default=0)
    if largest > max_size:
        out.refusal.too_large = sum(1 for s in sizes if s > max_size)
        out.refusal.largest = largest
    if out.refusal:
        return out
    # Null bodies were refused above (or their rows skipped before this table was built).
    present = cast("list[bytes]", bodies)

    keys_col = table.column(plan.key)
    if plan.key_kind == "int":
        keys_col = keys_col.cast(pa.string())
    keys_b: list[bytes] = keys_col.cast(pa.binary()).to_pylist()
    count = plan.queue_count
    crc32 = zlib.crc32
    if QUEUE_COLUMN in table.column_names:
        queues: list[int] = table.column(QUEUE_COLUMN).to_pylist()
    else:
        queues = [crc32(k) % count for k in keys_b]
    order_vals, enc = order_values(table.column(plan.order_by), plan.order_kind)
    user_ids = [str(v) for v in table.column(plan.id_column).to_pylist()] if plan.id_column else None

    # The id hash covers length-prefixed key, orderBy bytes and body (and the stream batch prefix).
    base = hashlib.blake2b(digest_size=16, person=b"mqorder-spark")
    if id_prefix:
        base.update(len(id_prefix).to_bytes(4, "big") + id_prefix.encode())
    ids: list[str] = []
    sort_keys: list[bytes] = []
    add_id, add_sk = ids.append, sort_keys.append
    for i in range(n):
        ob = enc(order_vals[i])
        if user_ids is None:
            k = keys_b[i]
            h = base.copy()
            h.update(len(k).to_bytes(4, "big") + k + len(ob).to_bytes(4, "big") + ob)
            h.update(present[i])
            mid = id_prefix + h.hexdigest()
        else:
            mid = user_ids[i]
        add_id(mid)
        add_sk(ob + mid.encode())

    order = pc.sort_indices(
        pa.table({"q": pa.array(queues, pa.int32()), "k": pa.array(sort_keys, pa.binary())}),
        sort_keys=[("q", "ascending"), ("k", "ascending")],
    ).to_pylist()

    born = int(time.time() * 1000) if born_ms is None else born_ms
    # The header codec.encode_header writes ({"i", "b", "k", "h"}), formatted directly: the key's
    # JSON (with its hash "h", crc32 of the key as the producer stores it for key-ordered
    # listeners) is computed once per distinct key, and a generated id is hex (nothing to escape).
    key_json: dict[bytes, bytes] = {}
    dumps = orjson.dumps
    runs: dict[int, list[StagedRow]] = {}
    prev_q, prev_sk, dup = -1, b"", 0
    for i in order:
        q, sk = queues[i], sort_keys[i]
        mid = ids[i]
        if q == prev_q and sk == prev_sk and user_ids is None:
            # An identical row (same key, orderBy and body): a distinct message, by count. The
            # commit counts again over every task's rows of the queue (publish_staged.lua, which
            # reads a count as "." and digits after the id's 32 hex digits).
            dup += 1
            mid = f"{mid}.{dup}"
        else:
            dup = 0
        prev_q, prev_sk = q, sk
        kb = keys_b[i]
        kj = key_json.get(kb)
        if kj is None:
            try:
                text = kb.decode("utf-8")
            except UnicodeDecodeError:
                out.refusal.key_not_text += 1
                continue
            kj = key_json[kb] = (b',"k":[' + dumps(text) + b"]" if kb else b"") + b',"h":%d' % crc32(kb)
        header = b'{"i":%s,"b":%d%s}' % (dumps(mid), born, kj)
        if len(header) > MAX_HEADER_SIZE:
            out.refusal.header_too_large += 1
            out.refusal.largest_header = max(out.refusal.largest_header, len(header))
            continue
        run = runs.get(q)
        if run is None:
            run = runs[q] = []
        run.append((sk if not dup else sk + b".%d" % dup, mid, header, present[i]))
    out.runs = {} if out.refusal else runs
    return out

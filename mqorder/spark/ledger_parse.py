"""Ledger records of the engine's exact shape, parsed as whole columns with numpy (``headers``' way).

``LedgerBuffer.note`` writes every record with ``orjson.dumps`` of the same dict: the sixteen
``FIELDS`` in order, compact, eight string values and eight numbers (six integers, two floats
with a fraction: ``round(ms, 3)``). Arrow's JSON reader took ~3.7 µs a record, most of an audit's
Python time; here a page is one buffer:

* every record must have exactly 48 ``"`` (keys and string values, none null), no ``\\`` and no
  control character, so every quote delimits a string and the quotes locate every value;
* the bytes around the values (``{"group":"``, ``","topic":"``, ...) must be the shape's exactly:
  their lengths per record, then all of them at once against the template;
* integers must be JSON integers within int64, floats ``-?(0|[1-9][0-9]*)\\.[0-9]+`` (what orjson
  writes for a rounded millisecond time), both converted by Arrow's cast (correctly rounded, as its
  JSON reader); strings are checked as UTF-8.

Any other page (a null, a float in exponent form, another writer's order or spacing) gives None and
is read by Arrow's JSON reader; whatever this accepts, that reader parses to the same values.

Where the compiled ``mqorder.spark._resp`` is built, ``parse_template`` walks each record once
against the same segments instead (``_parse_native``), accepting the same records.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from mqorder.consumer.ledger import FIELDS
from mqorder.spark import headers
from mqorder.spark.headers import Binaries, gather, json_integers, quote_grid, template_values

_INTS = ("queue", "offset", "key_hash", "born_ms", "attempt", "epoch")
_FLOATS = ("start_ms", "end_ms")
_NUMBERS = _INTS + _FLOATS
#: Quotes per record: two per key, two per string value.
QUOTES = 2 * len(FIELDS) + 2 * (len(FIELDS) - len(_NUMBERS))


def _layout() -> tuple[list[tuple[str, int, int, bool]], list[bytes]]:
    """Per field: (name, quote its value starts after, quote its value ends at, is a number) and
    the template's literal segments around the values (``len(FIELDS) + 1`` of them)."""
    fields, segments, quote, seg = [], [], 0, b"{"
    for name in FIELDS:
        seg += b'"' + name.encode() + b'":'
        key_close = quote + 1
        if name in _NUMBERS:
            # number: from key_close + 2 (after '":') to the next key's quote - 1 (before ',')
            fields.append((name, key_close, key_close + 1, True))
            segments.append(seg)
            seg = b","
            quote += 2
        else:
            fields.append((name, key_close + 1, key_close + 2, False))
            segments.append(seg + b'"')
            seg = b'",'
            quote += 4
    segments.append(seg[:-1] + b"}" if seg == b"," else b'"}')
    return fields, segments


_FIELDS, _SEGMENTS = _layout()
_SEG_LEN = np.array([len(s) for s in _SEGMENTS], dtype=np.int64)
_TEMPLATE = b"".join(_SEGMENTS)


def _floats(buf: pa.Buffer, starts: np.ndarray, ends: np.ndarray) -> pa.Array | None:
    """``[starts, ends)`` as float64 if each is ``-?(0|[1-9][0-9]*)\\.[0-9]+``, else None."""
    raw = gather(buf, starts, ends)
    _, off_buf, data_buf = raw.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int32, count=len(raw) + 1).astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8, count=int(offsets[-1]))
    lengths = np.diff(offsets)
    neg = data[offsets[:-1]] == ord("-")
    is_dot = data == ord(".")
    dots = np.flatnonzero(is_dot)
    if len(dots) != len(raw) or ((data - ord("0") > 9) & ~is_dot).sum() != neg.sum():
        return None  # one dot each, and digits but for the dot and a leading minus
    first = offsets[:-1] + neg
    if (dots <= first).any() or (dots >= offsets[1:] - 1).any():  # digits before and after the dot
        return None
    if ((data[first] == ord("0")) & (dots - first > 1)).any() or (lengths > 32).any():
        return None
    try:
        return raw.cast(pa.string()).cast(pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


#: Each value's kind for ``_resp.parse_template`` (a string's contents, an integer, a fraction), which
#: reads the records against ``_SEGMENTS`` (they hold the quotes around string values).
_KINDS = b"".join(b"s" if not number else b"i" if name in _INTS else b"f" for name, _, _, number in _FIELDS)


def parse(raws: Binaries, schema: pa.Schema) -> pa.Table | None:
    """The records as a table of ``schema`` (fields of ``LEDGER_ARROW_SCHEMA``, ``entry`` left
    out), or None for a page that is not all of the engine's shape."""
    if headers.compiled():
        return _parse_native(raws, schema)
    n = len(raws)
    grid = quote_grid(raws, QUOTES)
    if grid is None:
        return None
    buf, data, q, starts, ends = grid
    if (q[:, 0] != starts + 1).any() or (q[:, -1] != ends - 2).any():
        return None
    vs, ve = [], []  # per field: where its value starts and ends in every record
    for _, a, b, number in _FIELDS:
        vs.append(q[:, a] + (2 if number else 1))
        ve.append(q[:, b] - (1 if number else 0))
    if any((e < s).any() for s, e in zip(vs, ve, strict=True)):  # "" where a number should be
        return None
    # The literal segments: [row start, first value), [value end, next value), ..., [last end, row end).
    seg_s, seg_e = np.stack([starts, *ve], axis=1), np.stack([*vs, ends], axis=1)
    if (seg_e - seg_s != _SEG_LEN).any():
        return None
    literal = gather(buf, seg_s.ravel(), seg_e.ravel()).buffers()[2]
    if literal is None or literal.to_pybytes() != _TEMPLATE * n:
        return None
    # Every number is checked, those the schema leaves out too: a record holding something else
    # there is not JSON of the shape (the compiled parse and Arrow's reader refuse it as well).
    numbers: dict[str, pa.Array] = {}
    for j, (name, _, _, number) in enumerate(_FIELDS):
        if number:
            col = json_integers(data, buf, vs[j], ve[j]) if name in _INTS else _floats(buf, vs[j], ve[j])
            if col is None:
                return None
            numbers[name] = col

    def column(j: int, name: str, number: bool) -> pa.Array | None:
        return numbers[name] if number else gather(buf, vs[j], ve[j]).cast(pa.string())

    return _table(schema, column)


def _table(schema: pa.Schema, column: Callable[[int, str, bool], pa.Array | None]) -> pa.Table | None:
    """The table of ``schema`` from ``column(field index, name, is a number)`` of each field it
    holds; None if a column is None, not UTF-8, or out of its type's range (an int32 column)."""
    columns: dict[str, pa.Array] = {}
    try:
        for j, (name, _, _, number) in enumerate(_FIELDS):
            if name not in schema.names:
                continue
            col = column(j, name, number)
            if col is None:
                return None
            columns[name] = col.cast(schema.field(name).type)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    return pa.table([columns[f.name] for f in schema], schema=schema)


def _parse_native(raws: Binaries, schema: pa.Schema) -> pa.Table | None:
    """``parse`` by ``_resp.parse_template``: each record walked once against the shape."""
    if not len(raws):
        return None
    parsed = template_values(raws, tuple(_SEGMENTS), _KINDS)
    if parsed is None:
        return None
    buf, spans, ints = parsed

    def column(j: int, name: str, number: bool) -> pa.Array | None:
        if name in _INTS:
            return pa.array(ints[j])
        values = gather(buf, spans[2 * j], spans[2 * j + 1]).cast(pa.string())
        return values.cast(pa.float64()) if number else values

    return _table(schema, column)

"""The stored headers' common shape, parsed as whole columns with numpy: no Python code per message.

A producer (``codec.encode_header``) and the Spark writer (``encoding.encode_partition``) store
almost every header as ``{"i":"<id>","b":<born ms>,"k":["<key>"],"h":<key hash>}``: compact JSON,
fields in that order, one key. Arrow's JSON reader parses such a page at ~1.6 µs a header, the
largest cost of a count after Redis' reply itself; this module parses the same page at a fraction
of that by treating the page's header bytes as one buffer:

* every header must have exactly 12 ``"`` and no ``\\`` (so every quote delimits a string: no
  escapes) and no control character; the quotes' positions, a ``(n, 12)`` array, then locate
  each field, and the bytes between them are checked against the literal JSON of the shape;
* the born time and the key hash must be JSON integers (``-?(0|[1-9][0-9]*)``) within int64;
* the id and key are gathered into Arrow string arrays, which checks their UTF-8.

Where the compiled ``mqorder.spark._resp`` is built, ``_resp.parse_template`` checks the same
shape walking each header once (``_parse_native``), and ``gather`` copies ranges in C.

A page where any header differs in the least (another field, its order, spaces, several keys,
tags, properties, an escape) gives ``None``, and the caller parses it the general way; whatever
this module accepts, Arrow's JSON reader would parse to the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import pyarrow as pa

from mqorder.spark.native import _resp

#: A page's values: bytes objects, or an Arrow binary array (``resp_pages`` cuts raw replies into those).
Binaries: TypeAlias = Sequence[bytes] | pa.BinaryArray
#: Quotes per header of the common shape: "i" "<id>" "b" "k" "<key>" "h".
QUOTES = 12
#: (quote index, byte offset from that quote, byte) that every header of the shape holds; the
#: id (quotes 2-3) and the key (quotes 8-9) are free, and the two integers are checked apart.
_LITERALS = (
    (0, -1, b"{"), (0, 1, b"i"), (1, 0, b'"'), (1, 1, b":"),
    (3, 1, b","), (4, 1, b"b"), (5, 0, b'"'), (5, 1, b":"),
    (6, -1, b","), (6, 1, b"k"), (7, 0, b'"'), (7, 1, b":"), (7, 2, b"["),
    (9, 1, b"]"), (9, 2, b","), (10, 1, b"h"), (11, 0, b'"'), (11, 1, b":"),
)
#: Quote pairs at a fixed distance: (quote, next quote, distance).
_SPACING = ((0, 1, 2), (1, 2, 2), (3, 4, 2), (4, 5, 2), (6, 7, 2), (7, 8, 3), (9, 10, 3), (10, 11, 2))


#: Positions in a buffer from here on do not fit the int32 offsets of an Arrow ``binary`` array
#: (``gather`` reads such ranges with int64 offsets). A module constant so a test can lower it.
INT64_OFFSETS_FROM = 2**31


def gather(buf: pa.Buffer, starts: np.ndarray, ends: np.ndarray) -> pa.Array:
    """The byte ranges ``[starts, ends)`` of ``buf`` (in order, not overlapping) as one Arrow binary
    array. The ranges and the bytes between them are a binary array over ``buf`` itself, offsets
    ``s0, e0, s1, e1, ...`` (no copy); ``take`` of its even elements copies the ranges out in C++.

    Ranges ending at or past ``INT64_OFFSETS_FROM`` (a reply over 2 GiB) would wrap in int32
    offsets: that view is a ``large_binary`` one, and what ``take`` copies out is cast back to
    ``binary`` (new offsets, the same values: the ranges themselves must total under 2 GiB, which
    ``resp_pages.MAX_BATCH_BYTES`` sees to). Ordinary buffers take the int32 path, no extra step.

    Where the compiled ``mqorder.spark._resp`` is built, its ``gather`` copies the ranges out in
    one loop instead (Arrow's ``take`` cost about 3x as much here), whatever the buffer's size."""
    n = len(starts)
    if _resp is not None:
        try:
            offsets32, values = _resp.gather(buf, np.ascontiguousarray(starts, dtype=np.int64),
                                             np.ascontiguousarray(ends, dtype=np.int64))
        except OverflowError:  # values past 2 GiB: the path below says so as Arrow does
            pass
        else:
            return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets32), pa.py_buffer(values)])
    large = n > 0 and int(ends[-1]) >= INT64_OFFSETS_FROM  # in order: the last end is the largest
    offsets = np.empty(2 * n, dtype=np.int64 if large else np.int32)
    offsets[0::2], offsets[1::2] = starts, ends
    kind = pa.large_binary() if large else pa.binary()
    both = pa.Array.from_buffers(kind, 2 * n - 1, [None, pa.py_buffer(offsets), buf])
    out = both.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int32)))
    return out.cast(pa.binary()) if large else out


def json_integers(data: np.ndarray, buf: pa.Buffer, starts: np.ndarray, ends: np.ndarray) -> pa.Array | None:
    """``data[starts:ends]`` as int64 if every one is a JSON integer (``-?(0|[1-9][0-9]*)``), else None.

    Arrow's cast checks the digits and the range; what it accepts that JSON does not (leading zeros,
    ``0x``) all start with a ``0`` followed by more, refused here first."""
    if (ends <= starts).any():
        return None
    first = starts + (data[starts] == ord("-"))
    if (first >= ends).any() or ((data[first] == ord("0")) & (ends - first > 1)).any():
        return None
    try:
        return gather(buf, starts, ends).cast(pa.string()).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def parse(heads: Binaries) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array] | None:
    """(msg id, first key, born ms, key hash, both int64) of a page whose headers all have the common
    shape, or None (then parse it with a JSON reader)."""
    n = len(heads)
    if not n:
        return None
    if _resp is not None:
        return _parse_native(heads, n)
    grid = quote_grid(heads, QUOTES)
    if grid is None:
        return None
    data_buf, data, q, starts, ends = grid
    # Row r's quotes are q[r] if its first is its second byte and its last is before its end
    # (then no quote of r lies in another row).
    if (q[:, 0] != starts + 1).any() or (q[:, -1] + 3 >= ends).any():
        return None
    for a, b, gap in _SPACING:
        if (q[:, b] - q[:, a] != gap).any():
            return None
    for col, delta, byte in _LITERALS:
        if (data[q[:, col] + delta] != byte[0]).any():
            return None
    if (data[ends - 1] != ord("}")).any():
        return None
    born = json_integers(data, data_buf, q[:, 5] + 2, q[:, 6] - 1)
    hashes = json_integers(data, data_buf, q[:, 11] + 2, ends - 1)
    if born is None or hashes is None:
        return None
    try:
        ids = gather(data_buf, q[:, 2] + 1, q[:, 3]).cast(pa.string())
        first_keys = gather(data_buf, q[:, 8] + 1, q[:, 9]).cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # not UTF-8
        return None
    return ids, first_keys, born, hashes


#: The common shape as ``_resp.parse_template`` reads it: the bytes around the id, born time, key
#: and key hash, and their kinds (a string, an integer).
_TEMPLATE = ((b'{"i":"', b'","b":', b',"k":["', b'"],"h":', b"}"), b"sisi")


def compiled() -> bool:
    """Whether ``mqorder.spark._resp`` is there (for the ledger's records too: one switch)."""
    return _resp is not None


def template_values(values: Binaries, segments: tuple[bytes, ...], kinds: bytes
                    ) -> tuple[pa.Buffer, np.ndarray, np.ndarray] | None:
    """Records of one template (``_resp.parse_template``: literal ``segments`` around values of
    ``kinds``) walked once each: (their buffer, value ranges as ``2 * len(kinds)`` rows, integers
    as ``len(kinds)`` rows), or None if any record is not of the template."""
    cut = binary_parts(values)
    if cut is None:
        return None
    _, buf, offsets, _ = cut
    n = len(values)
    spans, ints = np.empty((2 * len(kinds), n), dtype=np.int64), np.empty((len(kinds), n), dtype=np.int64)
    assert _resp is not None
    if not _resp.parse_template(buf, offsets, n, segments, kinds, spans, ints):
        return None
    return buf, spans, ints


def _parse_native(heads: Binaries, n: int) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array] | None:
    """``parse`` by ``_resp.parse_template``: each header walked once, checked against the same shape."""
    parsed = template_values(heads, *_TEMPLATE)
    if parsed is None:
        return None
    buf, spans, ints = parsed
    try:
        ids = gather(buf, spans[0], spans[1]).cast(pa.string())
        first_keys = gather(buf, spans[4], spans[5]).cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # not UTF-8
        return None
    return ids, first_keys, pa.array(ints[1]), pa.array(ints[3])


def quote_grid(values: Binaries, per_row: int
               ) -> tuple[pa.Buffer, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The quotes of a page of flat JSON objects with exactly ``per_row`` quotes each, as an
    ``(n, per_row)`` array of positions in the page's one buffer: (buffer, its bytes, quotes,
    row starts, row ends). None for an empty page, a control character or an escape anywhere
    (then a quote is not always a string's end), or another count of quotes: the caller's JSON
    reader takes those. The caller checks each row's first and last quote against its bounds."""
    n = len(values)
    cut = binary_parts(values) if n else None
    if cut is None:
        return None
    _, buf, offsets, data = cut
    if data.min() < 0x20 or (data == ord("\\")).any():
        return None
    quotes = np.flatnonzero(data == ord('"'))
    if len(quotes) != per_row * n:
        return None
    return buf, data, quotes.reshape(n, per_row), offsets[:-1], offsets[1:]


def as_bytes(values: Binaries) -> Sequence[bytes]:
    """``values`` as bytes objects, for a careful path that goes value by value."""
    return values.to_pylist() if isinstance(values, pa.Array) else values


def binary_parts(values: Binaries) -> tuple[pa.Array, pa.Buffer, np.ndarray, np.ndarray] | None:
    """``values`` (bytes, or an Arrow binary array as ``resp_pages`` cuts them) as an Arrow binary
    array, its data buffer, row offsets (int64) and bytes (numpy views of the buffers); None if all
    are empty."""
    if isinstance(values, pa.BinaryArray):
        arr = values if not values.offset else pa.concat_arrays([values])
    else:
        arr = pa.array(values, pa.binary())
    _, off_buf, data_buf = arr.buffers()
    if data_buf is None or not data_buf.size:
        return None
    offsets = np.frombuffer(off_buf, dtype=np.int32, count=len(values) + 1).astype(np.int64)
    return arr, data_buf, offsets, np.frombuffer(data_buf, dtype=np.uint8, count=int(offsets[-1]))


def entry_offsets(ids: Binaries) -> pa.Array | None:
    """The ``<offset>`` part of stream entry ids ``<offset>-<seq>`` as int64 (the digits before each
    id's one dash, cut by ``gather``), or None for ids of another form."""
    cut = binary_parts(ids)
    if cut is None:
        return None
    _, buf, offsets, data = cut
    dashes = np.flatnonzero(data == ord("-"))
    if len(dashes) != len(ids) or (dashes <= offsets[:-1]).any() or (dashes >= offsets[1:]).any():
        return None
    try:
        return gather(buf, offsets[:-1], dashes).cast(pa.string()).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def digit_integers(values: Binaries) -> pa.Array | None:
    """``values`` as int64 if every one is ASCII digits only (``bytes.isdigit``), else None."""
    cut = binary_parts(values)
    if cut is None:
        return None
    arr, _, offsets, data = cut
    if (offsets[1:] == offsets[:-1]).any() or ((data - ord("0")) > 9).any():  # uint8: below "0" wraps
        return None
    try:
        return arr.cast(pa.string()).cast(pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # past int64
        return None

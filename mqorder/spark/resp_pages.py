"""``XRANGE`` pages read as raw RESP bytes and cut into Arrow columns with numpy.

Why: through hiredis a topic page's reply becomes about nine Python objects per entry (the entry
and field lists, the id, three field names and three values), which the reader then flattened,
sliced, copied into Arrow arrays and freed again: most of a count's Python CPU (0.57-0.65 s of
``read_group`` over 300,000 100-byte messages; 0.22-0.25 s this way). Here the reply stays one
buffer and no Python object is made per entry.

How: the ``XRANGE`` and a ``PING`` go out in one write on a connection of the client's own pool
(its connect, auth, TLS and retries stay redis-py's), and bytes are read into one buffer until it
ends with the ``PING``'s ``+PONG``, or with an error line: a refused ``PING`` (an ACL user without
it, ``BUSY``, ``LOADING``), whose two replies hiredis then parses; that reader asks later pages
with ``xrange``. A page is read for a ``Layout``: the one-byte field names its
entries hold, in order. An entry that ``append_entries`` wrote (``TOPIC``) is, in RESP::

    *2 $<a> <id> *6 $1 h $<b> <header> $1 b $<c> <body> $1 s $<d> <store ms>   (each part + CRLF)

and a ledger record (``LEDGER``) ``*2 $<a> <id> *2 $1 r $<b> <record>``. Every ``*2\\r\\n$`` in
the buffer is a candidate entry start; each candidate is parsed as if it were one (its lengths
read, every fixed byte between them checked), all at once with numpy.
A body may hold such bytes too, so the parse is accepted only if the candidates that parsed form
one chain: the first right after the reply's ``*<n>`` header, each one starting where the one
before ends, ``n`` of them, the last ending where the ``+PONG`` starts. Parsing RESP from the
reply's start gives exactly that chain, so an accepted cut is the reply's one parse; anything else
(a body with a false start, other fields, an error reply, a reply cut where a value happens to end
in ``+PONG``) is handed to hiredis, which parses the same bytes (or says to read on).

A client that is not a plain ``redis.Redis`` (a Redis Cluster client) reads with ``xrange``.

A page whose values pass ``MAX_BATCH_BYTES`` (messages of tens of MB, ``maxMessageSize`` goes up to
512 MB) comes as a ``SplitPage``: its entries in order, in pieces of at most that many bytes of
values each (an entry larger than that alone), so that no Arrow binary column of a piece nears
2 GiB (the most one can hold) and no batch handed to Spark's JVM is huge. Positions in a reply
past 2 GiB are read with int64 offsets (``headers.gather``).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import itemgetter
from typing import Any, TypeAlias

import hiredis
import numpy as np
import pyarrow as pa
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mqorder.errors import MessageError
from mqorder.spark import headers
from mqorder.spark.native import _resp

_PONG = b"+PONG\r\n"
_PING = hiredis.pack_command(("PING",))
#: An entry's first bytes (see the module docstring).
_START = b"*2\r\n$"
_CRLF = b"\r\n"
#: Digits of a length: 7 read at most (bodies are at most ``maxMessageSize``, 4 MB by default).
_LEN_DIGITS = 7
_FIRST_BUFFER = 64 << 10
#: Bytes of values (ids and field values) a piece of a page holds at most: a page past it is a
#: ``SplitPage``. Each piece becomes one Arrow record batch; well under 2 GiB, the most an Arrow
#: ``binary`` column holds, and not so large that Spark's JVM chokes on one batch.
MAX_BATCH_BYTES = 256 << 20
#: Bytes a raw reply may reach in this process. Pages are sized from the entries of the page
#: before (about 4 MiB, up to 20,000 entries), so a run of large messages after small ones could
#: make one reply of gigabytes, all of it in memory before it is cut. Past this many bytes the
#: reply is dropped (the connection closed) and the page asked again with ``REPLY_SHRINK`` times
#: fewer entries, down to one message, which is at most ``MQORDER_MAX_MESSAGE_SIZE`` (512 MB at
#: most). The read buffer stops at this size (its last doubling holds the old half beside it: ~1.5x
#: at the peak). Redis still builds each reply whole in its own memory. A module constant so a
#: test can lower it.
MAX_REPLY_BYTES = 1 << 30
REPLY_SHRINK = 16


@dataclass(frozen=True)
class Layout:
    """The fields of a page's entries: one-byte names (at most four), in the order stored."""

    fields: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.fields) <= 4 or any(len(f) != 1 for f in self.fields):
            raise ValueError(f"a layout has one to four one-byte field names, not {self.fields!r}")

    @property
    def names(self) -> bytes:
        """The field names as one byte string (what ``_resp.cut_spans`` takes)."""
        return b"".join(self.fields)

    def separators(self) -> tuple[bytes, ...]:
        """The fixed bytes after the id and after each value, up to the next length (or the end)."""
        first = b"\r\n*%d\r\n$1\r\n%s\r\n$" % (2 * len(self.fields), self.fields[0])
        return (first, *(b"\r\n$1\r\n%s\r\n$" % f for f in self.fields[1:]), _CRLF)


#: A topic's entries (``append_entries``): header, body, store time.
TOPIC = Layout((b"h", b"b", b"s"))
#: A consumption ledger's records (``mqorder.consumer.ledger``): one JSON record.
LEDGER = Layout((b"r",))


@dataclass(frozen=True)
class RawColumns:
    """A page cut into binary columns, in entry order: the entry ids and one column of values per
    field of the layout. Each array has its own buffers (nothing refers to the reply's)."""

    layout: Layout
    ids: pa.BinaryArray
    values: tuple[pa.BinaryArray, ...]

    def __len__(self) -> int:
        return len(self.ids)

    def entries(self) -> list[Any]:
        """The page as hiredis gives it, ``[[id, [field, value, ...]], ...]``, for a careful path."""
        names = self.layout.fields
        columns = [c.to_pylist() for c in self.values]
        return [
            [entry_id, [x for pair in zip(names, row, strict=True) for x in pair]]
            for entry_id, *row in zip(self.ids.to_pylist(), *columns, strict=True)
        ]


@dataclass(frozen=True, eq=False)
class SplitPage:
    """A page whose values pass ``MAX_BATCH_BYTES``: its entries in order, in ``parts`` of at most
    that many bytes of values each (an entry larger than that is a part of its own), every part
    of the kind an ordinary page is (``RawColumns``, or hiredis' lists)."""

    parts: tuple[RawColumns, ...] | tuple[list[Any], ...]
    #: Bytes of the page's ids and values, for sizing the next page.
    nbytes: int

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def entries(self) -> list[Any]:
        """The page as hiredis gives it (``RawColumns.entries``), for a careful path."""
        return [e for part in self.parts for e in (part.entries() if isinstance(part, RawColumns) else part)]


#: A page as ``RawPages.xrange`` gives it.
Page: TypeAlias = RawColumns | SplitPage | list[Any]
#: A page, or a part of a ``SplitPage``: at most ``MAX_BATCH_BYTES`` of values (or one entry).
Piece: TypeAlias = RawColumns | list[Any]


def pieces(page: Page) -> Sequence[Piece]:
    """``page`` as pieces in entry order: a ``SplitPage``'s parts, else the page itself."""
    return page.parts if isinstance(page, SplitPage) else (page,)


def split_points(sizes: np.ndarray, limit: int) -> list[int]:
    """Where pieces of entries of ``sizes`` (bytes, in order) start, plus the end: each piece takes
    as many entries as fit in ``limit`` bytes, at least one. A step per piece, not per entry."""
    total = np.cumsum(sizes, dtype=np.int64)
    points, base = [0], 0
    while points[-1] < len(sizes):
        nxt = max(int(np.searchsorted(total, base + limit, side="right")), points[-1] + 1)
        points.append(nxt)
        base = int(total[nxt - 1])
    return points


def entry_bytes(entry: Any) -> int:
    """Bytes of an entry of hiredis' lists: its id, field names and values."""
    entry_id, fields = entry
    return len(entry_id) + sum(map(len, chain.from_iterable(fields.items()) if isinstance(fields, dict) else fields))


_ID, _FIELDS = itemgetter(0), itemgetter(1)


def split_entries(entries: list[Any]) -> list[Any] | SplitPage:
    """hiredis' ``XRANGE`` entries, as a ``SplitPage`` if their values pass ``MAX_BATCH_BYTES``
    (a ``pa.array`` of more than 2 GiB of bodies is not one binary array), else as they are."""
    if entries and type(entries[0][1]) is list:  # one reply's entries share their shape (RESP2: lists)
        # The total first, in C loops: per-entry sizes only for a page that must be split.
        total = sum(map(len, chain.from_iterable(map(_FIELDS, entries)))) + sum(map(len, map(_ID, entries)))
        if total <= MAX_BATCH_BYTES:
            return entries
    sizes = np.fromiter(map(entry_bytes, entries), dtype=np.int64, count=len(entries))
    points = split_points(sizes, MAX_BATCH_BYTES)
    if len(points) <= 2:
        return entries
    return SplitPage(tuple(entries[a:b] for a, b in pairwise(points)), int(sizes.sum()))


def _u64_at(data: np.ndarray) -> np.ndarray:
    """A view of ``data`` where item ``i`` is the little-endian 8 bytes at byte ``i``."""
    return np.ndarray((len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))


def _word(lit: bytes) -> int:
    return int.from_bytes(lit.ljust(8, b"\0"), "little")


def _literal(u64: np.ndarray, pos: np.ndarray, lit: bytes) -> np.ndarray:
    """Whether the bytes at each ``pos`` are ``lit`` (2 to 16 bytes), as one or two 8-byte reads
    (a position past the buffer reads its last word: false, as it must be)."""
    top = len(u64) - 1
    if len(lit) <= 8:
        mask = (1 << (8 * len(lit))) - 1
        return (u64[np.minimum(pos, top)] & np.uint64(mask)) == np.uint64(_word(lit))
    tail = len(lit) - 8
    return (u64[np.minimum(pos, top)] == np.uint64(_word(lit[:8]))) & (
        u64[np.minimum(pos + tail, top)] == np.uint64(_word(lit[tail:]))
    )


_ONES, _HIGHS = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)
_NIBBLES, _ZEROS, _SIXES = np.uint64(0xF0F0F0F0F0F0F0F0), np.uint64(0x3030303030303030), np.uint64(0x0606060606060606)
_CRS = np.uint64(0x0D0D0D0D0D0D0D0D)


def _lengths(u64: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value, digits, ok) of a RESP length ``<digits>\\r\\n`` at each ``pos``: ok where 1 to
    ``_LEN_DIGITS`` ASCII digits, without a leading zero, are followed by CRLF.

    Each position's 8 bytes are one little-endian word, parsed with word-wide arithmetic (SWAR):
    the first CR found by the zero-byte test, the digits moved to the word's top and the bytes
    below them set to ``"0"``, checked as digits and summed pairwise (10, 100, 10,000)."""
    w = u64[np.minimum(pos, len(u64) - 1)]
    x = w ^ _CRS
    zero = (x - _ONES) & ~x & _HIGHS  # the first CR byte's high bit is exact (bits above may be off)
    found = zero != 0
    lowest = zero & (~zero + np.uint64(1))
    nd = np.log2(np.where(found, lowest, np.uint64(1)).astype(np.float64)).astype(np.int64) // 8
    ok = found & (nd >= 1) & _literal(u64, pos + nd, _CRLF)
    ok &= (nd == 1) | ((w & np.uint64(0xFF)) != np.uint64(ord("0")))  # no leading zero (hiredis refuses one)
    shift = (np.uint64(8) * (np.uint64(8) - np.clip(nd, 1, 8).astype(np.uint64))) % np.uint64(64)
    fill = np.where(nd >= 8, np.uint64(0), (np.uint64(1) << shift) - np.uint64(1)) & _ZEROS
    v = np.where(nd >= 8, w, (w << shift) | fill)
    ok &= ((v & _NIBBLES) == _ZEROS) & (((v + _SIXES) & _NIBBLES) == _ZEROS)
    v = v - _ZEROS
    v = (v * np.uint64(10) + (v >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    v = (v * np.uint64(100) + (v >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    v = (v * np.uint64(10000) + (v >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    return v.astype(np.int64), nd, ok


def cut(data: np.ndarray, end: int, layout: Layout = TOPIC) -> RawColumns | SplitPage | None:
    """The ``XRANGE`` reply ``data[:end]`` (bytes as uint8) cut into columns, or None if it is not
    a complete reply of entries of ``layout`` (then parse it with hiredis); a ``SplitPage`` of
    columns if its values pass ``MAX_BATCH_BYTES``.
    ``data`` must hold at least 8 bytes past ``end`` (the ``+PONG`` read behind it does)."""
    if end < 4 or len(data) < end + 8 or data[0] != ord("*"):
        return None
    head = data[:24].tobytes()
    head_end = head.find(b"\r\n")
    if head_end < 0 or not head[1:head_end].isdigit() or (head_end > 2 and head[1:2] == b"0"):
        return None  # not a count, or one with a leading zero (hiredis refuses it)
    n, first = int(head[1:head_end]), head_end + 2
    if not n:
        return None
    spans = _native_spans(data, first, end, n, layout) if _resp is not None else _numpy_spans(data, first, end, n, layout)
    if spans is None:
        return None
    buf = pa.py_buffer(data)
    if end <= MAX_BATCH_BYTES:  # the values are fewer bytes than the reply: one piece
        return _gathered(layout, buf, spans)
    sizes = sum(hi - lo for lo, hi in spans)
    points = split_points(sizes, MAX_BATCH_BYTES)
    if len(points) <= 2:
        return _gathered(layout, buf, spans)
    parts = tuple(_gathered(layout, buf, [(lo[a:b], hi[a:b]) for lo, hi in spans]) for a, b in pairwise(points))
    return SplitPage(parts, int(sizes.sum()))


#: Bytes an entry takes at least (``*2 $1 <id> *2 $1 r $0`` and their CRLFs): a reply's entry
#: count past its bytes over this is not a reply to cut.
_MIN_ENTRY_BYTES = 24


def _native_spans(data: np.ndarray, first: int, end: int, n: int, layout: Layout
                  ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """(starts, ends) of the ids and of each field's values of the ``n`` entries in
    ``data[first:end]``, found by ``_resp.cut_spans`` walking the reply once from its start (the
    reply's one parse); None if the bytes are not ``n`` entries of ``layout`` ending at ``end``."""
    if n > (end - first) // _MIN_ENTRY_BYTES:
        return None
    width = 1 + len(layout.fields)
    out = np.empty((2 * width, n), dtype=np.int64)
    assert _resp is not None
    if not _resp.cut_spans(data, first, end, n, layout.names, out):
        return None
    return [(out[2 * j], out[2 * j + 1]) for j in range(width)]


def _numpy_spans(data: np.ndarray, first: int, end: int, n: int, layout: Layout
                 ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """``_native_spans`` with numpy, where the extension is not built: every ``*2\r\n$`` a
    candidate entry, all parsed at once, accepted only as one chain (the module docstring).
    ``data`` must hold at least 8 bytes past ``end``."""
    u64 = _u64_at(data)
    is_star = data[first:end] == ord("*")
    if np.count_nonzero(is_star) > _STARS_PER_ENTRY * n + _STARS_SLACK:
        # Bodies dense in "*": every one would cost several 8-byte positions (a 100 MB page of
        # "*" took 2.2 GB and 7 s); hiredis parses such a page in its own memory.
        return None
    stars = np.flatnonzero(is_star) + first
    del is_star
    starts = stars[_literal(u64, stars, _START)]
    if len(starts) < n:
        return None
    spans = []  # (start, end) of the id and of each value
    pos, ok = starts + len(_START), np.ones(len(starts), dtype=bool)
    for after in layout.separators():
        size, nd, good = _lengths(u64, pos)
        lo = pos + nd + 2
        hi = lo + size
        ok &= good & _literal(u64, hi, after)
        spans.append((lo, hi))
        pos = hi + len(after)
    if int(ok.sum()) != n:
        return None
    nxt = pos[ok]
    starts = starts[ok]
    if starts[0] != first or nxt[-1] != end or (nxt[:-1] != starts[1:]).any():
        return None
    return [(lo[ok], hi[ok]) for lo, hi in spans]


def _gathered(layout: Layout, buf: pa.Buffer, spans: list[tuple[np.ndarray, np.ndarray]]) -> RawColumns:
    """The ranges (id, then each field's value) of some entries of the reply in ``buf`` as columns."""
    ids, *values = (headers.gather(buf, lo, hi) for lo, hi in spans)
    return RawColumns(layout, ids, tuple(values))


class _ReplyTooLarge(Exception):
    """A reply passed ``MAX_REPLY_BYTES`` before it ended: ``RawPages.xrange`` asks for fewer entries."""


#: ``RawPages._round_trip``'s answer for an error reply: ask again through redis-py, which raises it.
_ERROR_REPLY = object()
#: ``cut`` gives a page whose ``*`` bytes pass this many per entry (each entry has two of its own,
#: its id's and its fields' arrays) plus the slack to hiredis: few bodies hold many.
_STARS_PER_ENTRY, _STARS_SLACK = 4, 4096
#: The buffer a page starts with at most (it doubles while the reply is longer): one read of large
#: messages must not make the next range's first page ask for gigabytes up front.
_MAX_FIRST_BUFFER = 64 << 20
#: The longest last line looked at for an error reply (``-ERR ...``) ending the bytes read.
_ERROR_LINE_MAX = 1024


def _ends_in_error_line(buf: np.ndarray, filled: int) -> bool:
    """Whether ``buf[:filled]`` ends with a whole line starting with ``-`` (an error reply)."""
    if filled < 3 or buf[filled - 2] != ord("\r") or buf[filled - 1] != ord("\n"):
        return False
    tail = buf[max(0, filled - _ERROR_LINE_MAX) : filled - 2].tobytes()
    start = tail.rfind(b"\r\n") + 2 if b"\r\n" in tail else (0 if filled <= _ERROR_LINE_MAX else -1)
    return start >= 0 and tail[start : start + 1] == b"-"


class RawPages:
    """``XRANGE`` pages of one client, entries of ``layout``, read raw (``cut``) on one connection
    of its pool, kept until ``close``. A client that is not a plain ``redis.Redis`` reads with
    ``xrange``."""

    def __init__(self, client: Any, layout: Layout = TOPIC) -> None:
        self._client = client
        self._layout = layout
        self._raw = type(client) is redis.Redis
        self._conn: Any = None
        #: Reply bytes per entry of the last page: the next page's buffer is sized from it.
        self._entry_bytes = 256.0
        #: The ``COUNT`` the last page was read with: less than asked if its replies were dropped
        #: (``MAX_REPLY_BYTES``). A page shorter than this ends its range; one shorter than the
        #: count a caller asked for may not.
        self.asked = 0
        #: The ``XRANGE`` sent ahead (``prefetch``) and not read yet: its arguments, packed.
        self._ahead: tuple[tuple[Any, ...], bytes] | None = None

    def prefetch(self, key: str, lo: str, hi: str, count: int) -> None:
        """Send the ``XRANGE`` a later ``xrange`` with these arguments will read, so that Redis
        builds the next page while the caller converts this one (and Spark consumes it): the read
        then waits for Redis only when Redis is the slower. Nothing is read here; a send that
        fails is forgotten (``xrange`` asks again), as is any request this one replaces."""
        if not self._raw or self._conn is None:
            return
        if self._ahead is not None:  # never read: its reply would be taken for the next one's
            self._drop_ahead()
            return
        args: tuple[Any, ...] = ("XRANGE", key, lo, hi, "COUNT", count)
        packed = hiredis.pack_command(args) + _PING
        # Marked before it is sent: whatever interrupts the send (a signal's exception too), a
        # request that may be on its way is never left unmarked on a connection going back.
        self._ahead = (args, packed)
        try:
            self._conn.send_packed_command([packed])
        except Exception:  # noqa: BLE001 - a hint only: xrange sends it again, and raises what it finds
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        """Forget a request sent ahead: its reply is unread, so the connection is closed (the next
        send reconnects)."""
        self._ahead = None
        if self._conn is not None:
            self._conn.disconnect()

    def xrange(self, key: str, lo: str, hi: str, count: int) -> Page:
        """The entries of ``key`` in ``[lo, hi]``, at most ``count``: columns if the page has the
        common layout, else hiredis' lists (as ``client.xrange`` on a ``Broker`` gives them); a
        ``SplitPage`` of either if its values pass ``MAX_BATCH_BYTES``. A reply that passes
        ``MAX_REPLY_BYTES`` is dropped and asked again with fewer entries (the page may hold fewer
        than ``count`` while entries remain)."""
        self.asked = count
        if not self._raw:
            return split_entries(list(self._client.xrange(key, min=lo, max=hi, count=count)))
        if self._conn is None:
            self._conn = self._client.connection_pool.get_connection()
        conn = self._conn
        while True:
            args: tuple[Any, ...] = ("XRANGE", key, lo, hi, "COUNT", count)
            ahead = self._ahead  # stays marked until its reply is read (close() then drops it)
            if ahead is not None and ahead[0] != args:
                self._drop_ahead()
                ahead = None
            sent = [ahead is not None]  # the first attempt reads what prefetch sent
            packed = ahead[1] if ahead is not None else hiredis.pack_command(args) + _PING
            size = min(_MAX_FIRST_BUFFER, MAX_REPLY_BYTES, max(_FIRST_BUFFER, int(count * self._entry_bytes * 1.1)))

            def attempt() -> Any:
                send, sent[0] = not sent[0], False  # noqa: B023 - called within this pass of the loop
                return self._round_trip(conn, packed, size, send)  # noqa: B023

            try:
                got = conn.retry.call_with_retry(attempt, lambda _e: conn.disconnect())
            except _ReplyTooLarge:
                self._ahead = None
                conn.disconnect()  # the rest of the reply is never read; the next send reconnects
                if count == 1:
                    self.close()
                    raise MessageError(
                        f"one entry of {key} from {lo} is over {MAX_REPLY_BYTES:,} bytes, more than any message may "
                        "be (MQORDER_MAX_MESSAGE_SIZE is at most 512 MB): the stream holds something mqorder did "
                        "not store; the read stops here") from None
                count = self.asked = max(1, count // REPLY_SHRINK)
                continue
            except BaseException:
                conn.disconnect()  # whatever is left unread must never reach the pool's next user
                self.close()
                raise
            self._ahead = None  # read: nothing of it is left on the connection
            break
        if got is _ERROR_REPLY:
            return split_entries(list(self._client.xrange(key, min=lo, max=hi, count=count)))
        return got

    def _round_trip(self, conn: Any, packed: bytes, size: int, send: bool = True) -> Any:
        """Send ``packed`` (the ``XRANGE`` and the ``PING``; ``send`` False: ``prefetch`` sent it)
        and read until both replies are in: the page (``cut``, else hiredis' lists), or
        ``_ERROR_REPLY``."""
        if send:
            conn.send_packed_command([packed])
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            raise RedisConnectionError("no socket to read the raw reply from")
        buf = np.empty(size, dtype=np.uint8)  # not zeroed: only what was read is ever looked at
        filled = 0
        try:
            while True:
                if len(buf) - filled < 4096:
                    if len(buf) >= MAX_REPLY_BYTES:  # growing again would only hold more of a dropped reply
                        raise _ReplyTooLarge(filled)
                    grown = np.empty(min(2 * len(buf), MAX_REPLY_BYTES), dtype=np.uint8)
                    grown[:filled] = buf[:filled]
                    buf = grown
                got = sock.recv_into(buf.data[filled:])
                if not got:
                    raise RedisConnectionError("Connection closed by server.")
                filled += got
                if filled > MAX_REPLY_BYTES:
                    raise _ReplyTooLarge(filled)
                if filled >= 7 and buf[filled - 7 : filled].tobytes() == _PONG:
                    done = self._parsed(buf, filled)
                    if done is not None:
                        return done
                elif _ends_in_error_line(buf, filled):
                    # The PING refused (an ACL user without it, BUSY, LOADING, MASTERDOWN): no
                    # "+PONG" will come, and waiting for one ended in the socket's timeout with
                    # the real error unseen.
                    done = self._parsed(buf, filled, pong=False)
                    if done is not None:
                        return done
        except TimeoutError as exc:
            raise RedisTimeoutError(f"Timeout reading from socket: {exc}") from exc
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc

    def _parsed(self, buf: np.ndarray, filled: int, pong: bool = True) -> Any:
        """The page if ``buf[:filled]`` holds both replies, else None (read on). ``pong``: it ends
        in ``+PONG`` (else in an error line, which may be the PING's answer or a body's bytes)."""
        if pong:
            cols = cut(buf, filled - 7, self._layout)
            if cols is not None:
                self._entry_bytes = (filled - 7) / len(cols)
                return cols
        reader = hiredis.Reader()
        reader.feed(buf[:filled].tobytes())
        first = reader.gets()
        if first is False:
            return None
        second = reader.gets()
        if second is False:
            return None
        if isinstance(second, hiredis.ReplyError):
            # The PING was refused: read this client's later pages with ``xrange`` (no PING).
            self._raw = False
        if not isinstance(first, list):
            return _ERROR_REPLY
        if first:
            self._entry_bytes = filled / len(first)
        # A reply within the limit holds fewer bytes of values: no need to count them entry by entry.
        return split_entries(first) if filled > MAX_BATCH_BYTES else first

    def close(self) -> None:
        """Give the connection back to its pool (closed first if a request sent ahead is unread:
        its reply must never reach the pool's next user)."""
        if self._ahead is not None:
            self._drop_ahead()
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client.connection_pool.release(conn)

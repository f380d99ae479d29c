"""``RawPipeline`` and ``ConnectionLease``: the consume path's round trips, lean.

At a steady trickle every message costs its consumer one or two round trips (a commit with the
next lingering read behind it; after a switch, the finish of the run left with the begin of the
next). Through redis-py's ``Pipeline`` the client-side CPU of such a round trip is mostly redis-py's
own: a Python check per argument while packing, a response-callback lookup per reply, exception
annotation, and a pool checkout and release per round trip, each recording observability counters
(redis-py 8). Profiled in a stock prefork child at 1,000 msg/s, the checkout and release alone
were about a fifth of its CPU.

``RawPipeline`` keeps what the consume path needs: commands packed into one write (``packing``), the
replies read in order, an error reply kept in its place (``raise_on_error=False``) or the first
one raised, the client's ``Retry`` around the round trip with the connection dropped after a
failure (as ``Pipeline.execute`` does), no ``MULTI`` (like ``pipeline(transaction=False)``). It
applies **no response callbacks**: a reply is what hiredis parsed (``EVALSHA`` and ``HMGET`` have
none anyway, and ``Broker`` reads ``XRANGE`` and ``XREAD`` raw on every path).

``ConnectionLease`` holds one connection of the client's own pool (health checks, reconnects and
the pool's limit stay redis-py's) across the round trips of one task execution, so they pay no
checkout each. It belongs to one thread (a ConsumeRequest's); whoever made it releases it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

import redis
from redis.connection import AbstractConnection
from redis.exceptions import ResponseError

from mqorder.store.packing import pack_command, pack_commands

try:  # redis-py's hiredis parser (5.x-8.x): the lean reads use it when the connection does
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout: redis-py's own reads
    _HiredisParser = None  # type: ignore[assignment,misc]
    _NOT_ENOUGH_DATA = object()

from mqorder.store.cluster_route import ClusterClient, ClusterRoute

_BASE_READ_RESPONSE = AbstractConnection.read_response


class ConnectionLease:
    """One connection of ``client``'s pool, taken at the first round trip and kept until ``release``.

    On a Redis Cluster (``ClusterClient``) it holds one connection per node instead, and routes
    each command to its slot's primary (``mqorder.store.cluster_route.ClusterRoute``). A
    run pins its queue (``pin``): the queue's slot stays on the node it first went to, one connection to
    one primary per queue as off a cluster, so a run never reads on one node and commits on another.
    """

    __slots__ = ("_pool", "_conn", "_lean", "_route", "_pid")

    def __init__(self, client: redis.Redis | ClusterClient) -> None:
        self._conn: Any = None
        #: Whether the held connection's replies are read straight from hiredis (``_lean_reads``).
        self._lean = False
        self._pid = os.getpid()
        if isinstance(client, ClusterClient):
            self._pool: Any = None
            self._route: ClusterRoute | None = ClusterRoute(client)
        else:
            self._pool = client.connection_pool
            self._route = None

    @property
    def on_cluster(self) -> bool:
        """Whether this lease routes over a Redis Cluster (one slot per multi-key command)."""
        return self._route is not None

    def pin(self, key: bytes | str) -> None:
        """On a cluster, keep ``key``'s slot (a run's queue) on the node that serves it first: a
        move (a failover) is a ``SlotMovedError`` before anything is sent there. Off a cluster the
        lease's one connection is pinned already."""
        if self._route is not None:
            self._route.pin(key)

    def round_trip(self, commands: list[tuple[Any, ...]], partial: bool = False) -> list[Any]:
        """Send ``commands`` in one write and read every reply (error replies as exceptions, in place).
        ``partial``: on a cluster, a node that fails answers for its own commands only
        (``ClusterRoute.round_trip``); off a cluster there is one node, whose failure is raised."""
        if self._route is not None:
            return self._route.round_trip(commands, partial)
        n = len(commands)
        # A command given as ``bytes`` is packed already (``RawPipeline.execute_packed``).
        packed = pack_commands(commands)
        conn = self._conn
        if conn is None:
            conn = self._conn = self._pool.get_connection()
            self._lean = _lean_reads(conn)
        lean = self._lean
        try:
            replies: list[Any] = conn.retry.call_with_retry(
                lambda: _round_trip(conn, packed, n, lean), lambda _error: conn.disconnect()
            )
        except BaseException:
            # Whatever was left unread must never reach the next user of this connection.
            conn.disconnect()
            self.release()
            raise
        return replies

    def release(self) -> None:
        """Give the connection back to the pool (the lease takes another if used again)."""
        if self._pid != os.getpid():
            self._conn = None  # a forked child's copy: the connection is the parent's
            return
        if self._route is not None:
            self._route.release()
            return
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)


class ThreadLeases:
    """A ``ConnectionLease`` per thread and client, kept across calls: for a producer's sends.

    Through a plain ``RawPipeline`` on a client every round trip checks a connection out of
    redis-py's pool and back in, each recording redis-py 8's observability counters: about 23 µs
    of the ~60 µs of client CPU a ``send_orderly`` costs (cProfile, 5,000 sends). A thread that
    keeps one connection pays it once. The lease is given back when its thread ends (the
    thread-local holder is collected) or ``close``; in a forked child it is forgotten, never used:
    its socket is the parent's.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        #: Every live thread's holder, weakly: a thread's end collects its own and releases it.
        self._all: weakref.WeakSet[_ThreadHeld] = weakref.WeakSet()

    def get(self, client: redis.Redis | ClusterClient) -> ConnectionLease:
        held: _ThreadHeld | None = getattr(self._local, "held", None)
        if held is None or held.pid != os.getpid():
            held = self._local.held = _ThreadHeld()
            with self._lock:
                self._all.add(held)
        lease = held.leases.get(id(client))
        if lease is None:
            lease = held.leases[id(client)] = ConnectionLease(client)
        return lease

    def close(self) -> None:
        """Give back every thread's connection (``Producer.close``)."""
        with self._lock:
            alive = list(self._all)
        for held in alive:
            held.release()


class _ThreadHeld:
    """One thread's leases; releases them when the thread ends and this is collected."""

    __slots__ = ("pid", "leases", "__weakref__")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.leases: dict[int, ConnectionLease] = {}

    def release(self) -> None:
        if self.pid != os.getpid():
            return  # a forked child's copy: the connections are the parent's
        for lease in list(self.leases.values()):
            lease.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown, a closed pool: nothing to give back
            pass


class RawPipeline:
    """A non-transactional pipeline: ``execute_command`` then ``execute``. On a ``ConnectionLease``
    its connection is the lease's; on a client, one of the pool's for the one round trip."""

    __slots__ = ("_source", "_commands")

    def __init__(self, source: redis.Redis | ClusterClient | ConnectionLease) -> None:
        self._source = source
        self._commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> RawPipeline:
        self._commands.append(args)
        return self

    def execute_packed(self, command: bytes) -> RawPipeline:
        """Queue one command packed already (RESP: ``packed_args`` of its words and arguments
        after its ``*<count>`` header), for a command most of whose arguments are the same bytes
        call after call (``switch.lua``'s keys of every adopted queue, on every lingering read).
        On a ``ConnectionLease`` off a Redis Cluster only: a cluster route reads a command's keys."""
        source = self._source
        if not isinstance(source, ConnectionLease) or source.on_cluster:
            raise TypeError("a packed command goes on a ConnectionLease off a Redis Cluster")
        self._commands.append(command)  # type: ignore[arg-type]  # round_trip sends bytes as they are
        return self

    def __len__(self) -> int:
        return len(self._commands)

    def execute(self, raise_on_error: bool = True, partial: bool = False) -> list[Any]:
        """Send every queued command in one write and read every reply (the queue is emptied).
        ``partial`` (with ``raise_on_error=False``): see ``ConnectionLease.round_trip``."""
        commands, self._commands = self._commands, []
        if not commands:
            return []
        source = self._source
        if isinstance(source, ConnectionLease):
            replies = source.round_trip(commands, partial) if partial else source.round_trip(commands)
        else:
            lease = ConnectionLease(source)
            try:
                replies = lease.round_trip(commands, partial) if partial else lease.round_trip(commands)
            finally:
                lease.release()
        if raise_on_error:
            for r in replies:
                # An error reply, or an error a cluster route put in a reply's place (a connection
                # error after its redirects ran out): either is raised, never handed on as a reply.
                if isinstance(r, Exception):
                    raise r
        return replies


def packed_args(args: tuple[Any, ...]) -> bytes:
    """``args`` packed as RESP bulk strings without the array header (what ``hiredis`` gives after
    ``*<count>\r\n``): pieces of a command put together with ``execute_packed``."""
    data = pack_command(args)
    return data[data.index(b"\n") + 1:]


def _round_trip(conn: Any, packed: bytes, n: int, lean: bool) -> list[Any]:
    """One write of ``packed`` (``n`` commands) and their ``n`` replies.

    ``lean`` (``_lean_reads``) on a connected socket with no health check due: the write goes
    straight to the socket and the replies straight from hiredis's reader, redis-py's
    ``send_packed_command`` and ``read_from_socket`` layers skipped (their checks are the ones
    made here: the socket, the health check; their errors the ones raised here). A trickling send
    and a lingering run's commit are one such round trip each."""
    sock = conn._sock
    if lean and sock is not None and (not conn.health_check_interval or time.monotonic() <= conn.next_health_check):
        try:
            sock.sendall(packed)
        except BaseException as exc:
            err = _write_failed(conn, exc)
            if err is exc:
                raise
            raise err from exc
        return _read_lean(conn, n, sock)
    conn.send_packed_command([packed])  # connects, checks health; a list: bytes would be iterated
    if lean:
        return _read_lean(conn, n, conn._sock)
    out: list[Any] = []
    for _ in range(n):
        try:
            out.append(conn.read_response())
        except ResponseError as exc:
            out.append(exc)
    return out


def _write_failed(conn: Any, exc: BaseException) -> BaseException:
    """What redis-py's ``send_packed_command`` raises for a failed write (``exc`` itself when it
    is not a socket error), the connection dropped: nothing unsent may stay on it."""
    conn.disconnect()
    if isinstance(exc, TimeoutError):
        return redis.TimeoutError("Timeout writing to socket")
    if isinstance(exc, OSError):
        errno, errmsg = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else (exc.args[0], exc.args[1])
        return redis.ConnectionError(f"Error {errno} while writing to socket. {errmsg}.")
    return exc


def _lean_reads(conn: Any) -> bool:
    """Whether ``conn``'s replies may be read straight from its hiredis reader (``_read_lean``):
    a connection class that does not override ``read_response`` (a Sentinel-managed one does: it
    turns a demoted primary's READONLY into a reconnect, which a failover needs), hiredis's parser."""
    return (_HiredisParser is not None and type(conn).read_response is _BASE_READ_RESPONSE
            and type(conn._parser) is _HiredisParser)


def _read_lean(conn: Any, n: int, sock: Any) -> list[Any]:
    """``n`` replies, error replies in place, as redis-py's ``read_response`` would give them,
    without its per-reply layers (about 3 µs a reply here: a trickling message reads ~5 of them).
    Bytes come from ``sock`` (the connection's) into the parser's buffer and reader, as its
    ``read_from_socket`` does. Failures end as there: the connection dropped, a
    ``TimeoutError`` or ``ConnectionError`` raised. A RESP3 push message between replies goes to
    the parser's push handler, as redis-py's reads do."""
    parser = conn._parser
    reader = parser._reader
    buf = parser._buffer
    push_type = getattr(parser, "_hiredis_PushNotificationType", None)
    out: list[Any] = []
    try:
        if reader is None or sock is None:
            raise redis.ConnectionError("Connection closed by server.")
        while len(out) < n:
            reply = reader.gets()
            while reply is _NOT_ENOUGH_DATA:
                got = sock.recv_into(buf)
                if not got:
                    raise redis.ConnectionError("Connection closed by server.")
                reader.feed(buf, 0, got)
                reply = reader.gets()
            kind = type(reply)
            if kind is list:
                if reply and isinstance(reply[0], redis.ConnectionError):
                    raise reply[0]
            elif kind is not bytes and kind is not int:
                # Only here: a push message, a connection error or a RESP3 map (a push message's
                # type is a subclass of list, never list itself).
                if push_type is not None and isinstance(reply, push_type):
                    parser.handle_push_response(reply)
                    continue
                if isinstance(reply, redis.ConnectionError):
                    raise reply
            out.append(reply)
    except TimeoutError as exc:  # the socket's timeout (socket.timeout)
        conn.disconnect()
        raise redis.TimeoutError("Timeout reading from socket") from exc
    except OSError as exc:  # what the socket raises
        conn.disconnect()
        raise redis.ConnectionError(f"Error while reading from socket: {exc.args}") from exc
    except BaseException:
        conn.disconnect()
        raise
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    return out

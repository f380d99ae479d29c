"""The consume path's lean round trips (``RawPipeline``, ``ConnectionLease``, ``Scripts.run_many``)
against a real redis-server: replies and error replies in order, a connection that stays usable
after an error reply and is replaced after a dropped one, and NOSCRIPT calls sent again without
running twice the calls that did run (appends stored once after ``SCRIPT FLUSH``)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from mqorder import keys
from mqorder.codec import encode_header
from mqorder.model import MessageQueue
from mqorder.store.append import AppendRequest, QueueAppender
from mqorder.store.log import MessageLog
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline, packed_args
from mqorder.store.scripts import source

MQ0, MQ1 = MessageQueue("t", "broker-a", 0), MessageQueue("t", "broker-a", 1)


def test_replies_and_error_replies_come_back_in_order_and_the_connection_stays_in_step(r: redis.Redis) -> None:
    r.set("s", "x")
    pipe = RawPipeline(r).execute_command("SET", "a", 1).execute_command("INCR", "s")
    pipe.execute_command("GET", "a")
    ok, err, got = pipe.execute(raise_on_error=False)
    assert ok == b"OK" and isinstance(err, redis.ResponseError) and got == b"1"
    with pytest.raises(redis.ResponseError):
        RawPipeline(r).execute_command("INCR", "s").execute_command("GET", "a").execute()
    # Every reply of the failed pipeline was read: the pooled connection answers the next one.
    assert RawPipeline(r).execute_command("GET", "a").execute() == [b"1"]
    assert RawPipeline(r).execute() == []


def test_an_error_a_route_put_in_a_replys_place_is_raised_not_returned(r: redis.Redis) -> None:
    """A cluster route puts a ``ConnectionError`` in a reply's place when its redirects run out
    (``ClusterRoute``): ``execute()`` raises it as it raises an error reply, so a caller's
    ``except RedisError`` backs off instead of parsing an exception as data (once a TypeError in
    the assignment reads)."""

    class RouteGaveUp(ConnectionLease):
        def round_trip(self, commands: list) -> list:
            return [b"OK", redis.ConnectionError("no node answered after 16 redirects")]

    pipe = RawPipeline(RouteGaveUp(r)).execute_command("SET", "a", 1).execute_command("GET", "a")
    with pytest.raises(redis.ConnectionError, match="16 redirects"):
        pipe.execute()
    pipe = RawPipeline(RouteGaveUp(r)).execute_command("SET", "a", 1).execute_command("GET", "a")
    ok, err = pipe.execute(raise_on_error=False)
    assert ok == b"OK" and isinstance(err, redis.ConnectionError)


def test_a_lease_keeps_one_connection_and_replaces_it_after_it_was_dropped(r: redis.Redis) -> None:
    lease = ConnectionLease(r)
    ids = [RawPipeline(lease).execute_command("CLIENT", "ID").execute()[0] for _ in range(3)]
    assert len(set(ids)) == 1  # one connection for every round trip
    assert len(r.connection_pool._in_use_connections) == 1
    r.execute_command("CLIENT", "KILL", "ID", ids[0])
    # The round trip on the dropped connection fails as a redis-py one would (the engine retries
    # the run), and the lease gives that connection up: the next round trip has a new one.
    with pytest.raises(redis.ConnectionError):
        RawPipeline(lease).execute_command("CLIENT", "ID").execute()
    assert len(r.connection_pool._in_use_connections) == 0
    (again,) = RawPipeline(lease).execute_command("CLIENT", "ID").execute()
    assert again != ids[0]
    lease.release()
    assert len(r.connection_pool._in_use_connections) == 0


def test_run_many_sends_again_only_the_calls_refused_with_noscript(appender: QueueAppender, r: redis.Redis) -> None:
    scripts = appender.brokers.get("broker-a").scripts
    r.script_flush()
    r.script_load(source("send"))  # send.lua is loaded, adopt.lua is not
    send_keys, send_args = appender.send_call(AppendRequest(MQ0, [(encode_header("m0"), b"0")]))
    adopt = ([keys.sub_state(MQ1.tag, "g"), keys.queue_next(MQ1.tag)], ["c1", "tok", 2000])
    sent, adopted = scripts.run_many([("send", send_keys, send_args), ("adopt", *adopt)])
    assert int(sent[0]) == 0 and adopted == [0]
    # send.lua ran once: sending the whole pipeline again would have stored the message twice.
    assert [m.body for m in MessageLog(appender.brokers).read(MQ0, 0, 10)] == [b"0"]


def test_appends_survive_a_script_flush_and_store_each_message_once(appender: QueueAppender, r: redis.Redis) -> None:
    r.script_flush()
    one = appender.append(MQ0, [(encode_header("a"), b"a")])
    r.script_flush()
    many = appender.append_many([AppendRequest(MQ0, [(encode_header("b"), b"b")]),
                                 AppendRequest(MQ1, [(encode_header("c"), b"c"), (encode_header("d"), b"d")])])
    assert one.offsets == [0] and [m.offsets for m in many] == [[1], [0, 1]]
    log = MessageLog(appender.brokers)
    assert [m.body for m in log.read(MQ0, 0, 10)] == [b"a", b"b"]
    assert [m.body for m in log.read(MQ1, 0, 10)] == [b"c", b"d"]


def test_thread_leases_keep_a_connection_per_thread_and_give_it_back(redis_url: str) -> None:
    """A producer's sends keep one connection per thread (``ThreadLeases``): the same connection
    for every send of a thread, back in the pool when the thread ends or the leases are closed,
    and never used by a forked child (its socket is the parent's)."""
    import gc
    import os
    import threading

    from mqorder.store.raw_pipe import ThreadLeases

    client = redis.Redis.from_url(redis_url)
    pool = client.connection_pool
    leases = ThreadLeases()

    def client_id() -> int:
        return int(RawPipeline(leases.get(client)).execute_command("CLIENT", "ID").execute()[0])

    mine = {client_id() for _ in range(5)}
    assert len(mine) == 1 and len(pool._in_use_connections) == 1
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.extend(client_id() for _ in range(3)))
    t.start()
    t.join()
    del t
    gc.collect()
    assert len(set(seen)) == 1 and set(seen) != mine  # its own connection...
    assert len(pool._in_use_connections) == 1  # ...given back when the thread ended
    pid = os.fork()
    if pid == 0:  # the child: a fresh connection of its own, the parent's left alone
        code = 0 if client_id() not in mine else 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client_id() in mine  # the parent's connection still answers in step
    leases.close()
    assert len(pool._in_use_connections) == 0
    client.close()


def test_lean_reads_give_what_redis_py_reads_and_keep_the_connection_healthy(redis_url: str) -> None:
    """Replies are read straight from hiredis's reader on a plain connection (``_read_lean``):
    the same values as redis-py's own reads for every reply shape, error replies in place, and the
    connection's health-check clock moved as redis-py moves it (no extra PING on the next send)."""
    from mqorder.store import raw_pipe

    r = redis.Redis.from_url(redis_url, health_check_interval=30)  # as Broker makes its client
    r.xadd("s", {"f": "v"}, id="1-1")
    r.hset("h", mapping={"a": "1"})
    commands = [("XRANGE", "s", "-", "+"), ("HMGET", "h", "a", "zz"), ("INCR", "h"), ("TIME",), ("GET", "nope")]
    lease = ConnectionLease(r)
    got = lease.round_trip(commands)
    conn = lease._conn
    assert raw_pipe._lean_reads(conn)
    assert got[0] == [[b"1-1", [b"f", b"v"]]] and got[1] == [b"1", None] and got[4] is None
    assert isinstance(got[2], redis.ResponseError) and "WRONGTYPE" in str(got[2])
    assert isinstance(got[3], list) and len(got[3]) == 2
    # redis-py's own reads of the same commands, on a connection of the same kind
    other = r.connection_pool.get_connection()
    try:
        other.send_packed_command(other.pack_commands([commands[0], commands[1], commands[4]]))
        assert [other.read_response() for _ in range(3)] == [got[0], got[1], got[4]]
    finally:
        r.connection_pool.release(other)
    conn.next_health_check = 0.0
    lease.round_trip([("PING",)])
    assert conn.next_health_check > 0.0
    lease.release()
    r.close()


def test_a_connection_class_with_its_own_reads_is_read_through_them(redis_url: str) -> None:
    """A connection class that overrides ``read_response`` (redis-py's Sentinel-managed one does,
    turning a demoted primary's READONLY into a reconnect) is never read around: every reply of a
    lean round trip goes through its override."""
    from mqorder.store import raw_pipe

    calls = []

    class Counting(redis.Connection):
        def read_response(self, *a, **kw):  # type: ignore[no-untyped-def]
            calls.append(1)
            return super().read_response(*a, **kw)

    client = redis.Redis(connection_pool=redis.ConnectionPool.from_url(redis_url, connection_class=Counting))
    lease = ConnectionLease(client)
    lease.round_trip([("PING",)])  # connected (the handshake's replies are read through it too)
    calls.clear()
    assert lease.round_trip([("SET", "k", "1"), ("GET", "k"), ("INCR", "k")]) == [b"OK", b"1", 2]
    assert len(calls) == 3 and not raw_pipe._lean_reads(lease._conn)
    lease.release()
    client.close()


def test_scripts_call_on_a_lease_loads_a_flushed_script_and_runs_it_once(appender: QueueAppender, r: redis.Redis) -> None:
    """``Scripts.call`` on a lease (a send's and the consume path's single script call): after
    ``SCRIPT FLUSH`` the NOSCRIPT reply ran nothing, the script is loaded and the call sent once
    more, so the message is stored once."""
    scripts = appender.brokers.get("broker-a").scripts
    lease = ConnectionLease(r)
    r.script_flush()
    send_keys, send_args = appender.send_call(AppendRequest(MQ0, [(encode_header("m0"), b"0")]))
    reply = scripts.call("send", send_keys, send_args, lease)
    assert int(reply[0]) == 0
    with pytest.raises(redis.ResponseError):  # any other error reply is raised
        scripts.call("send", send_keys, ["not-a-count"], lease)
    assert [m.body for m in MessageLog(appender.brokers).read(MQ0, 0, 10)] == [b"0"]
    lease.release()


def test_a_lean_round_trip_times_out_as_redis_py_would_and_drops_the_connection(redis_url: str) -> None:
    """A reply slower than the socket timeout: ``redis.TimeoutError`` (what redis-py's reads raise,
    which its ``Retry`` and the engine's translation know), the half-read connection dropped, and
    the next round trip of the lease on a new connection in step."""
    r = redis.Redis.from_url(redis_url, socket_timeout=0.2, health_check_interval=30)
    lease = ConnectionLease(r)
    (first,) = lease.round_trip([("CLIENT", "ID")])
    with pytest.raises(redis.TimeoutError):
        lease.round_trip([("BLPOP", "nothing-here", 1)])
    assert lease._conn is None  # given up, not handed back with a reply still to come
    (again,) = lease.round_trip([("CLIENT", "ID")])
    assert again != first
    assert lease.round_trip([("ECHO", "in step")]) == [b"in step"]
    lease.release()
    r.close()


def test_a_round_trip_with_a_health_check_due_pings_first_and_one_not_due_does_not(redis_url: str, r: redis.Redis) -> None:
    """The lean write skips redis-py's ``send_packed_command`` only while no health check is due:
    a connection idle past ``health_check_interval`` is PINGed before the command, as redis-py
    does, so a dead one is found before a send is written to it."""
    client = redis.Redis.from_url(redis_url, health_check_interval=30)
    lease = ConnectionLease(client)
    lease.round_trip([("CLIENT", "ID")])

    def pings() -> int:
        return int(r.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))

    before = pings()
    for _ in range(3):
        lease.round_trip([("GET", "k")])
    assert pings() == before
    lease._conn.next_health_check = 0.0
    lease.round_trip([("GET", "k")])
    assert pings() == before + 1
    lease.release()
    client.close()


def test_lean_reads_on_resp3_hand_push_messages_to_the_parser_and_keep_maps(redis_url: str) -> None:
    """On a RESP3 connection (``protocol=3``) a push message can arrive between replies: the lean
    read hands it to the parser's push handler and returns only the replies; a map reply (a dict)
    and a nil come back as redis-py returns them."""
    r = redis.Redis.from_url(redis_url, protocol=3)
    other = redis.Redis.from_url(redis_url)
    r.hset("h3", mapping={"a": "1"})
    lease = ConnectionLease(r)
    pushed: list[Any] = []
    assert lease.round_trip([("CLIENT", "TRACKING", "on"), ("GET", "tracked3")]) == [b"OK", None]
    lease._conn._parser.set_invalidation_push_handler(pushed.append)
    other.set("tracked3", "x")  # invalidates the key this connection read: a push to it
    time.sleep(0.05)
    got = lease.round_trip([("PING",), ("HGETALL", "h3"), ("GET", "nope3")])
    assert got == [b"PONG", {b"a": b"1"}, None]
    assert pushed and pushed[0][0] == b"invalidate"
    lease.release()
    r.close()
    other.close()


def test_a_packed_command_rides_in_a_round_trip_beside_plain_ones(r: redis.Redis) -> None:
    """``execute_packed``: a command packed by the caller (``packed_args`` after its header) is
    sent as it is, its reply in its place; and it is refused where a route would need its keys."""
    r.set("pk", "v")
    lease = ConnectionLease(r)
    try:
        args = ("HMGET", "ph", "a", "é")
        r.hset("ph", mapping={"a": 1, "é": 2})
        packed = b"*%d\r\n" % len(args) + packed_args(args)
        out = RawPipeline(lease).execute_command("GET", "pk").execute_packed(packed).execute_command(
            "INCR", "pn").execute()
        assert out == [b"v", [b"1", b"2"], 1]
    finally:
        lease.release()
    with pytest.raises(TypeError, match="ConnectionLease"):
        RawPipeline(r).execute_packed(packed)

"""``mqorder.store.packing``: a round trip's commands packed by the compiled packer are hiredis's
bytes exactly, its errors are hiredis's, and Redis runs what it packs."""

from __future__ import annotations

from typing import Any

import hiredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqorder.store import packing
from mqorder.store.packing import pack_command, pack_commands, pack_commands_hiredis
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline, packed_args


class _Str(str):
    pass


class _Bytes(bytes):
    pass


class _Int(int):
    pass


# What hiredis takes: str (its subclasses too), bytes (and subclasses), memoryview, int (exact
# only: an int subclass is refused) and float, with the edges of each.
_ARG = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(),  # beyond 64 bits: handed to hiredis
    st.sampled_from([0, -1, 9, 10, -10, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text().map(_Str),
    st.binary().map(_Bytes),
    st.binary().map(memoryview),
)
_COMMAND = st.lists(_ARG, max_size=40).map(tuple)


def test_the_compiled_packer_is_built() -> None:
    """``make install`` builds the extension (a C compiler is on every machine the Makefile
    installs); without it every round trip would silently pay hiredis's packing again."""
    assert packing.COMPILED


@settings(max_examples=400)
@given(st.lists(st.one_of(_COMMAND, st.binary(min_size=1)), min_size=1, max_size=8))
def test_a_round_trip_packs_to_hiredis_bytes(commands: list[Any]) -> None:
    """Every command, bytes ones passed through as they are, byte for byte what hiredis packs;
    the order kept (a command the compiled packer leaves to hiredis stays in its place)."""
    assert pack_commands(commands) == pack_commands_hiredis(commands)


@pytest.mark.parametrize("bad", [True, None, 1j, [1], {"a": 1}, bytearray(b"x"), _Int(3), object()])
def test_an_argument_hiredis_refuses_raises_its_error(bad: Any) -> None:
    with pytest.raises(TypeError) as theirs:
        hiredis.pack_command(("SET", "k", bad))
    with pytest.raises(TypeError) as ours:
        pack_commands([("PING",), ("SET", "k", bad)])
    assert str(ours.value) == str(theirs.value)


def test_a_str_that_is_not_utf8_raises_as_hiredis_does() -> None:
    with pytest.raises(UnicodeEncodeError):
        pack_command(("SET", "k", "\ud800"))


def test_a_command_that_is_not_a_tuple_is_refused_as_hiredis_refuses_it() -> None:
    with pytest.raises(TypeError, match="must be a tuple"):
        pack_commands([["PING"]])


def test_packed_args_is_a_command_without_its_header() -> None:
    args = ("EVALSHA", "f" * 40, 2, "k1", "k2", 17, -3, b"\x00\r\n")
    assert b"*8\r\n" + packed_args(args) == hiredis.pack_command(args)


def test_redis_runs_what_it_packs(redis_url: str) -> None:
    """A pipeline of every kind of argument, through a ``ConnectionLease`` (one write)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    lease = ConnectionLease(client)
    try:
        big = b"v" * 100_000
        replies = (RawPipeline(lease)
                   .execute_command("SET", "pack:s", "é✓")
                   .execute_command("SET", "pack:b", big)
                   .execute_command("SET", "pack:i", -(2**63))
                   .execute_command("SET", "pack:f", 1.5)
                   .execute_packed(b"*2\r\n" + packed_args(("GET", "pack:s")))
                   .execute_command("MGET", "pack:b", "pack:i", "pack:f")
                   .execute())
        assert replies[:4] == [b"OK"] * 4
        assert replies[4] == "é✓".encode()
        assert replies[5] == [big, b"-9223372036854775808", b"1.5"]
    finally:
        lease.release()
        client.close()

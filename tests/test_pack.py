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


class _Float(float):
    def __repr__(self) -> str:
        return f"F{float(self)!r}"


# What hiredis takes: str (its subclasses too), bytes (and subclasses), memoryview, int (exact
# only: an int subclass is refused) and float, with the edges of each.
_ARG = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(),  # beyond 64 bits: handed to hiredis
    st.sampled_from([0, -1, 9, 10, -10, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=False).map(_Float),  # its own repr, as hiredis writes it
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


@settings(max_examples=200)
@given(st.lists(st.lists(st.one_of(_ARG, st.sampled_from([True, None, _Int(3)])), max_size=8).map(tuple),
                min_size=1, max_size=6))
def test_a_refused_argument_anywhere_raises_hiredis_error(commands: list[Any]) -> None:
    """Whatever the mix, either both pack to the same bytes or both raise the same error."""
    try:
        theirs: Any = pack_commands_hiredis(commands)
    except Exception as exc:  # noqa: BLE001 - compared below
        theirs = (type(exc), str(exc))
    try:
        ours: Any = pack_commands(commands)
    except Exception as exc:  # noqa: BLE001 - compared above
        ours = (type(exc), str(exc))
    assert ours == theirs


def test_an_int_too_long_to_spell_or_a_failing_repr_raises() -> None:
    """hiredis does not check its repr of an argument (and crashes on a failed one): here the
    error is raised, and nothing is packed."""

    class Bad(float):
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    with pytest.raises(ValueError, match="digits"):
        pack_commands([("SET", "k", 10**5000)])
    with pytest.raises(RuntimeError, match="no repr"):
        pack_commands([("PING",), ("SET", "k", Bad(1.0))])


def test_commands_changed_while_packing_are_read_as_python_reads_a_list() -> None:
    """A repr runs Python code that may change the list being packed (another thread could too):
    the list is read again at every step, never through a stale pointer (once a use after free,
    found in review: a cleared list read freed memory)."""
    commands: list[Any] = []

    class Clears(float):
        def __repr__(self) -> str:
            commands.clear()
            return "1.0"

    class Grows(float):
        def __repr__(self) -> str:
            commands.extend([("X" * 10, i) for i in range(20_000)])
            return "2.0"

    commands[:] = [("SET", "k", Clears(1.0)), *[("A", i) for i in range(2_000)]]
    assert pack_commands(commands) == hiredis.pack_command(("SET", "k", 1.0))
    commands[:] = [("SET", "k", Grows(2.0)), ("GET", "k")]
    assert pack_commands(commands) == b"".join(hiredis.pack_command(c) for c in
                                               [("SET", "k", 2.0), ("GET", "k"), *[("X" * 10, i) for i in range(20_000)]])


def test_a_fallback_that_fails_or_gives_no_bytes_is_an_error() -> None:
    from mqorder.store import _pack

    def boom(cmd: Any) -> bytes:
        raise KeyError("from the fallback")

    with pytest.raises(KeyError, match="from the fallback"):
        _pack.pack_commands([("PING",), ("SET", "k", memoryview(b"v"))], boom)
    with pytest.raises(TypeError, match="must return bytes"):
        _pack.pack_commands([("SET", "k", memoryview(b"v"))], lambda cmd: "not bytes")


def test_one_command_given_as_bytes_is_refused_as_hiredis_refuses_it() -> None:
    """``pack_command`` and ``packed_args`` take a tuple: bytes are not a command packed already
    there (only a round trip's list of commands may hold those)."""
    with pytest.raises(TypeError, match="must be a tuple"):
        pack_command(b"PING")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a tuple"):
        packed_args(b"*1\r\n$4\r\nPING\r\n")  # type: ignore[arg-type]


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

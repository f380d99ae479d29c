"""The ``--- @include`` lines of ``mqorder/store/lua``: each file includes exactly the preludes whose
helpers (or generated constants) it uses, the loader resolves them once in dependency order, and
every script still loads into a real redis-server.

The Lua is read as text: top-level ``local function NAME`` and ``local NAME =`` of a prelude are
what it defines; a bare ``NAME`` (a call ``NAME(`` or a value such as ``now`` or ``NOBODY``) in a
file's code, comments and string literals stripped, is a use."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import redis

from mqorder import keys
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome, decode_record
from mqorder.model import MessageExt
from mqorder.store.scripts import GENERATED, NAMES, IncludeError, Scripts, include_order, includes, source

LUA = resources.files("mqorder.store") / "lua"
FILES = sorted(p.name[:-4] for p in LUA.iterdir() if p.name.endswith(".lua"))
PRELUDES = [f for f in FILES if f.startswith("_")]
SCRIPTS = [f for f in FILES if not f.startswith("_")]

#: Lua comments (long and short) and string literals (quoted and long brackets), leftmost first.
_NOT_CODE = re.compile(
    r"--\[(=*)\[.*?\]\1\]|--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"|\[(=*)\[.*?\]\2\]", re.DOTALL
)
_DEF_FUNCTION = re.compile(r"^local\s+function\s+([A-Za-z_]\w*)", re.MULTILINE)
_DEF_LOCALS = re.compile(r"^local\s+([A-Za-z_][\w\s,]*?)\s*=", re.MULTILINE)
_NAME = re.compile(r"(?<![\w.:])[A-Za-z_]\w*")


def text(name: str) -> str:
    return GENERATED[name]() if name in GENERATED else (LUA / f"{name}.lua").read_text()


def code(lua: str) -> str:
    return _NOT_CODE.sub(" ", lua)


def defines(name: str) -> set[str]:
    """The top-level locals of ``name``: what a file that includes it may use."""
    c = code(text(name))
    names = set(_DEF_FUNCTION.findall(c))
    for group in _DEF_LOCALS.findall(c):
        names.update(n.strip() for n in group.split(","))
    return names


INCLUDABLE = [*GENERATED, *PRELUDES]
PROVIDED = {name: defines(name) for name in INCLUDABLE}
HELPERS = set().union(*PROVIDED.values())


def uses(name: str) -> set[str]:
    """The helpers and constants of any prelude that ``name``'s own code refers to."""
    return (set(_NAME.findall(code(text(name)))) & HELPERS) - defines(name)


def test_the_helper_names_are_found() -> None:
    """Guards the parsing itself: an empty set would make the checks below pass vacuously."""
    assert {"now", "NOBODY", "lock_live", "release_lock", "append_entries", "commit_fence"} <= HELPERS
    assert uses("assign") == {"NOBODY", "now", "ahead", "lock_live", "release_lock", "grant_epoch"}
    assert uses("ledger") == set()


@pytest.mark.parametrize("name", FILES)
def test_each_file_includes_exactly_the_preludes_it_uses(name: str) -> None:
    declared = includes(text(name), name)
    used = uses(name)
    assert len(declared) == len(set(declared)), f"{name}.lua includes a prelude twice: {declared}"
    unused = [d for d in declared if not PROVIDED[d] & used]
    assert not unused, f"{name}.lua includes {unused} but uses nothing they define"
    missing = used - set().union(set(), *(PROVIDED[d] for d in declared))
    assert not missing, f"{name}.lua uses {sorted(missing)} without including the prelude that defines it"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resolved_script_defines_each_helper_once_before_its_first_use(name: str) -> None:
    order = include_order(name)
    assert len(order) == len(set(order))
    defined: set[str] = set()
    for part in (*order, name):
        assert uses(part) <= defined, f"{name}: {part} uses {sorted(uses(part) - defined)} before it is defined"
        defined |= defines(part) & HELPERS
    resolved = code(source(name))
    for helper in HELPERS:
        assert len(re.findall(rf"^local\s+(?:function\s+)?{helper}\b", resolved, re.MULTILINE)) <= 1, helper


def test_every_script_file_is_registered() -> None:
    assert set(SCRIPTS) == set(NAMES)


def test_every_script_loads_into_redis_under_its_registered_sha(r: redis.Redis) -> None:
    scripts = Scripts(r)
    for name in NAMES:
        assert r.script_load(source(name)) == getattr(scripts, name).sha, name


def test_scripts_carry_only_what_they_include() -> None:
    """The issue's cost: every script used to carry all four preludes (12-16 KB each)."""
    every_prelude = sum(len(text(p)) + 1 for p in INCLUDABLE)
    for name in NAMES:
        parts = [*include_order(name), name]
        assert source(name) == "\n".join(text(p) for p in parts)
        assert len(source(name)) < every_prelude + len(text(name)), name
    assert source("ledger") == text("ledger") and len(source("ledger")) < 1024
    assert source("touch") == text("_now") + "\n" + text("touch")
    assert "local function lock_live" not in source("commit")
    assert "local NOBODY" not in source("send")


def test_includes_resolve_depth_first_each_once() -> None:
    files = {
        "s": '--- @include "_a"\n--- @include "_b"\nreturn 1\n',
        "_a": '--- @include "_c"\n--- @include "_b"\n',
        "_b": '--- @include "_c"\n',
        "_c": "",
    }
    assert include_order("s", files.get) == ("_c", "_b", "_a")


def test_an_unknown_include_names_the_chain_and_the_fix() -> None:
    files = {"s": '--- @include "_a"\n', "_a": '--- @include "_lokc"\n'}
    with pytest.raises(IncludeError, match=r"s -> _a: include '_lokc' is neither .*_lokc\.lua.*fix .* of _a\.lua"):
        include_order("s", files.get)
    with pytest.raises(IncludeError, match="no script 'nope'"):
        source("nope")


def test_an_include_cycle_is_refused() -> None:
    files = {"s": '--- @include "_a"\n', "_a": '--- @include "_b"\n', "_b": '--- @include "_a"\n'}
    with pytest.raises(IncludeError, match="include cycle _a -> _b -> _a"):
        include_order("s", files.get)
    with pytest.raises(IncludeError, match="include cycle _a -> _a"):
        include_order("_a", {"_a": '--- @include "_a"\n'}.get)


def test_a_malformed_include_line_is_refused() -> None:
    for line in ("--- @include _lock", '-- @include "_lock"', "--- @include '_lock'"):
        with pytest.raises(IncludeError, match="malformed include line"):
            includes(line + "\n", "s")


def test_ledger_flush_runs_by_sha_and_reloads_after_a_script_flush(r: redis.Redis) -> None:
    buf = LedgerBuffer("g", "c1", "run1", 1000)
    msg = MessageExt(msg_id="m7", topic="t", broker_name="broker-a", queue_id=0, queue_offset=7, body=b"x",
                     keys=["k"], tags=None, properties={}, born_timestamp=1, store_timestamp=1)
    r.script_flush()
    buf.note([msg], LedgerOutcome.SUCCESS, 1.0, 2.0, epoch=3)
    buf.flush(Scripts(r))
    assert buf.records == []
    assert r.script_exists(Scripts(r).ledger.sha) == [True]
    (_, fields), = r.xrange(keys.ledger("g"))
    rec = decode_record(fields[b"r"])
    assert (rec["offset"], rec["msg_id"], rec["epoch"], rec["outcome"]) == (7, "m7", 3, "SUCCESS")

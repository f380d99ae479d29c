"""Where a redis-server's time goes over a window: CPU, client round trips, commands, and scripts.

``RedisMeter`` reads one redis-server between ``start`` and ``stop``:

* **CPU**: ``INFO cpu`` ``used_cpu_user + used_cpu_sys`` (Redis's own ``getrusage``, µs precision).
* **Round trips**: ``INFO stats`` ``total_reads_processed`` (one per request the server read: a
  pipeline is one), the meter's own two ``INFO`` calls taken out.
* **Commands**: ``INFO commandstats`` (reset at ``start``) calls and µs per command. Redis counts a
  command run inside a script twice over: in its own row, and in the script's (``evalsha``), whose
  time includes it; ``exec`` likewise includes the commands of its transaction.
* **SLOWLOG** (``slowlog=True``: threshold 0, so every command is logged with its duration): each
  ``EVALSHA`` is named after its script (``names``: SHA1 → script name), and the commands a script
  ran (logged with client address ``?:0`` right before the script's own entry: a script is atomic,
  so nothing else runs in between) are attributed to it, which splits a script's time into its
  Redis commands and the Lua around them (the interpreter, the preludes it defines on each call,
  argument handling). A collector thread moves the log out every ``DRAIN_S`` (``SLOWLOG GET`` and
  ``RESET`` in one ``MULTI``), so a long window never overflows ``slowlog-max-len``.

What the log does not hold: a blocking ``XREAD`` that timed out (Redis 7.0 logs a blocked command
only when data serves it; ``commandstats`` counts both), and ``EXEC`` (its commands are logged one
by one). Logging every command costs Redis CPU itself, so a window with the SLOWLOG on is for the
breakdown; the CPU figures come from a window with it off (``bench.trickle_cost`` runs both).

Clients of the benchmark itself are named ``METER_NAME`` (``CLIENT SETNAME``) and left out of the log.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

#: The ``CLIENT SETNAME`` of every client of the measuring apparatus: its commands are not the system's.
METER_NAME = "bench-meter"
#: Commands the meter sends inside its own window (left out of the command counts).
METER_COMMANDS = frozenset({"info", "config|resetstat", "config|set", "config|get", "slowlog|get",
                            "slowlog|reset"})
SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
#: Seconds between two moves of the SLOWLOG out of Redis.
DRAIN_S = 0.2
MAX_LEN = 1_000_000


def library_script_names() -> dict[str, str]:
    """Scripts of the libraries on the same Redis (SHA1 → name): redis-py's ``Lock`` (a release is
    ``GET`` + ``DEL``) and kombu's Redis transport (its bindings' refresh and sweep)."""
    from redis.lock import Lock

    out = {hashlib.sha1(src.encode()).hexdigest(): f"redis-py Lock {what}"
           for what, src in (("release", Lock.LUA_RELEASE_SCRIPT), ("extend", Lock.LUA_EXTEND_SCRIPT),
                             ("reacquire", Lock.LUA_REACQUIRE_SCRIPT))}
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:
        return out
    for const, what in (("REFRESH_BINDING", "refresh binding"), ("SWEEP_BINDINGS", "sweep bindings")):
        src = getattr(kombu_redis, const, None)
        if isinstance(src, str):
            out[hashlib.sha1(src.encode()).hexdigest()] = f"kombu {what}"
    return out


def label(args: list[bytes], names: dict[str, str]) -> str:
    """What one logged command is, for a table row: ``EVALSHA begin``, ``XREAD BLOCK``, ``HSET``.

    A script by SHA1 takes its name (or the SHA1's first 8 digits when it is not one of ``names``);
    an ``XREAD`` says whether it blocked; ``FCALL`` names its function; other commands their name."""
    cmd = args[0].decode(errors="replace").upper()
    if cmd in ("EVALSHA", "EVALSHA_RO") and len(args) > 1:
        sha = args[1].decode(errors="replace").lower()
        return f"{cmd} {names.get(sha, sha[:8])}"
    if cmd in ("EVAL", "EVAL_RO"):
        return f"{cmd} (inline script)"
    if cmd in ("FCALL", "FCALL_RO") and len(args) > 1:
        return f"{cmd} {args[1].decode(errors='replace')}"
    if cmd in ("XREAD", "XREADGROUP"):
        return f"{cmd} BLOCK" if any(a.upper() == b"BLOCK" for a in args) else cmd
    if cmd in ("CLIENT", "CONFIG", "SCRIPT", "XINFO", "OBJECT", "CLUSTER") and len(args) > 1:
        return f"{cmd} {args[1].decode(errors='replace').upper()}"
    return cmd


def pretty(lab: str) -> str:
    """A ``label`` as a report shows it: ``EVALSHA begin`` → ```begin.lua` (EVALSHA)``."""
    cmd, _, rest = lab.partition(" ")
    if cmd in ("EVALSHA", "EVALSHA_RO") and rest:
        return f"{rest} ({cmd})" if " " in rest else f"`{rest}.lua` ({cmd})"
    return lab


@dataclass
class Cost:
    """Calls and µs of one row of a breakdown."""

    calls: int = 0
    usec: int = 0

    def add(self, usec: int, calls: int = 1) -> None:
        self.calls += calls
        self.usec += usec


@dataclass
class SlowBreakdown:
    """The SLOWLOG of one window, aggregated: top-level commands and, per script, what it ran."""

    #: Per row label (``label``): calls and µs of the commands clients sent (a script's µs include its commands).
    top: dict[str, Cost] = field(default_factory=dict)
    #: Per script label, per command label: the commands the script ran.
    inner: dict[str, dict[str, Cost]] = field(default_factory=dict)
    #: Entries left out: the meter's own.
    skipped: int = 0

    def feed(self, entries: Iterable[Any], names: dict[str, str]) -> None:
        """Add one ``SLOWLOG GET`` reply (newest first, as Redis returns it)."""
        pending: list[tuple[str, int]] = []
        for e in sorted(entries, key=lambda e: int(e[0])):
            _id, _ts, usec, args = e[0], e[1], int(e[2]), e[3]
            addr = e[4] if len(e) > 4 else b""
            name = e[5] if len(e) > 5 else b""
            if name == METER_NAME.encode():
                self.skipped += 1
                continue
            lab = label(args, names)
            if addr.startswith(b"?"):  # run by a script: its entry follows
                pending.append((lab, usec))
                continue
            self.top.setdefault(lab, Cost()).add(usec)
            if pending:
                owner = lab if lab.split(" ", 1)[0] in SCRIPT_COMMANDS else "(no script entry)"
                into = self.inner.setdefault(owner, {})
                for ilab, iusec in pending:
                    into.setdefault(ilab, Cost()).add(iusec)
                pending = []
        if pending:  # cannot happen (a script's entry is logged with its commands); kept visible if it does
            into = self.inner.setdefault("(no script entry)", {})
            for ilab, iusec in pending:
                into.setdefault(ilab, Cost()).add(iusec)

    def to_json(self) -> dict[str, Any]:
        return {"top": {k: [v.calls, v.usec] for k, v in self.top.items()},
                "inner": {s: {k: [v.calls, v.usec] for k, v in d.items()} for s, d in self.inner.items()},
                "skipped": self.skipped}


class _Collector(threading.Thread):
    """Moves the SLOWLOG out of Redis every ``DRAIN_S`` into a ``SlowBreakdown``, until stopped."""

    def __init__(self, url: str, names: dict[str, str]) -> None:
        super().__init__(daemon=True, name="slowlog-collector")
        self.r = redis.Redis.from_url(url, client_name=METER_NAME, socket_timeout=60)
        self.r.ping()  # connected (and named) now, before the log is reset
        self.names = names
        self.out = SlowBreakdown()
        self.halt = threading.Event()
        self.error: BaseException | None = None
        #: Round trips of the collector (one ``MULTI`` pipeline per move), taken out of the window's reads.
        self.drains = 0

    def drain(self) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.execute_command("SLOWLOG", "GET", MAX_LEN)
        pipe.execute_command("SLOWLOG", "RESET")
        entries, _ = pipe.execute()
        self.drains += 1
        if len(entries) >= MAX_LEN:
            raise RuntimeError(f"the SLOWLOG filled up ({MAX_LEN:,} entries in {DRAIN_S}s): entries were lost; "
                               "measure a slower rate or raise bench.redis_meter.MAX_LEN")
        self.out.feed(entries, self.names)

    def run(self) -> None:
        try:
            while not self.halt.wait(DRAIN_S):
                self.drain()
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish() in the measuring thread
            self.error = exc

    def pause(self) -> int:
        """Stop moving the log (the window is over); returns the round trips the collector made."""
        self.halt.set()
        self.join(30)
        return self.drains

    def finish(self) -> SlowBreakdown:
        """The last move (after ``pause``), and the breakdown of the whole window."""
        try:
            if self.error is not None:
                raise RuntimeError(f"SLOWLOG collector failed: {self.error}") from self.error
            self.drain()
            return self.out
        finally:
            self.r.close()


def _cpu(info: dict[str, Any]) -> float:
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class RedisMeter:
    """CPU, round trips, commandstats and (optionally) the SLOWLOG of one redis-server over a window."""

    #: Reads the meter itself causes in a window: ``INFO cpu`` at the start, ``INFO all`` at the end.
    OWN_READS = 2

    def __init__(self, url: str, names: dict[str, str] | None = None) -> None:
        self.url = url
        self.names = names or {}
        self.r = redis.Redis.from_url(url, client_name=METER_NAME, socket_timeout=60)
        self.r.ping()  # connected (and named) before any window
        self._cpu0 = 0.0
        self._t0 = 0.0
        self._collector: _Collector | None = None
        self._threshold: str | None = None

    def close(self) -> None:
        if self._collector is not None:
            self._collector.halt.set()
        self.r.close()

    def start(self, *, slowlog: bool = False) -> None:
        if slowlog:
            self._threshold = str(self.r.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"])
            self.r.config_set("slowlog-max-len", MAX_LEN)
            self.r.config_set("slowlog-log-slower-than", 0)
            self._collector = _Collector(self.url, self.names)
            self.r.slowlog_reset()
            self._collector.start()
        self.r.config_resetstat()  # zeroes commandstats and total_reads_processed
        self._cpu0 = _cpu(self.r.info("cpu"))
        self._t0 = time.perf_counter()

    def stop(self, *, own_calls: dict[str, int] | None = None, own_reads: int = 0) -> dict[str, Any]:
        """The window's figures. ``own_calls``/``own_reads``: commands and reads of other apparatus the
        caller counted itself (a lag poll), taken out of the counts."""
        drains = self._collector.pause() if self._collector is not None else 0
        info = self.r.info("all")
        secs = time.perf_counter() - self._t0
        slow = None
        if self._collector is not None:
            self.r.config_set("slowlog-log-slower-than", self._threshold or "10000")
            slow = self._collector.finish().to_json()
            self._collector = None
        own = dict(own_calls or {})
        own["multi"] = own.get("multi", 0) + drains  # the collector's MULTI ... EXEC
        own["exec"] = own.get("exec", 0) + drains
        stats: dict[str, dict[str, int]] = {}
        for k, v in info.items():
            if not k.startswith("cmdstat_"):
                continue
            cmd = k.removeprefix("cmdstat_")
            calls = int(v["calls"]) - own.get(cmd, 0)
            if cmd in METER_COMMANDS or calls <= 0:
                continue
            stats[cmd] = {"calls": calls, "usec": int(v["usec"])}
        return {"seconds": secs, "cpu_s": _cpu(info) - self._cpu0,
                "reads": int(info["total_reads_processed"]) - self.OWN_READS - own_reads - drains,
                "commandstats": stats, "slowlog": slow}


def script_commands(slow: dict[str, Any]) -> dict[str, list[int]]:
    """Per command (commandstats spelling, lower case): [calls, µs] run inside scripts, from a window's
    SLOWLOG breakdown (``SlowBreakdown.to_json``)."""
    out: dict[str, list[int]] = {}
    for inner in slow.get("inner", {}).values():
        for lab, (calls, usec) in inner.items():
            c = out.setdefault(lab.split(" ", 1)[0].lower(), [0, 0])
            c[0] += calls
            c[1] += usec
    return out


def top_level(window: dict[str, Any], slow: dict[str, Any]) -> tuple[float, float]:
    """(commands clients sent, µs Redis spent in them) in a window, each command's time counted once.

    ``commandstats`` counts a command a script ran in its own row and in the script's; the share of
    each command's calls and time that ran inside scripts is taken from ``slow`` (a SLOWLOG breakdown
    of the same workload: the window's own, or the paired window's when this one ran without the
    log), and taken out. ``exec``'s time includes its transaction's commands: left out (they count
    in their own rows)."""
    inner = script_commands(slow)
    logged: dict[str, list[int]] = {}
    for lab, (calls, usec) in slow.get("top", {}).items():
        c = logged.setdefault(lab.split(" ", 1)[0].lower(), [0, 0])
        c[0] += calls
        c[1] += usec
    calls = usec = 0.0
    for cmd, v in window["commandstats"].items():
        if cmd == "exec":
            continue
        i, t = inner.get(cmd, [0, 0]), logged.get(cmd, [0, 0])
        share_calls = i[0] / (i[0] + t[0]) if i[0] + t[0] else 0.0
        share_usec = i[1] / (i[1] + t[1]) if i[1] + t[1] else 0.0
        calls += v["calls"] * (1 - share_calls)
        usec += v["usec"] * (1 - share_usec)
    return calls, usec

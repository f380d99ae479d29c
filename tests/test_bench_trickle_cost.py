"""The ``trickle_cost`` and ``idle`` bench sections' accounting: what the Redis meter attributes on a
real redis-server, the tree client of an A/B configuration, and the figures the reports derive."""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from bench import redis_meter
from bench.idle import markdown as idle_markdown
from bench.idle import worst_share
from bench.redis_meter import RedisMeter, top_level
from bench.trickle_cost import CostSpec, TreeClient, parse_spec
from bench.trickle_cost_report import markdown, run_breakdown, run_figures
from mqorder.testing.embedded import RedisServer

SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) redis.call('TIME') return redis.call('GET', KEYS[1])"


def test_meter_gives_each_script_its_commands_and_leaves_out_its_own() -> None:
    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    with RedisServer() as srv:
        meter = RedisMeter(srv.url, {sha: "demo"})
        c = redis.Redis.from_url(srv.url)
        try:
            c.script_load(SCRIPT)
            meter.start(slowlog=True)
            for i in range(3):
                c.evalsha(sha, 1, "k", i)
            tx = c.pipeline(transaction=True)
            tx.set("a", 1)
            tx.get("a")
            tx.execute()
            win = meter.stop()
        finally:
            c.close()
            meter.close()
    slow = win["slowlog"]
    assert slow["top"]["EVALSHA demo"][0] == 3
    assert {k: v[0] for k, v in slow["inner"]["EVALSHA demo"].items()} == {"SET": 3, "TIME": 3, "GET": 3}
    # The transaction's commands are logged as the client's own (EXEC is not logged): no double count.
    assert slow["top"]["SET"][0] == 1 and slow["top"]["GET"][0] == 1 and "EXEC" not in slow["top"]
    assert not any(k.startswith(("INFO", "SLOWLOG", "CONFIG")) for k in slow["top"])
    assert win["commandstats"]["set"]["calls"] == 4 and win["commandstats"]["exec"]["calls"] == 1
    assert win["reads"] == 3 + 1  # three EVALSHA, one MULTI ... EXEC pipeline; the meter's reads left out
    calls, usec = top_level(win, slow)
    assert calls == pytest.approx(3 + 1 + 2)  # EVALSHA x3, MULTI, SET, GET: the script's commands not again
    assert 0 < usec < sum(v["usec"] for k, v in win["commandstats"].items() if k != "exec")


def test_meter_moves_the_log_out_during_a_long_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_meter, "DRAIN_S", 0.02)
    monkeypatch.setattr(redis_meter, "MAX_LEN", 5_000)
    with RedisServer() as srv:
        meter = RedisMeter(srv.url)
        c = redis.Redis.from_url(srv.url)
        try:
            c.ping()
            meter.start(slowlog=True)
            t_end = time.monotonic() + 0.5
            n = 0
            while time.monotonic() < t_end:
                c.incrby("n", 1)
                n += 1
            win = meter.stop()
        finally:
            c.close()
            meter.close()
    assert win["slowlog"]["top"]["INCRBY"][0] == n == win["commandstats"]["incrby"]["calls"]
    assert win["reads"] == n  # the collector's moves (one MULTI pipeline each) are taken out


def test_a_spec_names_its_tree_and_settings_or_says_what_is_wrong(tmp_path: Path) -> None:
    assert parse_spec("now=.") == CostSpec("now")
    tree = tmp_path / "tree"
    (tree / "mqorder").mkdir(parents=True)
    (tree / "mqorder" / "__init__.py").write_text("")
    spec = parse_spec(f"before={tree}:MQORDER_CONSUME_LINGER_MS=0")
    assert spec == CostSpec("before", str(tree.resolve()), {"MQORDER_CONSUME_LINGER_MS": "0"})
    with pytest.raises(ValueError, match="KEY=ROOT"):
        parse_spec("/tmp/tree")
    with pytest.raises(ValueError, match="holds no mqorder package"):
        parse_spec(f"x={tmp_path}")
    with pytest.raises(ValueError, match="is not MQORDER_<NAME>=<value>"):
        parse_spec(f"x={tree}:LINGER=0")


def test_tree_client_sends_with_its_trees_producer_and_names_its_scripts(tmp_path: Path) -> None:
    with RedisServer() as srv, contextlib.ExitStack() as st:
        client = TreeClient(st, CostSpec("now"), srv.url, tmp_path / "client.log")
        floor = client.request("lua_floor", scripts=["send", "commit"], n=200)
        client.request("create", topic="t", queues=4)
        sent = client.request("paced", topic="t", n=50, rate=2000)
        names = client.request("scripts")["names"]
        with pytest.raises(RuntimeError, match="unknown op 'nope'"):
            client.request("nope")
        r = redis.Redis.from_url(srv.url)
        try:
            logged = sum(r.xlen(k) for k in r.scan_iter("*:log"))
        finally:
            r.close()
    # Paced: the 50th send leaves 49/2000 s after the first at the earliest, so the rate is at most
    # 50 / 0.0245 whatever the machine's load (unpaced, 50 sends take a few ms: over 10,000/s).
    # (It asserted a rate over 500 before: under the suite's load one run made 327.)
    assert logged == 50 and sent["cpu_s"] > 0 and 0 < sent["rate"] <= 50 / (49 / 2000)
    assert "send" in names.values() and "begin" in names.values()
    # Defining send.lua's preludes costs more than an empty script, which costs something.
    assert 0 < floor["empty_us"] < floor["preludes_us"]["send"]
    assert set(floor["preludes_us"]) == {"send", "commit"}


def _window(n: int, cpu_s: float, stats: dict[str, tuple[int, int]], **extra: Any) -> dict[str, Any]:
    return {"messages": n, "cpu_s": cpu_s, "reads": 3 * n, "worker_cpu_s": 0.3 * n / 1000, "rate": 1000.0,
            "commandstats": {k: {"calls": c, "usec": u} for k, (c, u) in stats.items()}, **extra}


def _run(n: int = 1000, send_lua_usec: int = 30_000) -> dict[str, Any]:
    """A trickle run: per message one send.lua (its XADD inside), one blocking XREAD, one RPUSH of the
    bench; plus 100 XREADs that timed out (not in the SLOWLOG)."""
    stats = {"evalsha": (n, send_lua_usec), "xadd": (n, 3 * n), "xread": (n + 100, 15 * n + 500),
             "rpush": (n, 2 * n)}
    slow = {"top": {"EVALSHA send": [n, send_lua_usec + n], "XREAD BLOCK": [n, 15 * n], "RPUSH": [n, 2 * n]},
            "inner": {"EVALSHA send": {"XADD": [n, 3 * n]}}, "skipped": 0}
    return {"run": 0, "plain": _window(n, 0.2, stats, producer_cpu_s=0.15, p50_ms=0.5, p99_ms=2.0),
            "slow": _window(n, 0.23, stats, slowlog=slow)}


def test_figures_split_redis_time_into_commands_scripts_lua_and_the_rest() -> None:
    run = _run()
    f = run_figures(run, "trickle")
    in_commands = (30_000 + 15 * 1000 + 500 + 2 * 1000) / 1000  # XADD counted once, inside send.lua
    assert f["in_commands_us"] == pytest.approx(in_commands)
    assert f["outside_us"] == pytest.approx(200 - in_commands)
    assert f["slowlog_us"] == pytest.approx(30)
    assert f["reads"] == 3 and f["reads_app"] == 2  # the bench's RPUSH is one read each
    assert f["commands"] == pytest.approx(3.1)  # send.lua, XREAD (+ 0.1 timed out), RPUSH; not the XADD inside
    b = run_breakdown(run)
    assert b["EVALSHA send ↳ XADD"] == (1.0, 3.0)
    assert b["EVALSHA send ↳ Lua"] == (1.0, pytest.approx(28.0))  # 31 µs per call, 3 of them in XADD
    assert b["XREAD BLOCK, timed out (commandstats)"] == (0.1, 0.5)


def test_report_puts_trickle_and_drain_side_by_side_per_configuration() -> None:
    res = {"rate": 1000, "seconds": 1, "runs": 1, "drain_messages": 1000, "queues": 16, "keys": 2000,
           "workers": 2, "concurrency": 2,
           "specs": [{"key": "before", "root": "/tmp/a", "env": {}}, {"key": "after", "root": "", "env": {}}],
           "trickle": {"before": [_run(send_lua_usec=40_000)], "after": [_run()]},
           "drain": {"before": [_run()], "after": [_run()]}}
    text = "\n".join(markdown(res))
    assert "| per message | trickle [before] | trickle [after] | drain [before] | drain [after] |" in text
    row = next(line for line in text.splitlines() if line.startswith("| `send.lua` (EVALSHA)"))
    assert row.split(" | ")[1:4] == ["1.000", "41.0", "41.00"] and row.split(" | ")[4:7] == ["1.000", "31.0", "31.00"]
    assert "EVALSHA` µs per call at the trickle without the SLOWLOG and with it" in text
    res["lua_floor"] = {"after": {"empty_us": 4.0, "preludes_us": {"send": 12.5}}}
    text = "\n".join(markdown(res))
    assert "| `send.lua` | 31.0 | 28.0 | 12.5 |" in text  # whole call, its Lua, its preludes alone


def _layout(topics: int, worker_s: float, redis_s: float) -> dict[str, Any]:
    top = {"EVALSHA sweep": [60, 6_000]}
    return {"topics": topics, "queues": 1024 // topics, "concurrency": 2, "warmup_s": 40.0,
            "worker_cpu_s": worker_s, "worker_main_cpu_s": worker_s, "beat_cpu_s": 0.1,
            "window": {"seconds": 60.0, "cpu_s": redis_s, "reads": 600, "commandstats": {"evalsha": {
                "calls": 60, "usec": 6_000}}, "slices": [{"seconds": 10.0, "commands_per_s": 1.0, "cpu_share": 0.01}]},
            "slow": {"seconds": 20.0, "slowlog": {"top": top, "inner": {}}}}


def test_idle_verdict_judges_workers_and_redis_of_the_costlier_layout() -> None:
    res = {"seconds": 60, "slow_seconds": 20, "target_share": 0.02,
           "layouts": [_layout(1, 0.6, 0.3), _layout(64, 1.2, 0.3)]}
    assert worst_share(res) == pytest.approx(0.025)
    text = "\n".join(idle_markdown(res))
    assert "**1.50 %** (met)" in text and "**2.50 %** (**NOT met**)" in text
    assert "`sweep.lua` (EVALSHA)" in text


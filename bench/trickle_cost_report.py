"""The ``trickle_cost`` section of RESULTS.md (and of ``python -m bench.trickle_cost``'s output).

Figures per run, then medians over runs (min–max in brackets): the summary from the windows
without the SLOWLOG, the breakdown per command and script from the windows with it
(``bench.trickle_cost`` measures both in every run).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.common import measured_note
from bench.redis_meter import pretty, top_level

PHASES = ("trickle", "drain")
#: Commands of the benchmark itself in a trickle window: the latency listener's recorder (``bench.listeners``).
APPARATUS = {"rpush": "the bench's latency recorder (`RPUSH bench:lat`, every 10 ms per process)"}
NAN = float("nan")
LUA_ROW = "Lua: the script minus its commands (interpreter, `redis.call` arguments and replies, preludes)"


def run_figures(run: dict[str, Any], phase: str) -> dict[str, float]:
    """Per message, one run: CPU, round trips, commands and Redis's time in and out of commands."""
    p, s = run["plain"], run["slow"]
    n = p["messages"]
    calls_top, usec_top = top_level(p, s["slowlog"])
    stats = p["commandstats"]
    app_calls = sum(stats.get(c, {}).get("calls", 0) for c in APPARATUS) if phase == "trickle" else 0
    redis_us = p["cpu_s"] / n * 1e6
    out = {
        "rate": p["rate"], "worker_us": p["worker_cpu_s"] / n * 1e6, "redis_us": redis_us,
        "in_commands_us": usec_top / n, "outside_us": redis_us - usec_top / n,
        "producer_us": p["producer_cpu_s"] / n * 1e6 if "producer_cpu_s" in p else NAN,
        "reads": p["reads"] / n, "reads_app": (p["reads"] - app_calls) / n,
        "commands": calls_top / n,
        "commands_all": sum(v["calls"] for c, v in stats.items() if c != "exec") / n,
        "slowlog_us": (s["cpu_s"] - p["cpu_s"]) / n * 1e6,
        "p50_ms": p.get("p50_ms", NAN), "p99_ms": p.get("p99_ms", NAN),
    }
    return out


def run_breakdown(run: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per row of the breakdown (a command or script clients sent, ``<script> ↳ <command>`` for what a
    script ran, ``<script> ↳ Lua`` for the rest of its time): (calls per message, µs per message),
    from the run's SLOWLOG window."""
    w = run["slow"]
    n, slow = w["messages"], w["slowlog"]
    rows: dict[str, tuple[float, float]] = {}
    for lab, (calls, usec) in slow["top"].items():
        rows[lab] = (calls / n, usec / n)
    for script, inner in slow["inner"].items():
        for lab, (calls, usec) in inner.items():
            rows[f"{script} ↳ {lab}"] = (calls / n, usec / n)
        s_calls, s_usec = slow["top"].get(script, (0, 0))
        rows[f"{script} ↳ Lua"] = (s_calls / n, (s_usec - sum(u for _, u in inner.values())) / n)
    # A blocking XREAD that timed out is not logged (Redis 7.0); commandstats counts it.
    cs = w["commandstats"].get("xread", {"calls": 0, "usec": 0})
    logged = [v for lab, v in slow["top"].items() if lab.split(" ", 1)[0] == "XREAD"]
    missing = (cs["calls"] - sum(c for c, _ in logged), cs["usec"] - sum(u for _, u in logged))
    if missing[0] > 0:
        rows["XREAD BLOCK, timed out (commandstats)"] = (missing[0] / n, max(missing[1], 0) / n)
    return rows


def _median_or_nan(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else NAN


def _cell(xs: list[float], digits: int) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "–"
    m, lo, hi = statistics.median(xs), min(xs), max(xs)
    f = f"{{:,.{digits}f}}"
    return f.format(m) if len(xs) == 1 else f"{f.format(m)} ({f.format(lo)}–{f.format(hi)})"


SUMMARY = (
    ("rate", "messages/s", 0),
    ("worker_us", "worker CPU per message, µs (all worker processes, pool children included)", 1),
    ("redis_us", "**Redis CPU per message, µs**", 1),
    ("in_commands_us", "… in commands (`commandstats`, each command once: a script's commands in the script)", 1),
    ("outside_us", "… outside any command (event loop, reading and parsing requests, writing replies, "
                   "blocking/waking, cron)", 1),
    ("producer_us", "producer CPU per message, µs (`send_orderly`, one at a time)", 1),
    ("reads", "client round trips per message (`total_reads_processed`)", 2),
    ("reads_app", "… without the bench's latency recorder", 2),
    ("commands", "commands per message, sent by clients", 2),
    ("commands_all", "commands per message, with those scripts run", 2),
    ("slowlog_us", "SLOWLOG at threshold 0: its own Redis CPU per message, µs (not in the figures above)", 1),
    ("p50_ms", "p50 send → handle, ms", 2),
    ("p99_ms", "p99 send → handle, ms", 2),
)


def _columns(res: dict[str, Any]) -> list[tuple[str, str]]:
    keys = [s["key"] for s in res.get("specs", [])]
    return [(ph, k) for ph in PHASES for k in keys if res.get(ph, {}).get(k)]


def _head(res: dict[str, Any], cols: list[tuple[str, str]]) -> list[str]:
    one = len({k for _, k in cols}) == 1
    return [ph if one else f"{ph} [{k}]" for ph, k in cols]


def summary_rows(res: dict[str, Any]) -> list[list[str]]:
    cols = _columns(res)
    figs = {(ph, k): [run_figures(r, ph) for r in res[ph][k]] for ph, k in cols}
    return [[label, *(_cell([f[field] for f in figs[c]], digits) for c in cols)] for field, label, digits in SUMMARY]


def _pretty(lab: str) -> str:
    if " ↳ " in lab:
        inner = lab.split(" ↳ ", 1)[1]
        return f"  ↳ {LUA_ROW if inner == 'Lua' else inner}"
    return pretty(lab)


def breakdown_rows(res: dict[str, Any], limit: int = 40) -> list[list[str]]:
    """Rows of the per-command/per-script table: per column (phase, configuration) calls/msg, µs/call,
    µs/msg; scripts in order of trickle time, each followed by what it ran."""
    cols = _columns(res)
    per = {c: [run_breakdown(r) for r in res[c[0]][c[1]]] for c in cols}
    labels = {lab for runs in per.values() for b in runs for lab in b}

    def med(c: tuple[str, str], lab: str, i: int) -> float:
        return _median_or_nan([b.get(lab, (0.0, 0.0))[i] for b in per[c]])

    def weight(lab: str) -> float:
        return max((med(c, lab, 1) for c in cols), default=0.0)

    top = sorted((lab for lab in labels if " ↳ " not in lab), key=weight, reverse=True)[:limit]
    order = []
    for lab in top:
        order.append(lab)
        inner = sorted((x for x in labels if x.startswith(f"{lab} ↳ ") and not x.endswith(" ↳ Lua")), key=weight,
                       reverse=True)
        order += inner + ([f"{lab} ↳ Lua"] if f"{lab} ↳ Lua" in labels else [])
    rows = []
    for lab in order:
        cells = []
        for c in cols:
            calls, usec = med(c, lab, 0), med(c, lab, 1)
            per_call = _median_or_nan([b[lab][1] / b[lab][0] for b in per[c] if b.get(lab, (0, 0))[0]])
            seen = calls or not math.isnan(per_call)
            cells += [f"{calls:.3f}" if seen else "–", f"{per_call:.1f}" if not math.isnan(per_call) else "–",
                      f"{usec:.2f}" if seen else "–"]
        rows.append([_pretty(lab), *cells])
    totals = []
    for c in cols:
        tot = [sum(v[1] for lab, v in b.items() if " ↳ " not in lab) for b in per[c]]
        cpu = [r["slow"]["cpu_s"] / r["slow"]["messages"] * 1e6 for r in res[c[0]][c[1]]]
        totals.append((tot, cpu))
    rows.append(["**all of the above** (each command once)",
                 *(x for tot, _ in totals for x in ("", "", _cell(tot, 1)))])
    rows.append(["Redis CPU of these windows (SLOWLOG on)",
                 *(x for _, cpu in totals for x in ("", "", _cell(cpu, 1)))])
    return rows


def commandstats_rows(res: dict[str, Any], limit: int = 25) -> list[list[str]]:
    """``commandstats`` of the windows without the SLOWLOG: calls and µs per message per command (a
    command a script ran counts here too, and in the script's row)."""
    cols = _columns(res)
    per: dict[tuple[str, str], list[dict[str, tuple[float, float]]]] = {}
    for c in cols:
        per[c] = [{cmd: (v["calls"] / r["plain"]["messages"], v["usec"] / r["plain"]["messages"])
                   for cmd, v in r["plain"]["commandstats"].items()} for r in res[c[0]][c[1]]]
    cmds = {cmd for runs in per.values() for b in runs for cmd in b}

    def med(c: tuple[str, str], cmd: str, i: int) -> float:
        return _median_or_nan([b.get(cmd, (0.0, 0.0))[i] for b in per[c]])

    order = sorted(cmds, key=lambda cmd: max(med(c, cmd, 1) for c in cols), reverse=True)[:limit]
    return [[f"`{cmd}`" + (" (bench)" if cmd in APPARATUS else ""),
             *(x for c in cols for x in (f"{med(c, cmd, 0):.3f}", f"{med(c, cmd, 1):.2f}"))] for cmd in order]


def evalsha_per_call(res: dict[str, Any], phase: str, key: str, window: str) -> float:
    """Median over runs of ``commandstats`` µs per ``EVALSHA`` in the windows ``plain`` or ``slow``."""
    per = []
    for r in res.get(phase, {}).get(key, []):
        v = r[window]["commandstats"].get("evalsha")
        if v and v["calls"]:
            per.append(v["usec"] / v["calls"])
    return _median_or_nan(per)


def lua_floor_rows(res: dict[str, Any]) -> list[list[str]]:
    """Per hot script: the Lua of a call (breakdown), its preludes alone, and an empty script, µs/call."""
    floors = res.get("lua_floor") or {}
    keys = [s["key"] for s in res.get("specs", []) if floors.get(s["key"])]
    if not keys:
        return []
    per = {k: [run_breakdown(r) for r in res["trickle"][k]] for k in keys}
    rows = []
    names = [n for n in floors[keys[0]]["preludes_us"]]
    for name in ["", *names]:
        cells = []
        for k in keys:
            f = floors[k]
            if not name:
                cells += ["", "", f"{f['empty_us']:.1f}"]
                continue
            lab = f"EVALSHA {name}"
            lua = _median_or_nan([b[f"{lab} ↳ Lua"][1] / b[f"{lab} ↳ Lua"][0] for b in per[k]
                                  if b.get(f"{lab} ↳ Lua", (0, 0))[0]])
            whole = _median_or_nan([b[lab][1] / b[lab][0] for b in per[k] if b.get(lab, (0, 0))[0]])
            pre = f["preludes_us"].get(name)
            cells += [f"{whole:.1f}" if not math.isnan(whole) else "–", f"{lua:.1f}" if not math.isnan(lua) else "–",
                      f"{pre:.1f}" if pre is not None else "–"]
        rows.append([f"`{name}.lua`" if name else "`return 0` (an empty script: the floor of any EVALSHA)", *cells])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def markdown(res: dict[str, Any]) -> list[str]:
    """The section: summary, breakdown per command and script, commandstats, and how it was measured."""
    out = ["## Per-message cost at a trickle (issue 27)", ""]
    cols = _columns(res)
    if not cols:
        return out + ["Not measured in this run (`python -m bench.run --only trickle_cost`).", ""]
    out += measured_note(res)
    specs = res["specs"]
    if len(specs) > 1 or specs[0]["root"] or specs[0]["env"]:
        out += ["Configurations: " + "; ".join(
            f"**{s['key']}**: " + (f"tree `{s['root']}`" if s["root"] else "this tree")
            + (f", {s['env']}" if s["env"] else "") for s in specs), ""]
    head = _head(res, cols)
    out += _table(["per message", *head], summary_rows(res))
    out += ["Redis's time per command and per script (windows with the SLOWLOG at threshold 0: every command "
            "logged with its duration; calls per message, µs per call, µs per message; a script's row includes "
            "the commands it ran, listed under it):", ""]
    out += _table(["command or script", *(f"{h} {u}" for h in head for u in ("calls/msg", "µs/call", "µs/msg"))],
                  breakdown_rows(res))
    ev = [(k, evalsha_per_call(res, "trickle", k, "plain"), evalsha_per_call(res, "trickle", k, "slow"))
          for k in {c[1]: None for c in cols}]
    out += ["A script's time above includes what the SLOWLOG itself costs to log the commands it runs (inside "
            "the script's call): `EVALSHA` µs per call at the trickle without the SLOWLOG and with it, from "
            "`commandstats`: " + "; ".join(f"{k}: {a:.1f} → {b:.1f}" for k, a, b in ev) + ".", ""]
    floor = lua_floor_rows(res)
    if floor:
        fkeys = [s["key"] for s in specs if (res.get("lua_floor") or {}).get(s["key"])]
        one = len(fkeys) == 1
        out += ["The Lua of a call, and what a call costs before the script's body runs (µs per call; the last "
                "column: `EVALSHA` of the script's preludes alone, every function it includes defined and then "
                "`return 0`, 2,000 calls on an idle redis-server, without the SLOWLOG):", ""]
        out += _table(["script", *(f"{u}" + ("" if one else f" [{k}]") for k in fkeys
                                   for u in ("whole call (SLOWLOG on)", "its Lua (SLOWLOG on)", "preludes alone"))],
                      floor)
    out += ["`INFO commandstats` of the windows without the SLOWLOG (every command, those run by scripts "
            "included: they count in their own row and in their script's):", ""]
    out += _table(["command", *(f"{h} {u}" for h in head for u in ("calls/msg", "µs/msg"))], commandstats_rows(res))
    n = int(res["rate"] * res["seconds"])
    out += [
        f"Trickle: the latency section's stock rig: {res['workers']} stock workers, prefork -c {res['concurrency']}, "
        f"stock settings (consume batch 1, linger on), {res['queues']} queues, {res['keys']:,} keys, "
        f"{res['rate']:,.0f} msg/s from a paced `send_orderly` producer (a process of the configuration's own "
        f"tree), {n:,} messages per window right after 1 s of discarded warm-up; the `latency` listener. Drain: "
        f"the throughput section's no-op drain of a {res['drain_messages']:,}-message backlog (consume batch 32, "
        "pull 32), from the kick (open the topic, rebalance, dispatch) to lag 0; the driver's lag poll is taken "
        "out of the counts. Every run measures each configuration twice, without and with the SLOWLOG (the "
        "order alternating); the summary comes from the windows without it, the breakdown from those with it. "
        f"Medians of {res['runs']} runs (min–max).",
        "",
        "Redis CPU is `INFO cpu` (user + system of the whole server); \"in commands\" is `commandstats` time with "
        "each command counted once (the share of a command's calls and time that ran inside scripts is taken "
        "from the SLOWLOG window); \"outside any command\" is the rest: what Redis spends around commands, per "
        "round trip and per wake-up rather than per command. The SLOWLOG logs a command a script ran with "
        "address `?:0` right before the script's own entry, which gives each script's commands; \"Lua\" is the "
        "script's time minus them: the interpreter, and turning each `redis.call`'s arguments into a command and "
        "its reply into Lua values (a command's own time covers neither). A blocking `XREAD` that timed out "
        "is not logged (Redis 7.0): its row comes from commandstats. Round trips are requests Redis read (a "
        "pipeline is one); the latency recorder's `RPUSH` is the benchmark's, not mqorder's.",
        "",
    ]
    return out

"""What one round trip costs at a trickle: the floor under issue 27's per-message figures.

A trickling message is alone: each of its round trips (the producer's send, the worker's wake-up
read, its commit) is a separate write and read on a socket, a wake-up of a sleeping process on
each side and of Redis's event loop, with caches cold between them. This section measures that
floor on this machine, paced at the trickle's rate (1,000/s, one operation at a time from one
connection, as ``send_orderly`` is called in the trickle section), in the same run:

* ``PING``: a round trip that does nothing (redis-py, the connection ``send_orderly`` uses);
* ``EVALSHA`` of ``return 0``: the cheapest script call (a fenced commit or an append is one);
* ``send_orderly``: the producer's whole send (``send.lua``: append, dedup/ids, wake-up).

For each: the client's CPU per operation (``time.process_time``, the pacing sleep included, as in
the trickle section's producer figure) and Redis's CPU per operation (``INFO cpu`` deltas over the
window, on a ``redis-server`` of its own). Variants alternate run by run so they face the same
machine. With the trickle section's round trips per message, the floor says how much of a
message's cost any design with that many round trips pays before doing anything.

    python -m bench.run --only trickle_floor
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from bench.common import Config, log, measured_note, redis_and_client, summarize
from mqorder import Producer

RATE = 1_000
VARIANTS = (
    ("ping", "`PING` (redis-py, one connection)"),
    ("eval0", "`EVALSHA` of `return 0`"),
    ("send", "`send_orderly` (one message)"),
)


def _redis_cpu(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _paced(op: Callable[[int], object], n: int) -> tuple[float, float]:
    """``n`` calls of ``op`` at ``RATE``/s on a fixed schedule: (client CPU s, wall s)."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        delay = t0 + i / RATE - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        op(i)
    return time.process_time() - cpu0, time.perf_counter() - t0


def _one(variant: str, seconds: float) -> dict[str, Any]:
    n = int(RATE * seconds)
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        op: Callable[[int], object]
        if variant == "ping":
            conn = r.connection_pool.get_connection("PING")  # one connection, no pool round trip per call
            st.callback(r.connection_pool.release, conn)

            def op(_i: int) -> object:
                conn.send_command("PING")
                return conn.read_response()
        elif variant == "eval0":
            sha = r.script_load("return 0")
            conn = r.connection_pool.get_connection("EVALSHA")
            st.callback(r.connection_pool.release, conn)

            def op(_i: int) -> object:
                conn.send_command("EVALSHA", sha, 0)
                return conn.read_response()
        else:
            p = Producer(srv.url)
            st.callback(p.close)
            p.create_topic("floor", queues=16)

            def op(i: int) -> object:
                return p.send_orderly("floor", str(time.time_ns()).encode(), sharding_key=f"key-{i % 2000}")
        _paced(op, min(n, 200))  # warm-up: connections, script cache
        time.sleep(0.2)
        rc0 = _redis_cpu(r)
        cpu, wall = _paced(op, n)
        rc1 = _redis_cpu(r)
    return {"variant": variant, "n": n, "rate": n / wall, "client_us": cpu / n * 1e6,
            # one INFO before and one after the window: negligible beside n operations
            "redis_us": (rc1 - rc0) / n * 1e6}


def run(cfg: Config, *, seconds: float, runs: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for i in range(runs):
        order = [VARIANTS[(i + k) % len(VARIANTS)][0] for k in range(len(VARIANTS))]
        for v in order:
            row = _one(v, seconds)
            rows.append({**row, "run": i})
            log(f"trickle_floor run {i} {v}: client {row['client_us']:.1f} µs/op, redis {row['redis_us']:.1f} µs/op")
    return {"rate": RATE, "seconds": seconds, "runs": runs, "rows": rows}


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``trickle_floor`` section, only when it ran."""
    if not res or not res.get("rows"):
        return []
    out = ["## The floor at a trickle: one round trip (issue 27)", ""]
    out += measured_note(res)
    out += [f"One operation at a time from one connection, paced at {res['rate']:,}/s for {res['seconds']} s, "
            f"{res['runs']} runs per variant, variants alternating; each variant on a `redis-server` of its own. "
            "Median (min–max) over runs.", "",
            "| operation | client CPU per operation | Redis CPU per operation |", "|---|---|---|"]
    for key, label in VARIANTS:
        rows = [r for r in res["rows"] if r["variant"] == key]
        if not rows:
            continue
        c, r = summarize(x["client_us"] for x in rows), summarize(x["redis_us"] for x in rows)
        out.append(f"| {label} | {c.median:.1f} µs ({c.lo:.1f}–{c.hi:.1f}) | {r.median:.1f} µs ({r.lo:.1f}–{r.hi:.1f}) |")
    out.append("")
    return out

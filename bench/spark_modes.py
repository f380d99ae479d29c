"""Spark beyond local mode, measured: the same publish and read on ``local[2]``, on a standalone
cluster (two workers, one 1-core executor each) and through Spark Connect (a server on
``local[2]``), in one run (issue 29).

Each mode's driver is a process of its own (``tests.spark_cluster.SparkDriver``: one
SparkContext per process, and a Connect client marks its whole process as Connect), started from
the installed pyspark like the tests' cluster and server (``tests.spark_cluster``), each on this
run's ``redis-server``. A round runs ``tests.spark_jobs.timed_publish_and_count`` in every mode in
turn, on a fresh 16-queue topic each: ``mqorder.spark.publish`` of rows Spark makes itself (the
same rows in every mode), then ``reads`` counts of the topic. Session and cluster starts are
timed apart, not in the rates. The JVMs of the modes not measuring stay up, idle.

    python -m bench.run --only spark_modes
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Config, log, measured_note, summarize
from mqorder import Producer
from mqorder.testing.embedded import RedisServer

QUEUES, KEYS, BODY = 16, 2000, 100
MODES = (
    ("local", "`local[2]`"),
    ("standalone", "standalone cluster, 2 workers × 1 core (`spark://`)"),
    ("connect", "Spark Connect (`sc://`, a server on `local[2]`)"),
)


def run(cfg: Config, *, rows: int, runs: int, reads: int = 3) -> dict[str, Any]:
    from tests.spark_cluster import ConnectServer, SparkDriver, StandaloneCluster

    out: dict[str, Any] = {"rows": rows, "runs": runs, "reads": reads, "starts": {}, "rounds": []}
    with contextlib.ExitStack() as st, tempfile.TemporaryDirectory(prefix="mqorder-spark-modes-") as tmp:
        work = Path(tmp)
        for d in ("cluster", "connect"):
            (work / d).mkdir()
        srv = st.enter_context(RedisServer())
        drivers: dict[str, SparkDriver] = {}

        def started(name: str, make: Any) -> Any:
            t0 = time.perf_counter()
            thing = make()
            out["starts"][name] = time.perf_counter() - t0
            log(f"spark_modes: {name} up in {out['starts'][name]:.1f} s")
            return thing

        env = {"MQORDER_REDIS_URL": srv.url}
        drivers["local"] = started("local driver", lambda: SparkDriver(
            work / "local.log", master="local[2]", env=env, conf={"spark.ui.enabled": "false",
                                                                  "spark.sql.warehouse.dir": str(work / "wh-local")}))
        st.callback(drivers["local"].stop)
        cluster = started("standalone cluster", lambda: StandaloneCluster(work / "cluster").start())
        st.callback(cluster.stop)
        drivers["standalone"] = started("standalone driver", lambda: SparkDriver(
            work / "standalone.log", master=cluster.master_url, env={**env, "SPARK_CONF_DIR": str(cluster.conf_dir)},
            conf={"spark.sql.warehouse.dir": str(work / "wh-standalone")}))
        st.callback(drivers["standalone"].stop)
        server = started("Connect server", lambda: ConnectServer(work / "connect").start())
        st.callback(server.stop)
        drivers["connect"] = started("Connect client", lambda: SparkDriver(work / "connect.log", remote=server.url,
                                                                            env=env))
        st.callback(drivers["connect"].stop)

        with Producer(srv.url) as p:
            for i in range(runs + 1):  # round 0 warms every mode up (JVMs, Python workers), unmeasured
                for mode, _ in MODES:
                    topic = f"modes_{mode}_{i}"
                    p.create_topic(topic, queues=QUEUES)
                    opts = {"redisUrl": srv.url} if mode == "connect" else {}
                    n = rows if i else min(rows, 20_000)
                    res = drivers[mode].call("timed_publish_and_count", topic=topic, n=n, keys=KEYS,
                                             body_size=BODY, opts=opts, reads=reads)
                    if res["stored"] != n or any(c != n for c in res["counted"]):
                        raise RuntimeError(f"spark_modes {mode}: stored {res['stored']}, counted {res['counted']}, "
                                           f"expected {n}")
                    if i:
                        out["rounds"].append({"mode": mode, "round": i, **res})
                        log(f"spark_modes round {i} {mode}: publish {n / res['publish_s']:,.0f} rows/s, "
                            f"count best {n / min(res['read_s']):,.0f} msg/s")
    return out


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``spark_modes`` section, only when it ran."""
    if not res or not res.get("rounds"):
        return []
    rows = res["rows"]
    out = ["## Spark beyond local mode: `local[2]`, a standalone cluster, Spark Connect (issue 29)", ""]
    out += measured_note(res)
    out += [f"The same {rows:,} rows ({BODY}-byte bodies, {KEYS:,} keys, {QUEUES} queues) published with "
            f"`mqorder.spark.publish` and then counted {res['reads']} times, in each mode in turn, "
            f"{res['runs']} rounds after an unmeasured warm-up round; a fresh topic per mode and round; "
            "one `redis-server`, every JVM on this machine. Median (min–max) over rounds.", "",
            "| mode | publish, rows/s | first count, msg/s | best count, msg/s | publish vs `local[2]` | best count vs `local[2]` |",
            "|---|---|---|---|---|---|"]
    med: dict[str, tuple[float, float]] = {}
    for mode, label in MODES:
        rs = [r for r in res["rounds"] if r["mode"] == mode]
        if not rs:
            continue
        pub = summarize(rows / r["publish_s"] for r in rs)
        first = summarize(rows / r["read_s"][0] for r in rs)
        best = summarize(rows / min(r["read_s"]) for r in rs)
        med[mode] = (pub.median, best.median)
        base = med.get("local")
        vs = (f"{pub.median / base[0]:.2f}x", f"{best.median / base[1]:.2f}x") if base else ("–", "–")
        out.append(f"| {label} | {pub.median:,.0f} ({pub.lo:,.0f}–{pub.hi:,.0f}) | {first.median:,.0f} "
                   f"({first.lo:,.0f}–{first.hi:,.0f}) | {best.median:,.0f} ({best.lo:,.0f}–{best.hi:,.0f}) | "
                   f"{vs[0]} | {vs[1]} |")
    starts = res.get("starts") or {}
    if starts:
        out += ["", "Starts (not in the rates): " + "; ".join(f"{k} {v:.1f} s" for k, v in starts.items()) + "."]
    out += ["", "All three run on the same 2 cores: the standalone cluster adds a master, two worker and two "
            "executor JVMs beside its driver, and a task's rows cross from the executor to its Python "
            "worker as in `local[2]`; Spark Connect adds the gRPC hop between the client and the server, "
            "which plans and runs the job as a `local[2]` driver would. So this compares the modes' "
            "overheads on one machine, not a cluster's scale-out.", ""]
    return out

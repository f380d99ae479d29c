"""Spark section: publish a DataFrame exactly once, next to the Python producer; read it back.

Against one ``redis-server``, flushed before each measurement, on the same data (``rows``
messages of ``body_size``-byte bodies over ``n_keys`` keys and a 16-queue topic one consumer group
subscribes to, so every append does its subscription check; nobody owns the queues, so nobody is
woken):

* **spark publish**: ``mqorder.spark.publish`` of a cached DataFrame on ``local[2]`` (the Arrow
  writer: queue computed in Spark SQL, repartition by queue, sort and encode in the tasks, staged
  per queue, published on commit; exactly once: every message has an id and the append skips known
  ids). Timed from the call to its return, the commit included.
* **send_orderly_batch**: one Python process, the same (key, body) pairs pre-built, 10,000 per call.
  It and the Spark publish run in back-to-back pairs, ``runs`` times: on a shared machine the load
  moves, and the two halves of a pair see about the same load, so the ratio is taken per pair.
* **send_orderly**: one Python process, one synchronous call per message (a ``one_by_one`` prefix
  of the same pairs; the rate is what matters).
* **spark batch read**: ``spark.read.format("mqorder").load().count()`` of the published topic.
* **read A/B** (``bench.spark_ab``): the same count by today's reader and by the reader of the
  baseline commit (issue 29's target: >= 2.5x), each in a Spark application of its own on the same
  master and data, in back-to-back pairs (ratio per pair, wall time and CPU time of the process tree).

Spark's session start (JVM, Python workers) is reported apart: it is paid once per application.
Runnable alone: ``python -m bench.spark [--rows N] [--runs R]``; ``bench.run`` calls
``run(cfg)`` and renders ``markdown(result)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from bench.common import Config, client, log, redis_server, summarize
from bench.plan import size
from bench.targets import threshold
from mqorder import Producer
from mqorder.model import MessageModel

TOPIC = "spark_bench"
GROUP = "g-spark-bench"
QUEUES = 16
BATCH_CALL = 10_000
#: Targets of the issue: Spark publish vs send_orderly_batch, and vs the one-by-one loop.


def pairs(rows: int, n_keys: int, body_size: int) -> list[tuple[str, bytes]]:
    """The (sharding key, body) pairs, exactly as the Spark DataFrame below builds them."""
    out = []
    for i in range(rows):
        head = b'{"k":%d,"s":%d}' % (i % n_keys, i)
        out.append((f"key-{i % n_keys}", head.ljust(body_size, b" ")))
    return out


def _fresh_topic(url: str) -> Producer:
    r = client(url)
    r.flushall()
    r.close()
    p = Producer(url)
    p.create_topic(TOPIC, queues=QUEUES)
    p.topics.subscribe(GROUP, TOPIC, MessageModel.CLUSTERING)
    p.send_orderly(TOPIC, b"warm", sharding_key="warm")  # route and subscription caches, script load
    return p


def _stored(p: Producer) -> int:
    from mqorder.store.log import MessageLog

    log_ = MessageLog(p.brokers)
    return sum(log_.max_offset(mq) for mq in p.describe_topic(TOPIC).message_queues)


def _publish_once(ms: Any, df: Any, url: str, rows: int) -> dict[str, Any]:
    p = _fresh_topic(url)
    try:
        t0 = time.perf_counter()
        report = ms.publish(df, TOPIC, key="key", order_by="ts", body="body", redis_url=url)
        secs = time.perf_counter() - t0
        stored = _stored(p) - 1  # minus the warm-up message
    finally:
        p.close()
    assert report.stored == rows == stored, (report, stored)
    tasks = ms.job_report(report.job_id, url).get("task_seconds", {})
    return {"messages": rows, "seconds": secs, "rate": rows / secs, "commit_seconds": report.commit_seconds,
            "task_seconds": tasks}


def _batch_once(url: str, data: list[tuple[str, bytes]]) -> dict[str, Any]:
    p = _fresh_topic(url)
    try:
        t0 = time.perf_counter()
        for c in range(0, len(data), BATCH_CALL):
            p.send_orderly_batch(TOPIC, data[c : c + BATCH_CALL])
        secs = time.perf_counter() - t0
    finally:
        p.close()
    return {"messages": len(data), "seconds": secs, "rate": len(data) / secs}


def run(cfg: Config | None = None, *, rows: int | None = None, n_keys: int = 2000, body_size: int = 100,
        one_by_one: int | None = None, master: str = "local[2]", runs: int | None = None) -> dict[str, Any]:
    """Measure the section; returns plain numbers (JSON-ready).

    ``send_orderly_batch`` and the Spark publish run in pairs, one right after the other, ``runs``
    times: on a shared machine the load moves, and a pair sees about the same load, so the ratio
    is taken per pair (the median pair is reported).
    """
    cfg = cfg or Config()
    rows = rows or size(cfg, "spark_rows")
    one_by_one = one_by_one or size(cfg, "spark_one_by_one")
    runs = runs or (1 if cfg.quick else cfg.runs)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    out: dict[str, Any] = {"rows": rows, "n_keys": n_keys, "body_size": body_size, "queues": QUEUES,
                           "master": master, "runs": runs}
    data = pairs(rows, n_keys, body_size)
    with contextlib.ExitStack() as st:
        srv = redis_server(st)
        os.environ["MQORDER_REDIS_URL"] = srv.url

        from pyspark.sql import functions as F

        import mqorder.spark as ms

        t0 = time.perf_counter()
        spark = ms.session("mqorder-bench", master, **{"spark.ui.enabled": "false", "spark.driver.memory": "2g",
                                                       "spark.sql.shuffle.partitions": "8"})
        spark.sparkContext.setLogLevel("ERROR")
        out["session_start_s"] = time.perf_counter() - t0
        st.callback(spark.stop)
        ident = F.col("id")
        head = F.concat(F.lit('{"k":'), (ident % n_keys).cast("string"), F.lit(',"s":'), ident.cast("string"),
                        F.lit("}"))
        df = (spark.range(rows).select(
            F.concat(F.lit("key-"), (ident % n_keys).cast("string")).alias("key"),
            ident.alias("ts"),
            F.rpad(head, body_size, " ").cast("binary").alias("body"),
        ).cache())
        df.count()  # materialise the input: the timed region is the publish, not the data generation
        # Warm-up on a small slice: Python workers started, scripts loaded (like the producer's warm send).
        _fresh_topic(srv.url).close()
        ms.publish(df.limit(1000), TOPIC, key="key", order_by="ts", body="body", redis_url=srv.url)

        out["send_orderly_batch"], out["spark_publish"] = [], []
        for i in range(runs):
            out["send_orderly_batch"].append(_batch_once(srv.url, data))
            out["spark_publish"].append(_publish_once(ms, df, srv.url, rows))
            log(f"spark bench run {i}: send_orderly_batch {out['send_orderly_batch'][-1]['rate']:,.0f}/s, "
                f"spark publish {out['spark_publish'][-1]['rate']:,.0f}/s "
                f"(commit {out['spark_publish'][-1]['commit_seconds']:.1f}s)")

        p = _fresh_topic(srv.url)
        n1 = min(one_by_one, rows)
        t0 = time.perf_counter()
        for key, body in data[:n1]:
            p.send_orderly(TOPIC, body, sharding_key=key)
        secs = time.perf_counter() - t0
        out["send_orderly"] = {"messages": n1, "seconds": secs, "rate": n1 / secs}
        p.close()
        log(f"spark bench: send_orderly {n1 / secs:,.0f}/s")

        # The topic the last publish wrote: read back whole.
        _publish_once(ms, df, srv.url, rows)
        t0 = time.perf_counter()
        counted = spark.read.format("mqorder").option("topic", TOPIC).option("redisUrl", srv.url).load().count()
        secs = time.perf_counter() - t0
        assert counted == rows + 1, counted
        out["spark_read"] = {"messages": counted, "seconds": secs, "rate": counted / secs}
        log(f"spark bench: spark batch read {counted / secs:,.0f}/s")

        from bench import spark_ab

        out["read_ab"] = spark_ab.ab_pairs("read", srv.url, TOPIC, master, runs, reps=2, expect=counted, queues=QUEUES,
                                           log=log)

    ratios = [sp["rate"] / b["rate"] for sp, b in zip(out["spark_publish"], out["send_orderly_batch"], strict=True)]
    out["ratio_vs_batch"] = summarize(ratios).to_json()
    out["ratio_vs_one_by_one"] = summarize(sp["rate"] / out["send_orderly"]["rate"]
                                           for sp in out["spark_publish"]).to_json()
    return out


def markdown(res: dict[str, Any]) -> str:
    """The section as Markdown: one table, targets beside the ratios."""
    def rates(rows: list[dict[str, Any]]) -> str:
        s = summarize(r["rate"] for r in rows)
        return f"{s.fmt(0, 'msg/s')}, {rows[0]['messages']:,} messages per run"

    def ratio(key: str, target: float, digits: int) -> str:
        d = res[key]
        s = summarize(d["values"])
        return f"{s.fmt(digits, 'x')} | >= {target:g}x {'met' if s.median >= target else 'NOT met'}"

    one, read = res["send_orderly"], res["spark_read"]
    lines = [
        f"{res['rows']:,} messages of {res['body_size']} B over {res['n_keys']:,} keys and {res['queues']} queues; "
        f"Spark on `{res['master']}`; `send_orderly_batch` and Spark publish measured in {res['runs']} "
        "back-to-back pairs (ratios per pair).",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| Spark `publish` (Arrow writer, exactly once, commit included) | {rates(res['spark_publish'])} | |",
        f"| `send_orderly_batch`, one Python process, same data | {rates(res['send_orderly_batch'])} | |",
        f"| `send_orderly` one by one | {one['rate']:,.0f} msg/s ({one['messages']:,} messages) | |",
        f"| Spark publish / send_orderly_batch | {ratio('ratio_vs_batch', threshold('spark_publish'), 2)} |",
        f"| Spark publish / send_orderly | {ratio('ratio_vs_one_by_one', threshold('spark_one_by_one'), 1)} |",
        f"| Spark batch read into a count | {read['rate']:,.0f} msg/s ({read['messages']:,} messages) | |",
        *ab_rows(res.get("read_ab"), "read", read["messages"], READ_AB_TARGET),
        f"| Spark session start (once per application, not in the rates) | {res['session_start_s']:.1f} s | |",
    ]
    return "\n".join(lines) + "\n"


#: Issue 29: today's reader against the baseline's, into a count, same run.
READ_AB_TARGET = 2.5


def ab_rows(ab: dict[str, Any] | None, what: str, rows: int, target: float) -> list[str]:
    """Table rows of a ``bench.spark_ab`` A/B: each side's rate, and the per-pair ratios."""
    if not ab:
        return []
    def rate(side: str) -> str:
        return summarize(rows / min(c["seconds"]) for c in ab[side]).fmt(0, "rows/s")

    wall, cpu = summarize(ab["ratios"]), summarize(ab["cpu_ratios"])
    met = "met" if wall.median >= target else "NOT met"
    return [
        f"| {what}, baseline `{ab['baseline_commit'][:7]}` (own Spark app, same data) | {rate('baseline')} | |",
        f"| {what}, this code (own Spark app, same data) | {rate('current')} | |",
        f"| {what}: this code / baseline, wall time (per pair) | {wall.fmt(2, 'x')} | >= {target:g}x {met} |",
        f"| {what}: baseline / this code, CPU seconds of the app's processes (per pair) | {cpu.fmt(2, 'x')} | |",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--one-by-one", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3, help="send_orderly_batch / Spark publish pairs")
    ap.add_argument("--master", default=os.environ.get("MQORDER_SPARK_MASTER", "local[2]"))
    ap.add_argument("--json", help="also write the raw figures to this file")
    args = ap.parse_args(argv)
    res = run(rows=args.rows, one_by_one=args.one_by_one, master=args.master, runs=args.runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.stdout.write(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

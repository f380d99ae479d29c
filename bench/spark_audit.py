"""Bench: the ordering audit of a 1,000,000-record consumption ledger on ``local[2]`` (target ≤ 60 s).

Runnable alone: ``python -m bench.spark_audit [--records N] [--master local[2]]``; ``run()`` is the
function ``bench/run.py`` calls (it returns the figures as a dict).

Setup (not timed): a throw-away ``redis-server``; a 16-queue topic with ``records`` messages of
~100-byte JSON bodies over 10,000 keys, written with ``send_orderly_batch``; a ledger of one SUCCESS
record per message written with the engine's own writer (``LedgerBuffer`` → ``ledger.lua``), in
offset order per queue, with born → handle latencies of a few ms; and each queue's committed offset
at its end, as a consumer that drained the topic would leave it. Building the ledger without
running workers keeps the bench about the audit: the e2e test shows workers write the same records.

Timed apart: the Spark session start, then ``mqorder.spark.audit`` (ledger read, topic read, window
functions, report numbers; ``--order-field s`` when ``--order-field`` is passed) cold, as
``mqorder pipeline audit`` runs it, then the report files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from mqorder import Producer, keys
from mqorder.client.selector import key_hash, queue_index
from mqorder.consumer.ledger import FIELDS, LedgerBuffer
from mqorder.settings import load_settings
from mqorder.store.scripts import Scripts
from mqorder.testing.embedded import RedisServer

TOPIC, GROUP = "bench-audit", "bench-audit-g"
QUEUES, KEYS = 16, 10_000
TARGET_S = 60.0
CHUNK = 10_000


def _log(msg: str) -> None:
    sys.stderr.write(f"[bench spark_audit {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def build(url: str, records: int, seed: int = 42) -> dict[str, float]:
    """The topic, the ledger and the committed offsets; returns the seconds each took."""
    rng = random.Random(seed)
    settings = load_settings(redis_url=url)
    p = Producer(settings=settings)
    p.create_topic(TOPIC, queues=QUEUES)
    mqs = p.describe_topic(TOPIC).message_queues
    seq = [0] * KEYS
    next_off = [0] * QUEUES
    buf = LedgerBuffer(GROUP, "bench@host", "run-1", max(records * 2, 1000))
    client = p.brokers.default.client
    scripts = Scripts(client)
    scripts.load("ledger")  # queued by SHA below, on a plain pipeline that cannot reload it
    pad = "x" * 60
    t_send = t_ledger = 0.0
    clock = time.time() * 1000
    for c in range(0, records, CHUNK):
        items: list[tuple[str, bytes]] = []
        recs: list[bytes] = []
        born = time.time() * 1000
        for _ in range(min(CHUNK, records - c)):
            k = rng.randrange(KEYS)
            seq[k] += 1
            key = f"key-{k}"
            items.append((key, b'{"k":%d,"s":%d,"pad":"%s"}' % (k, seq[k], pad.encode())))
            q = queue_index(key, QUEUES)
            clock = max(clock, born) + 0.02  # handled in send order: first deliveries in offset order
            start = clock
            rec = {
                "group": GROUP, "topic": TOPIC, "broker": mqs[q].broker_name, "queue": mqs[q].queue_id,
                "offset": next_off[q], "msg_id": "", "key": key,
                "key_hash": key_hash(key), "born_ms": int(start - rng.expovariate(1 / 3.0)), "start_ms": round(start, 3),
                "end_ms": round(start + 0.2, 3), "attempt": 0, "epoch": 1, "client": "bench@host", "run": "run-1",
                "outcome": "SUCCESS",
            }
            assert tuple(rec) == FIELDS, "records as the engine writes them: its fast parse reads them"
            recs.append(orjson.dumps(rec))
            next_off[q] += 1
        t0 = time.perf_counter()
        p.send_orderly_batch(TOPIC, items)
        t1 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for i in range(0, len(recs), 1000):
            buf.queue_in(pipe, scripts, recs[i:i + 1000])
        pipe.execute()
        t_ledger += time.perf_counter() - t1
        t_send += t1 - t0
    for q, mq in enumerate(mqs):
        client.hset(keys.sub_state(mq.tag, GROUP), "offset", next_off[q])
    p.close()
    return {"send_s": round(t_send, 2), "ledger_write_s": round(t_ledger, 2)}


def run(records: int = 1_000_000, master: str = "local[2]", order_field: str | None = None,
        report_dir: Path | None = None, ab_runs: int = 0) -> dict[str, Any]:
    """Build the data, start Spark, audit; the figures (seconds) and the audit's verdict. With
    ``ab_runs``, also that many A/B pairs of the audit against the baseline commit's code
    (``bench.spark_ab``: each in a Spark application of its own, same data)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    with RedisServer() as srv:
        _log(f"writing {records:,} messages and ledger records to {srv.url}")
        built = build(srv.url, records)
        _log(f"built: {built}")
        t0 = time.perf_counter()
        from mqorder.spark import audit, session

        spark = session("mqorder-bench-audit", master, **{
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "8", "spark.driver.memory": "2g",
        })
        spark.sparkContext.setLogLevel("ERROR")
        session_s = time.perf_counter() - t0
        _log(f"Spark session on {master} in {session_s:.1f} s; auditing")
        out = report_dir or Path(tempfile.mkdtemp(prefix="mqorder-bench-audit-"))
        t1 = time.perf_counter()
        rep = audit(spark, TOPIC, GROUP, order_field=order_field, redis_url=srv.url)
        audit_s = time.perf_counter() - t1
        from mqorder.spark.audit_report import write_report

        t2 = time.perf_counter()
        write_report(rep, out)
        report_s = time.perf_counter() - t2
        spark.stop()
        ab = None
        if ab_runs:
            from bench import spark_ab

            ab = spark_ab.ab_pairs("audit", srv.url, TOPIC, master, ab_runs, group=GROUP, expect=records, log=_log)
    result = {
        "records": records, "master": master, "order_field": order_field, **built,
        "session_start_s": round(session_s, 2), "audit_s": round(audit_s, 2), "report_files_s": round(report_s, 2),
        "records_per_s": round(records / audit_s), "target_s": TARGET_S, "met": audit_s <= TARGET_S,
        "audit_ok": rep.ok, "ledger_records": rep.ledger_records, "messages_stored": rep.messages_stored,
        "violations": rep.violation_count, "gaps": rep.gap_count, "p50_ms": rep.latency.p50_ms,
        "p99_ms": rep.latency.p99_ms, "report_dir": str(out), "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if ab is not None:
        result["audit_ab"] = ab
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--master", default=os.environ.get("MQORDER_SPARK_MASTER", "local[2]"))
    ap.add_argument("--order-field", default=None, help="also check this body field (the bench bodies carry s)")
    ap.add_argument("--report", type=Path, default=None, help="write the audit report here")
    ap.add_argument("--ab", type=int, default=0, help="also this many A/B pairs against the baseline commit")
    args = ap.parse_args()
    result = run(args.records, args.master, args.order_field, args.report, args.ab)
    print(json.dumps(result, indent=2))
    if not result["audit_ok"] or result["ledger_records"] != args.records:
        sys.exit(f"the audit of a clean ledger did not pass: {result}")


if __name__ == "__main__":
    main()

"""What a durable send costs: ``send_orderly`` one by one and ``send_orderly_batch``, each with and
without ``wait_replicas=1``, on a primary with one replica, interleaved run by run in one process.

A waiting send adds ``WAIT 1 <timeout>`` behind its append script, in the same round trip
(``mqorder.store.durable``): the send returns once the replica has acknowledged the write, so a
send one by one pays about one replication round trip more (the primary streams the write, the
replica applies it and answers ``REPLCONF ACK``, the primary wakes the waiting client). A batch
pays it once per broker round trip, for thousands of messages. Both nodes and the benchmark run
on this machine's loopback, so the replication round trip is the cheapest it can be: across a
network it adds the network's round trip too.

    python -m bench.durable_send                 # full sizes, 3 runs: JSON, then a Markdown table
    python -m bench.durable_send --quick         # tiny sizes, 1 run
    python -m bench.run --only durable_send      # as a section of make bench (bench/RESULTS.md)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import redis

from bench.common import Config, Summary, Workload, log, summarize
from bench.figures import fmt_summary, rates
from mqorder import Producer
from mqorder.model import MessageModel
from mqorder.testing.embedded import RedisServer

#: (results key, label, batch?, wait_replicas)
VARIANTS = (
    ("send_orderly", "`send_orderly`, one call per message", False, 0),
    ("send_orderly_wait1", "`send_orderly(wait_replicas=1)`", False, 1),
    ("batch", "`send_orderly_batch`, 10,000 items per call", True, 0),
    ("batch_wait1", "`send_orderly_batch(wait_replicas=1)`, 10,000 items per call", True, 1),
)
BATCH_CALL = 10_000


def primary_and_replica(stack: contextlib.ExitStack) -> tuple[RedisServer, redis.Redis]:
    """A primary and one replica of it (``--replicaof``), stopped when ``stack`` closes; a client
    of the primary once the replica is online."""
    primary = RedisServer().start()
    stack.callback(primary.stop)
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    stack.callback(replica.stop)
    r = redis.Redis.from_url(primary.url, socket_timeout=30)
    stack.callback(r.close)
    deadline = time.monotonic() + 30
    while int(r.info("replication").get("connected_slaves", 0)) < 1 or r.execute_command("WAIT", 1, 1000) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not come online within 30 s")
        time.sleep(0.05)
    return primary, r


def run(cfg: Config, *, single: int, batch: int, runs: int = 3, queues: int = 16,
        n_keys: int = 2000) -> dict[str, Any]:
    out: dict[str, Any] = {k: [] for k, *_ in VARIANTS}
    with contextlib.ExitStack() as st:
        primary, r = primary_and_replica(st)
        for run_no in range(runs):
            for key, _, is_batch, wait in VARIANTS:
                r.flushall()
                r.execute_command("WAIT", 1, 5000)
                p = Producer(primary.url)
                p.create_topic("prod", queues=queues)
                p.topics.subscribe("g-prod", "prod", MessageModel.CLUSTERING)
                p.send_orderly("prod", b"warm", sharding_key="warm", wait_replicas=wait)  # caches, script load
                wl = Workload(n_keys)
                n = batch if is_batch else single
                r.config_resetstat()
                if is_batch:
                    chunks = [wl.items(min(BATCH_CALL, n - c)) for c in range(0, n, BATCH_CALL)]
                    t0 = time.perf_counter()
                    for ch in chunks:
                        p.send_orderly_batch("prod", ch, wait_replicas=wait)
                    secs = time.perf_counter() - t0
                else:
                    items = wl.items(n)
                    t0 = time.perf_counter()
                    for k, body in items:
                        p.send_orderly("prod", body, sharding_key=k, wait_replicas=wait)
                    secs = time.perf_counter() - t0
                stats = r.info("commandstats")
                waits = int(stats.get("cmdstat_wait", {}).get("calls", 0))
                wait_us = float(stats.get("cmdstat_wait", {}).get("usec_per_call", 0.0))
                out[key].append({"messages": n, "seconds": secs, "rate": n / secs, "wait_calls": waits,
                                 "wait_usec_per_call": wait_us})
                p.close()
            log(f"durable_send run {run_no}: " + ", ".join(f"{k} {out[k][-1]['rate']:,.0f}/s" for k, *_ in VARIANTS))
    out["single"], out["batch_messages"], out["queues"], out["keys"] = single, batch, queues, n_keys
    return out


def _fmt_ratio(s: Summary) -> str:
    if not s.n:
        return "n/a"
    return f"{s.median:.2f}x" + (f" ({s.lo:.2f}–{s.hi:.2f}, {s.n} runs)" if s.n > 1 else " (1 run)")


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``durable_send`` section (``bench.report``), only when it ran."""
    if not res:
        return []
    rows = []
    for key, label, is_batch, wait in VARIANTS:
        runs, base = res.get(key) or [], res.get("batch" if is_batch else "send_orderly") or []
        per_msg = summarize(1e6 / x["rate"] for x in runs)
        # Each waiting run against the run of the same kind without waiting just before it: the
        # machine's load drifts between runs more than the two differ.
        paired = summarize(w["rate"] / b["rate"] for w, b in zip(runs, base, strict=False))
        rows.append([label, fmt_summary(rates(runs)), fmt_summary(per_msg, 1, "µs"),
                     _fmt_ratio(paired) if wait else "–",
                     f"{runs[-1].get('wait_calls', 0):,}" if wait and runs else "0"])
    header = ["producer", "messages/s", "per message", "vs not waiting, same run", "WAIT calls (last run)"]
    out = ["## Durable sends (`wait_replicas`)", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
           *("| " + " | ".join(row) + " |" for row in rows), ""]
    out += [f"A primary and one replica on this machine's loopback; {res.get('single', 0):,} messages per run one "
            f"by one, {res.get('batch_messages', 0):,} per run in batches; {res.get('queues')} queues, "
            f"{res.get('keys', 0):,} keys, one subscribing group; the four variants interleaved run by run. A "
            "waiting send adds one `WAIT` behind its scripts in the same round trip: one per send one by one, "
            "one per broker round trip in a batch.", ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.durable_send", description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 run")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--single", type=int, default=None, help="messages per run, one by one")
    ap.add_argument("--batch", type=int, default=None, help="messages per run, in batches")
    args = ap.parse_args()
    from bench.plan import size

    cfg = Config(quick=args.quick, runs=args.runs or (1 if args.quick else 3))
    res = run(cfg, single=args.single or size(cfg, "durable_single"), batch=args.batch or size(cfg, "durable_batch"),
              runs=cfg.runs)
    print(json.dumps(res, indent=2))
    print("\n".join(report_lines(res)))


if __name__ == "__main__":
    main()

"""The ``exporter_scrape`` section: what one scrape of ``mqorder exporter`` costs at 1,000 and 10,000
queues, and what ``mqorder status GROUP --key KEY`` costs over a 10,000-message backlog (issue 28).

    python -m bench.run --only exporter_scrape     # a section of make bench (--quick: smaller sizes)
    python -m bench.exporter_scrape [--quick]      # alone: JSON, then the Markdown section

One redis-server; topics of 1,000 queues each (the most a topic has per broker), one clustering
group subscribed to all of them, every queue assigned and locked to a client (so every lane has
an owner series), three 100-byte messages per queue. Two states are scraped, each ``runs``
times:

* ``backlog``: nothing consumed: every lane has a backlog, so the scrape's second pipeline reads
  the head message, its reconsume count and, per lane, ``TIME``: the worst case;
* ``caught up``: every offset reset to the end (``mqorder offsets reset --to latest``, the real
  script): the second pipeline has nothing to read.

Measured per scrape, in this process: ``mqorder_exporter_scrape_duration_seconds`` (what the
collector itself reports: the plan's reads of routes, subscriptions and heartbeats, and the
two pipelines), the whole exposition (``generate_latest``: collecting plus the text format, what a
Prometheus scrape waits for apart from HTTP), the series in it, and the commands Redis executed
(``INFO commandstats``, reset before). Then ``key_status`` (the ``--key`` command's function) on one
queue holding 10,000 unconsumed messages, ``--scan`` 10,000, ``runs`` times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from bench.common import Config, cpu_s, load1, log, measured_note, redis_and_client, server_pid, summarize
from mqorder import Producer
from mqorder.admin.common import Admin
from mqorder.admin.key_status import key_status
from mqorder.admin.offsets import Target, reset
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.topics import TopicManager

QUEUES_PER_TOPIC = 1000
MESSAGES_PER_QUEUE = 3
BODY = b"x" * 100
GROUP = "g-scrape"
CLIENT = "bench-client@host"
#: (full, quick) queue counts scraped.
SIZES = {False: (1_000, 10_000), True: (1_000, 2_000)}
KEY_BACKLOG = {False: 10_000, True: 10_000}
TARGET_S = 1.0


def _populate(p: Producer, topics: list[str]) -> None:
    """``MESSAGES_PER_QUEUE`` messages on every queue of ``topics``, each queue assigned and locked."""
    tm = TopicManager(p.brokers)
    locks = RebalanceLockManager(p.brokers)
    for t in topics:
        p.create_topic(t, queues=QUEUES_PER_TOPIC)
        tm.subscribe(GROUP, t, MessageModel.CLUSTERING)
        items = [(i, BODY) for _ in range(MESSAGES_PER_QUEUE) for i in range(QUEUES_PER_TOPIC)]
        p.send_orderly_batch(t, items, selector=lambda queues, key, body: key)
        mqs = [MessageQueue(t, p.brokers.default_name, i) for i in range(QUEUES_PER_TOPIC)]
        locks.assign(GROUP, [(mq, CLIENT, f"tok-{mq.queue_id}") for mq in mqs])
        locks.try_lock_batch(GROUP, mqs, CLIENT)


def _scrape(r: Any, collector: Any, redis_pid: int) -> dict[str, float]:
    r.config_resetstat()
    c0, rc0 = time.process_time(), cpu_s(redis_pid)
    t0 = time.perf_counter()
    text = collector.scrape()
    wall = time.perf_counter() - t0
    cpu, redis_cpu = time.process_time() - c0, cpu_s(redis_pid) - rc0
    commands = sum(int(v.get("calls", 0)) for k, v in r.info("commandstats").items() if k != "cmdstat_info")
    samples = {name: float(v) for name, v in (line.split(" ", 1) for line in text.splitlines()
                                              if line.startswith(("mqorder_up ", "mqorder_exporter_scrape")))}
    assert samples.get("mqorder_up") == 1.0, "the exporter could not read Redis"
    return {"collect_s": samples["mqorder_exporter_scrape_duration_seconds"], "exposition_s": wall,
            "cpu_s": cpu, "redis_cpu_s": redis_cpu, "load1": load1(),
            "series": text.count("\nmqorder_") + text.startswith("mqorder_"), "commands": commands - 1}


def run(cfg: Config, runs: int) -> dict[str, Any]:
    from mqorder.metrics.exporter import collector_for

    out: dict[str, Any] = {"queues_per_topic": QUEUES_PER_TOPIC, "messages_per_queue": MESSAGES_PER_QUEUE,
                           "body_bytes": len(BODY), "target_s": TARGET_S, "sizes": {}, "runs": runs}
    for n in SIZES[cfg.quick]:
        with contextlib.ExitStack() as st:
            srv, r = redis_and_client(st)
            settings = load_settings(redis_url=srv.url)
            p = Producer(settings=settings)
            st.callback(p.close)
            topics = [f"t-scrape-{i}" for i in range(n // QUEUES_PER_TOPIC)]
            t0 = time.perf_counter()
            _populate(p, topics)
            log(f"exporter_scrape: {n:,} queues populated in {time.perf_counter() - t0:.1f} s")
            collector = collector_for(settings)
            st.callback(collector.brokers.close)
            row: dict[str, Any] = {}
            collector.scrape()  # warm-up, not measured: an exporter scrapes every 15 s, its caches warm
            row["backlog"] = [_scrape(r, collector, server_pid(srv)) for _ in range(runs)]
            with Admin.open(settings) as admin:
                for t in topics:
                    reset(admin, GROUP, t, Target("latest", 0), force=True)
            collector.scrape()
            row["caught_up"] = [_scrape(r, collector, server_pid(srv)) for _ in range(runs)]
            out["sizes"][str(n)] = row
            for state in ("backlog", "caught_up"):
                s = summarize(x["collect_s"] for x in row[state])
                log(f"exporter_scrape: {n:,} queues, {state}: collect {s.fmt(3, 's')}")
    out["key_status"] = _key_status(runs, KEY_BACKLOG[cfg.quick])
    return out


def _key_status(runs: int, backlog: int) -> dict[str, Any]:
    """``key_status`` over one queue holding ``backlog`` unconsumed messages of 1,000 keys."""
    with contextlib.ExitStack() as st:
        srv, _ = redis_and_client(st)
        pid = server_pid(srv)
        settings = load_settings(redis_url=srv.url)
        p = Producer(settings=settings)
        st.callback(p.close)
        p.create_topic("t-key", queues=1)
        TopicManager(p.brokers).subscribe(GROUP, "t-key", MessageModel.CLUSTERING)
        for start in range(0, backlog, 5000):
            p.send_orderly_batch("t-key", [(f"order-{i % 1000}", BODY) for i in range(start, min(backlog, start + 5000))])
        times, cpu, redis_cpu, waiting = [], [], [], 0
        with Admin.open(settings) as admin:
            for _ in range(runs):
                c0, rc0 = time.process_time(), cpu_s(pid)
                t0 = time.perf_counter()
                rep = key_status(admin, GROUP, "order-7", scan=backlog)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                redis_cpu.append(cpu_s(pid) - rc0)
                waiting = rep.lanes[0].waiting
                assert rep.lanes[0].scan_complete
        log(f"exporter_scrape: status --key over {backlog:,} messages: {summarize(times).fmt(3, 's')}")
        return {"backlog": backlog, "seconds": times, "cpu_s": cpu, "redis_cpu_s": redis_cpu, "waiting": waiting,
                "load1": load1()}


def report_lines(res: dict[str, Any]) -> list[str]:
    """The report's ``exporter_scrape`` section (``bench.report``), only when it ran."""
    if not res:
        return []
    out = ["## Exporter scrape and `status --key` (issue 28)", ""]
    out += measured_note(res)
    out += ["| queues | state | `mqorder_exporter_scrape_duration_seconds` | exporter CPU | Redis CPU | "
            "series | Redis commands | load average |", "|---|---|---|---|---|---|---|---|"]
    for n, row in res["sizes"].items():
        for state, label in (("backlog", "backlog on every queue"), ("caught_up", "caught up")):
            rs = row[state]
            out.append(f"| {int(n):,} | {label} | {summarize(x['collect_s'] for x in rs).fmt(3, 's')} | "
                       f"{summarize(x['cpu_s'] for x in rs).fmt(3, 's')} | "
                       f"{summarize(x['redis_cpu_s'] for x in rs).fmt(2, 's')} | {rs[0]['series']:,} | "
                       f"{rs[0]['commands']:,} | {summarize(x['load1'] for x in rs).median:.1f} |")
    k = res["key_status"]
    out += ["", f"Topics of {res['queues_per_topic']:,} queues, one clustering group, every queue assigned and "
            f"locked, {res['messages_per_queue']} messages of {res['body_bytes']} bytes per queue; in process, "
            f"medians of {res['runs']} scrapes (min–max) after one unmeasured warm-up scrape per state (a running "
            "exporter scrapes every 15 s: the `EVAL` of each lane batch is built once and reused). *Backlog*: nothing consumed, so every lane's head is "
            "read (the worst case); *caught up*: every offset reset to the end. The duration gauge is the whole "
            "scrape as the exporter reports it: the plan's reads (routes, subscriptions, heartbeats), one round "
            "trip of `EVAL` batches of 200 lanes (`mqorder.metrics.lane_read`) and the text format, as served "
            "(apart from HTTP). Exporter CPU: this process's CPU time during the scrape; Redis CPU: the "
            "redis-server's (10 ms ticks), so on an idle machine the wall time is about their sum. Redis "
            "commands per scrape from `INFO commandstats` (the commands a script runs count too). The load "
            "average is the machine's 1-minute one during the scrapes: on a shared machine the wall time "
            f"grows with it while the CPU times do not. Target: at most {res['target_s']:g} s at 10,000 queues.",
            "",
            f"`mqorder status GROUP --key KEY` (`key_status`) over one queue of {k['backlog']:,} unconsumed "
            f"messages of 1,000 keys, scanning all of them: {summarize(k['seconds']).fmt(3, 's')} wall, "
            f"{summarize(k.get('cpu_s') or [float('nan')]).fmt(3, 's')} CPU of the command's process, "
            f"{summarize(k.get('redis_cpu_s') or [float('nan')]).fmt(2, 's')} of Redis's, at a load average of "
            f"{k.get('load1', float('nan')):.1f} ({k['waiting']} messages of the key found). Target: under a second.",
            ""]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    res = run(Config(quick=args.quick, runs=args.runs), args.runs)
    print(json.dumps(res, indent=2))
    print("\n".join(report_lines(res)))


if __name__ == "__main__":
    main()

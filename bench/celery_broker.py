"""Celery's broker, Redis or RabbitMQ, side by side: drain throughput and send-to-handle latency at
1,000 msg/s with the same stock workers, the same store (a redis-server of each rig's own) and
only Celery's broker changed.

Celery's broker carries ConsumeRequests, not messages: the drain dispatches one task per queue
(16) and the ConsumeRequests then drain their queues in batches, so the broker matters little
there; at 1,000 msg/s with linger the workers rarely need a new task either. The rows say how
much that "little" is. Each Redis/RabbitMQ pair is measured in the same section of the same run,
interleaved run by run: the drains on fresh workers per run, the latency configurations as in
``bench.latency.mqorder_latency``.

    python -m bench.run --only celery_broker
"""

from __future__ import annotations

from typing import Any

from bench.common import Config, log, summarize
from bench.latency import MqLatSpec, mqorder_latency
from bench.mqorder_drain import DrainSpec, drain

BROKERS = ("redis", "rabbitmq")
LABELS = {"redis": "Redis (the store's own server)", "rabbitmq": "RabbitMQ (a vhost of the run's own)"}


def run(cfg: Config, *, messages: int, runs: int, concurrency: int, seconds: float, rate: int = 1000) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": messages, "concurrency": concurrency, "rate": rate, "seconds": seconds,
                           "drain": {}, "latency": {}}
    out["drain"] = {kind: [] for kind in BROKERS}
    for run in range(runs):
        # Interleaved, the order alternating: fresh workers per run, so a burst of other load on the
        # machine falls on both brokers alike.
        for kind in BROKERS if run % 2 == 0 else BROKERS[::-1]:
            log(f"celery_broker: drain run {run} with Celery on {kind}")
            (res,) = drain(cfg, DrainSpec(tag=f"cb-{kind}", concurrency=concurrency, batch_max=32,
                                          plan=[(16, messages)], warmup=min(5000, messages), celery_broker=kind))
            res["run"] = run
            out["drain"][kind].append(res)
    specs = [MqLatSpec(kind, f"prefork -c {concurrency}, Celery on {kind}", pool="prefork", concurrency=concurrency,
                       celery_broker=kind) for kind in BROKERS]
    out["latency"] = mqorder_latency(cfg, rate=rate, seconds=seconds, runs=runs, specs=specs)
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    """The section of RESULTS.md: one row per broker."""
    out = ["## Celery's broker: Redis or RabbitMQ", ""]
    if not res:
        return out
    rows = []
    for kind in BROKERS:
        dr, lat = res["drain"].get(kind) or [], res["latency"].get(kind) or []
        if not dr and not lat:
            continue
        rows.append([
            LABELS[kind],
            summarize(r["rate"] for r in dr).fmt(0, "msg/s") if dr else "not measured",
            summarize(r["consume_tasks"] for r in dr).fmt(0) if dr else "",
            summarize(r["p50_ms"] for r in lat).fmt(2, "ms") if lat else "not measured",
            summarize(r["p99_ms"] for r in lat).fmt(2, "ms") if lat else "",
            summarize(r["send_rate"] for r in lat).fmt(0, "msg/s") if lat else "",
            summarize(r["tasks_per_msg"] for r in lat).fmt(3) if lat else "",
            summarize(r["worker_cpu_us_per_msg"] for r in lat).fmt(0, "µs") if lat else "",
            summarize(r["redis_cpu_us_per_msg"] for r in lat).fmt(0, "µs") if lat else "",
            summarize(r["rabbitmq_cpu_us_per_msg"] for r in lat).fmt(0, "µs")
            if lat and "rabbitmq_cpu_us_per_msg" in lat[0] else "–",
        ])
    out += ["| Celery's broker | drain throughput | Celery tasks per drain | p50 send → handle | "
            "p99 send → handle | achieved send rate | Celery tasks per message | worker CPU per message | "
            "redis-server CPU per message | RabbitMQ CPU per message |",
            "|---|---|---|---|---|---|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in rows), ""]
    out += [f"Both rows: 2 stock workers, prefork -c {res['concurrency']}, stock settings, mqorder's store on a "
            f"redis-server of the rig's own; only `MQORDER_CELERY_BROKER_URL` differs. Drain: a "
            f"{res['messages']:,}-message backlog over 16 queues and 2,000 keys, consume batch 32, measured as in "
            f"the throughput section, on fresh workers each run. Latency: {res['rate']:,} msg/s for "
            f"{res['seconds']} s per run after 1 s of warm-up, consume batch 1. In both, the runs of the two "
            "brokers are interleaved (run i of each back to back, the order alternating). Medians of runs "
            "(min–max). CPU per message: over the latency window, divided by the messages (RabbitMQ's is its "
            "whole server's, `beam.smp`, which served only this run).", ""]
    return out

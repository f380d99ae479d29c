"""What one ``make bench`` invocation measures, and how much: sizes, pools and concurrencies.

Shared by the sections that measure (``bench.run``) and the report that describes them
(``bench.report``), so the text of the report can never name another size than the one measured.
"""

from __future__ import annotations

from bench.common import Config

SECTIONS = ("raw", "mqorder", "costs", "naive", "single_lane", "latency", "celery_broker", "produce", "failover",
            "rebalance", "memory", "growth", "retention", "spark", "spark_audit", "spark_modes", "dedup",
            "transactions", "keys", "concurrent", "durable_send", "sentinel", "cluster", "trickle_cost",
            "trickle_floor", "idle", "batching", "exporter_scrape", "groups")
DEFAULT_CONCURRENCY = 2
#: Threads-pool worker concurrency of the latency section and of the threads drain row.
LAT_THREADS_C = 8
DRAIN_THREADS_C = 4

#: Sizes: (full, quick).
SIZES = {
    "drain_messages": (200_000, 10_000),
    "naive_messages": (10_000, 1_000),
    "lane_messages": (20_000, 2_000),
    "latency_seconds": (10, 2),
    "produce_single": (5_000, 500),
    "produce_batch": (100_000, 5_000),
    "produce_raw": (100_000, 5_000),
    "dedup_messages": (5_000, 500),
    "durable_single": (5_000, 500),  # bench.durable_send: one by one, per variant and run
    "durable_batch": (100_000, 10_000),  # bench.durable_send: in batches of 10,000
    "sentinel_kills": (8, 2),  # bench.sentinel: kill -9 of the Redis primary (its drains use drain_messages)
    "cluster_messages": (500_000, 10_000),  # bench.cluster: per drain, on each of its three stores
    "transactions_messages": (5_000, 500),
    "failover_kills": (10, 2),
    "rebalance_runs": (5, 1),
    "memory_messages": (1_000_000, 20_000),
    "growth_messages": (50_000, 5_000),
    "costs_messages": (200_000, 10_000),
    "costs_profile": (50_000, 5_000),
    "spark_rows": (1_000_000, 200_000),
    "spark_one_by_one": (20_000, 5_000),
    "audit_records": (1_000_000, 100_000),
    "retention_seconds": (300, 40),
    "retention_ms": (30_000, 10_000),
    "retention_drain_messages": (1_000_000, 10_000),
    "keys_messages": (20_000, 4_000),  # per queue-order run; key order gets 5x (bench.keys)
    "concurrent_messages": (100_000, 10_000),  # per run at consume batch 32; batch 1 gets a quarter
    "trickle_cost_seconds": (5, 1),  # bench.trickle_cost: per window at 1,000 msg/s, two windows per run
    "trickle_cost_drain": (200_000, 10_000),  # bench.trickle_cost: the drain's backlog, per window
    "trickle_floor_seconds": (5, 1),  # bench.trickle_floor: per run and variant at 1,000 operations/s
    "groups_seconds": (10, 2),  # bench.groups: per run and source tree at 300 msg/s over 60 groups
    "spark_modes_rows": (200_000, 5_000),  # bench.spark_modes: rows published and counted per mode and round
    "idle_seconds": (60, 5),  # bench.idle: the measured idle window, per layout
    "idle_slow_seconds": (20, 2),  # bench.idle: the window with the SLOWLOG on (the command table)
    "idle_warmup_seconds": (40, 5),  # bench.idle: after every queue's one message was consumed
    "batching_per_thread": (1_000, 150),  # bench.batching: messages per producer thread (32), per run and variant
    "batching_paced_seconds": (5, 2),  # bench.batching: the paced window at 1,000 msg/s, per run and variant
}


def size(cfg: Config, name: str) -> int:
    full, quick = SIZES[name]
    return quick if cfg.quick else full


def concurrency(cfg: Config) -> int:
    """Worker -c of the sections after the drain: the drain's best, or the default when it did not run."""
    return cfg.best_concurrency or DEFAULT_CONCURRENCY

"""Every Prometheus metric mqorder exports: name, type, labels and meaning, in one place.

The worker endpoint (``mqorder.metrics.worker``) and the cluster exporter
(``mqorder.metrics.exporter``) build their metrics from these specs only, and
``docs/METRICS.md`` lists the same table (a test keeps the two in step). Names follow the
Prometheus conventions: the ``mqorder_`` prefix, ``_total`` on counters, base units (``_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    """One metric as it appears on the wire (``name`` includes ``_total`` for counters)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        """The name prometheus-client takes: counters without their ``_total`` suffix."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


# -- worker endpoint (MQORDER_METRICS_PORT): what this worker did ---------------------------------

CONSUMED = MetricSpec(
    "mqorder_consumed_messages_total", "counter",
    "Messages handed to a listener, by result: ok (SUCCESS or COMMIT), suspended (will be "
    "redelivered: SUSPEND, ROLLBACK, an exception or None), dlq (sent to the dead-letter topic "
    "after max_reconsume_times)",
    ("group", "topic", "result"),
)
CONSUME_DURATION = MetricSpec(
    "mqorder_consume_duration_seconds", "histogram",
    "Time of one listener call (up to consume_message_batch_max_size messages)",
    ("group", "topic"),
)
COMMITS_REFUSED = MetricSpec(
    "mqorder_commits_refused_total", "counter",
    "Fenced commits (or lease touches) refused: the run had lost its queue. reason: FENCED (a "
    "newer epoch owns it, or the lease lapsed), SUPERSEDED (the run's token was replaced), BACKWARD, "
    "AHEAD (the run read past the queue's end after a failover to a replica that missed appends)",
    ("group", "topic", "reason"),
)
RUNS = MetricSpec(
    "mqorder_consume_request_runs_total", "counter",
    "ConsumeRequest runs that reached the engine, by outcome verb (IDLE, REQUEUE, HANDOVER, "
    "DISPATCH, FENCED, STALE, BUSY; REDIS_DOWN when Redis stayed unreachable)",
    ("group", "topic", "verb"),
)
LINGERING = MetricSpec(
    "mqorder_lingering_slots", "gauge",
    "Pool slots held by a ConsumeRequest lingering on its drained queue (MQORDER_CONSUME_LINGER_MS)",
)
LOCKS_HELD = MetricSpec(
    "mqorder_locks_held", "gauge",
    "Queue locks this worker held at its last lock_all renewal (every MQORDER_LOCK_INTERVAL_MS)",
)
LOCK_TAKEOVERS = MetricSpec(
    "mqorder_lock_takeovers_total", "counter",
    "Queue locks that rebalances run by this worker moved to a new owner at once (each a new "
    "fencing epoch); summed over workers, the cluster's takeovers",
)
WAITING = MetricSpec(
    "mqorder_requests_waiting_for_slot", "gauge",
    "Requests this worker received that wait for a pool slot (prefork's capacity signal)",
)

EVENT_LOOP_LAG = MetricSpec(
    "mqorder_event_loop_lag_seconds", "gauge",
    "How late the worker process's asyncio loop (async def listeners) ran a timer in the last "
    "second: a listener blocking the loop (time.sleep, CPU work) delays every async call of the process",
)

MESSAGE_LATENCY = MetricSpec(
    "mqorder_message_latency_seconds", "histogram",
    "End-to-end latency: from a message's born time (the producer's clock) to the start of a listener "
    "call of it; observed at every call, so a retried message is observed again, later each time",
    ("group", "topic"),
)
REDELIVERIES = MetricSpec(
    "mqorder_redeliveries_total", "counter",
    "Messages this worker handed to a listener in a run that then lost its queue before committing "
    "them (its fenced commit refused: FENCED, SUPERSEDED, AHEAD): the next owner delivers them again. "
    "A worker killed outright counts nothing (docs/METRICS.md)",
    ("group", "topic"),
)
KEYS_SUSPENDED = MetricSpec(
    "mqorder_keys_suspended", "gauge",
    "Sharding keys of key-ordered listeners (ordering='key') suspended in this worker now: their last "
    "call failed and they wait for their retry",
    ("group", "topic"),
)

WORKER = (CONSUMED, CONSUME_DURATION, COMMITS_REFUSED, RUNS, LINGERING, LOCKS_HELD, LOCK_TAKEOVERS, WAITING,
          MESSAGE_LATENCY, REDELIVERIES, KEYS_SUSPENDED, EVENT_LOOP_LAG)

#: Listener calls take from a millisecond to minutes; RocketMQ's RT counters stop at seconds.
CONSUME_DURATION_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: Born-to-call latency: a few ms on a live queue, minutes to hours behind a backlog or a stuck key.
MESSAGE_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
    3600.0,
)

# -- cluster exporter (mqorder exporter): the state of every group, from Redis alone --------------

_QUEUE = ("group", "topic", "broker", "queue")

UP = MetricSpec("mqorder_up", "gauge", "1 if the exporter could read every broker at this scrape, else 0")
BROKER_UP = MetricSpec(
    "mqorder_broker_up", "gauge",
    "1 if the exporter read this broker at this scrape, else 0 (its queues' series are left out)", ("broker",)
)
SCRAPE_DURATION = MetricSpec(
    "mqorder_exporter_scrape_duration_seconds", "gauge", "Time the exporter took to read Redis for this scrape"
)
QUEUE_MAX_OFFSET = MetricSpec(
    "mqorder_queue_max_offset", "gauge",
    "Next offset to be written in the queue (RocketMQ's maxOffset): messages ever stored",
    ("topic", "broker", "queue"),
)
QUEUE_COMMITTED_OFFSET = MetricSpec(
    "mqorder_queue_committed_offset", "gauge",
    "The group's committed (fenced) consume offset on the queue", _QUEUE,
)
QUEUE_LAG = MetricSpec(
    "mqorder_queue_lag", "gauge",
    "Messages of the queue the group has not committed yet (max offset - committed offset)", _QUEUE,
)
QUEUE_EPOCH = MetricSpec(
    "mqorder_queue_epoch", "gauge",
    "Fencing epoch of the group's lock on the queue (grows by one at every change of owner)", _QUEUE,
)
QUEUE_OWNER = MetricSpec(
    "mqorder_queue_owner_info", "gauge",
    "1 for the client holding a live lock on the queue (no series while nobody holds it)",
    (*_QUEUE, "owner"),
)
QUEUE_RUNNING = MetricSpec(
    "mqorder_queue_consume_request_running", "gauge",
    "1 while a ConsumeRequest run holds the queue, else 0", _QUEUE,
)
CLIENTS_LIVE = MetricSpec(
    "mqorder_clients_live", "gauge", "Consumer clients (workers) with a live heartbeat subscribed to the group",
    ("group",),
)
DLQ_MESSAGES = MetricSpec(
    "mqorder_dlq_messages", "gauge", "Messages stored in the group's dead-letter topic (%DLQ%<group>)", ("group",),
)

QUEUE_HEAD_AGE = MetricSpec(
    "mqorder_queue_head_age_seconds", "gauge",
    "How long the group's oldest unconsumed message of the queue (the first stored offset at or above "
    "the committed one) has waited: Redis now - its store time; 0 when caught up. Time-based lag",
    _QUEUE,
)
QUEUE_STALLED = MetricSpec(
    "mqorder_queue_stalled_seconds", "gauge",
    "How long the queue has had a backlog without its committed offset moving: now - the later of the "
    "last move of the offset (commit_ms) and the head message's store time; 0 when caught up",
    _QUEUE,
)
QUEUE_HEAD_RETRIES = MetricSpec(
    "mqorder_queue_head_retries", "gauge",
    "Reconsume count of the message at the head of the queue (0 if none, or caught up)", _QUEUE,
)
QUEUE_KEYS_SUSPENDED = MetricSpec(
    "mqorder_queue_keys_suspended", "gauge",
    "Key-ordered lanes only: messages parked after a failed call, waiting for their retry (a recorded "
    "reconsume count); one per suspended key with consume_message_batch_max_size 1",
    _QUEUE,
)
QUEUE_OLDEST_UNFINISHED = MetricSpec(
    "mqorder_queue_oldest_unfinished_age_seconds", "gauge",
    "Key-ordered lanes only: age of the lowest unfinished offset (the committed offset in key mode), 0 "
    "when none is",
    _QUEUE,
)

EXPORTER = (
    UP, BROKER_UP, SCRAPE_DURATION, QUEUE_MAX_OFFSET, QUEUE_COMMITTED_OFFSET, QUEUE_LAG, QUEUE_EPOCH, QUEUE_OWNER,
    QUEUE_RUNNING, CLIENTS_LIVE, DLQ_MESSAGES, QUEUE_HEAD_AGE, QUEUE_STALLED, QUEUE_HEAD_RETRIES,
    QUEUE_KEYS_SUSPENDED, QUEUE_OLDEST_UNFINISHED,
)

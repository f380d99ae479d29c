"""Prometheus metrics: each worker's own endpoint, and one exporter for a whole cluster.

* ``mqorder.metrics.worker``: what a worker did (consumed, suspended, DLQ, call times, end-to-end
  latency, redeliveries, suspended keys, refused commits, runs by outcome, locks, lingering
  slots), served by its main process on
  ``MQORDER_METRICS_PORT`` with prometheus-client's multiprocess mode for prefork pools;
* ``mqorder.metrics.exporter``: ``mqorder exporter --port 9808``, the state of every group read
  from Redis alone (lag in messages and in time, stalled backlogs, head retries, parked keys,
  offsets, owners and epochs, live clients, DLQ depth), so one scrape target covers every worker;
  ``lane_read`` and ``exposition`` are its read and its text format;
* ``mqorder.metrics.names``: every metric's name, labels and meaning (``docs/METRICS.md``).

Nothing here imports Celery; importing this package does not import prometheus-client.
"""

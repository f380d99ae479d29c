"""Celery settings that depend on Celery's own broker: Redis or RabbitMQ.

Celery's broker carries only mqorder's tasks (``consume_request`` to one worker's direct queue,
``rebalance`` and ``lock_all`` to the default queue); messages, locks and offsets stay in Redis
whatever it is. What each broker needs:

* **Redis** (kombu's virtual transport): a fetched but unacknowledged message, such as an ETA
  task waiting out its countdown in worker memory, is redelivered after ``visibility_timeout``.
  Countdowns here are seconds (suspend-and-requeue), so an hour is far above any of them and a
  countdown task is never handed out twice. ``ack_emulation`` stays the application's choice
  (the stock workers turn it off: ``mqorder.celery.stock_config``).
* **RabbitMQ** (py-amqp): acks, redelivery and per-worker queues are the broker's own. A
  delivered but unacked message goes back to its queue when the worker's connection closes
  (warm shutdown, ``kill -9``, a dropped link), so no visibility timeout exists and none is set;
  a Redis transport option would mean nothing there. Worker-direct queues are durable queues on
  the ``C.dq2`` direct exchange, declared by the worker and again by every publish to them, so a
  ConsumeRequest sent to a worker that is still starting is kept, not dropped as unroutable.
  ETA tasks are held unacked in the worker (Celery raises the channel's prefetch for each);
  RabbitMQ closes a channel holding a delivery unacked past ``consumer_timeout`` (30 min by
  default), again far above mqorder's countdowns (at most ``suspend_current_queue_time_millis``,
  30 s). ``consume_request`` is acked when it starts (``acks_late=False``): a request that dies
  mid-run is not redelivered, it is replaced by the sweep, because its progress and its claim
  live in Redis and a redelivered copy would only be refused as stale.
"""

from __future__ import annotations

from typing import Any

from mqorder.store.brokers import celery_transport

#: Far above any countdown mqorder uses; see the module docstring.
REDIS_VISIBILITY_TIMEOUT = 3600


def transport_options(broker_url: str, app_options: dict[str, Any] | None) -> dict[str, Any]:
    """``broker_transport_options`` for ``broker_url``: mqorder's defaults for that broker kind,
    under the application's own options (which win)."""
    ours: dict[str, Any] = {}
    if celery_transport(broker_url) == "redis":
        ours["visibility_timeout"] = REDIS_VISIBILITY_TIMEOUT
    return {**ours, **(app_options or {})}

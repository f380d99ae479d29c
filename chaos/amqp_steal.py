"""Lost tasks on RabbitMQ: a competing consumer that throws ConsumeRequests away.

The Redis fault (``Faults.steal_tasks``) pops task messages off kombu's lists. On RabbitMQ the
same loss is a second consumer on every worker-direct queue that takes deliveries without acking
them back (``no_ack``) and drops them: RabbitMQ hands each message to one consumer, round robin,
so about every other ConsumeRequest published during a burst is gone for good and only the sweep
can replace it.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import amqp  # type: ignore[import-untyped]  # py-amqp, kombu's AMQP client

from mqorder.celery.dispatch import CONSUME_REQUEST
from mqorder.model import MessageQueue


def _queue_of(msg: Any, topic: str) -> int | None:
    """The queue id a ConsumeRequest delivery was for (Celery's protocol 2: the task name in the
    headers, ``[args, kwargs, embed]`` in the JSON body), if it is one of ``topic``."""
    try:
        if (msg.headers or {}).get("task") != CONSUME_REQUEST:
            return None
        mq = MessageQueue.from_key(json.loads(msg.body)[0][1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return mq.queue_id if mq.topic == topic else None


def steal(url: str, queues: list[str], burst: float, topic: str) -> tuple[int, list[tuple[float, int]]]:
    """Consume from ``queues`` for ``burst`` seconds and drop every delivery; returns how many
    were taken and, for ConsumeRequests of ``topic``, when and for which queue id."""
    u = urlsplit(url)
    conn = amqp.Connection(host=f"{u.hostname or '127.0.0.1'}:{u.port or 5672}",
                           userid=unquote(u.username or "guest"), password=unquote(u.password or "guest"),
                           virtual_host=unquote(u.path[1:]) or "/", connect_timeout=5)
    stolen = 0
    taken: list[tuple[float, int]] = []

    def drop(msg: Any) -> None:
        nonlocal stolen
        stolen += 1
        q = _queue_of(msg, topic)
        if q is not None:
            taken.append((time.time(), q))

    conn.connect()
    try:
        ch = conn.channel()
        for name in queues:
            ch.basic_consume(queue=name, callback=drop, no_ack=True)
        deadline = time.monotonic() + burst
        while time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.1)
            except TimeoutError:
                pass
    finally:
        if conn.connected:
            conn.close()
        else:
            conn.collect()
    return stolen, taken

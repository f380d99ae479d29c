"""Sending a ConsumeRequest to the worker that owns its queue.

Each worker consumes its own direct queue (``worker_direct=True``); its name comes from
``celery.utils.nodenames.worker_direct`` (``<hostname>.dq2`` today), never hard-coded. A re-queue
with a countdown is RocketMQ's ``submitConsumeRequestLater``; countdowns stay short (seconds), so
the ETA messages Celery holds in memory never approach the visibility timeout.

The task's arguments stay the engine's JSON strings ``(sub, mq_key, token)``; what monitors show
(Flower, ``celery events``, worker logs) is ``argsrepr``/``kwargsrepr`` naming the group, topic
and queue, so an operator reads ``group=billing topic=orders queue=broker-a:3`` instead of a
subscription id, and Flower's search finds ``kwargs:group=billing``. The task keeps its real
name (no ``shadow``): routing, ``inspect registered`` and Flower's per-name filter all use it.
"""

from __future__ import annotations

import logging
from functools import partial

from celery import Celery
from celery.utils.nodenames import worker_direct

from mqorder import keys
from mqorder.model import MessageQueue

log = logging.getLogger(__name__)

CONSUME_REQUEST = "mqorder.consume_request"
#: Below this a countdown is not worth an ETA round trip through the worker's timer.
MIN_COUNTDOWN = 0.05


def readable_args(sub: str, mq_key: str, token: str) -> dict[str, str]:
    """``argsrepr`` and ``kwargsrepr`` of a ConsumeRequest: who consumes what, for humans and Flower.

    ``kwargsrepr`` is a Python dict literal because Flower parses it (``ast.literal_eval``) for its
    exact ``kwargs:key=value`` search. Only display strings change; the message's args do not.
    A key that does not parse is shown as it is: a label must never stop a dispatch.
    """
    try:
        mq = MessageQueue.from_key(mq_key)
    except ValueError:
        return {"argsrepr": repr((sub, mq_key, token)), "kwargsrepr": "{}"}
    group = keys.group_of_sub(sub)
    fields: dict[str, object] = {"group": group, "topic": mq.topic, "broker": mq.broker_name, "queue": mq.queue_id}
    if sub != group:  # broadcast: one subscription per client
        fields["client"] = sub[len(group) + len(keys.BROADCAST_SEP):]
    fields["token"] = token
    return {
        "argsrepr": f"group={group} topic={mq.topic} queue={mq.broker_name}:{mq.queue_id}",
        "kwargsrepr": repr(fields),
    }


def dispatch(app: Celery, sub: str, mq_key: str, token: str, client_id: str, countdown: float = 0.0) -> bool:
    """Publish ``consume_request(sub, mq_key, token)`` to ``client_id``'s direct queue.

    Returns False if the Celery broker refused; the queue's pending token then expires
    (``pending_ttl_ms``) and the sweep dispatches again: a failed publish costs time, never a message.
    """
    options: dict[str, object] = {"queue": worker_direct(client_id), **readable_args(sub, mq_key, token)}
    if countdown >= MIN_COUNTDOWN:
        options["countdown"] = countdown
    try:
        app.send_task(CONSUME_REQUEST, args=(sub, mq_key, token), **options)
        return True
    except Exception:
        log.warning("could not dispatch ConsumeRequest %s %s to %s", sub, mq_key, client_id, exc_info=True)
        return False


def dispatcher(app: Celery) -> partial[bool]:
    """``dispatch`` bound to ``app``: the callback a ``ClientInstance`` sends ConsumeRequests with."""
    return partial(dispatch, app)

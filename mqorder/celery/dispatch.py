"""Sending a ConsumeRequest to the worker that owns its queue.

Each worker consumes its own direct queue (``worker_direct=True``); its name comes from
``celery.utils.nodenames.worker_direct`` (``<hostname>.dq2`` today), never hard-coded. A re-queue
with a countdown is RocketMQ's ``submitConsumeRequestLater``; countdowns stay short (seconds), so
the ETA messages Celery holds in memory never approach the visibility timeout.
"""

from __future__ import annotations

import logging
from functools import partial

from celery import Celery
from celery.utils.nodenames import worker_direct

log = logging.getLogger(__name__)

CONSUME_REQUEST = "mqorder.consume_request"
#: Below this a countdown is not worth an ETA round trip through the worker's timer.
MIN_COUNTDOWN = 0.05


def dispatch(app: Celery, sub: str, mq_key: str, token: str, client_id: str, countdown: float = 0.0) -> bool:
    """Publish ``consume_request(sub, mq_key, token)`` to ``client_id``'s direct queue.

    Returns False if the Celery broker refused; the queue's pending token then expires
    (``pending_ttl``) and the sweep dispatches again: a failed publish costs time, never a message.
    """
    options: dict[str, object] = {"queue": worker_direct(client_id)}
    if countdown >= MIN_COUNTDOWN:
        options["countdown"] = countdown
    try:
        app.send_task(CONSUME_REQUEST, args=(sub, mq_key, token), **options)
        return True
    except Exception:  # noqa: BLE001 - broker down: the sweep recovers
        log.warning("could not dispatch ConsumeRequest %s %s to %s", sub, mq_key, client_id, exc_info=True)
        return False


def dispatcher(app: Celery) -> partial[bool]:
    """``dispatch`` bound to ``app``: the callback a ``ClientInstance`` sends ConsumeRequests with."""
    return partial(dispatch, app)

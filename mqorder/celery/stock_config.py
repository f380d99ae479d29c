"""Celery configuration of the stock workers: ``app.config_from_object("mqorder.celery.stock_config")``.

One copy, used by the installed stock app (``celery -A mqorder.app worker``) and by the
checkout's reference app (``celery -A workers.app worker``, through ``config/celeryconfig.py``),
so the two cannot drift. ``mqorder.celery.install`` adds what the engine itself needs (JSON only,
worker direct queues, the beat schedule); this module holds the choices of the stock workers that
an application with its own Celery app may make differently.

Read at import from ``MQORDER_*`` (``mqorder.settings``): a bad value raises ``ConfigError``
naming the variable, which ``mqorder.app`` turns into a one-line error and exit status 2.
"""

from __future__ import annotations

from typing import Any

from mqorder.celery.broker import DERIVED_FROM_STORE, celery_broker
from mqorder.settings import get_settings

_settings = get_settings()
# kombu's form of the broker: a redis+sentinel:// URL becomes sentinel:// plus transport options;
# a redis+cluster:// store with no MQORDER_CELERY_BROKER_URL is refused here (ConfigError, exit 2).
_broker = celery_broker(_settings.effective_celery_broker_url, sentinel_master=_settings.celery_sentinel_master,
                        sentinel_password=_settings.sentinel_password,
                        what="MQORDER_CELERY_BROKER_URL" if _settings.celery_broker_url else DERIVED_FROM_STORE)

__all__ = [
    "accept_content",
    "broker_transport",
    "broker_transport_options",
    "broker_url",
    "broker_use_ssl",
    "result_serializer",
    "task_ignore_result",
    "task_send_sent_event",
    "task_serializer",
    "timezone",
    "worker_hijack_root_logger",
    "worker_send_task_events",
]

broker_url = _broker.url
#: kombu's Sentinel transport with demotion-aware connections for a Sentinel broker, else the URL's.
broker_transport = _broker.transport
#: TLS to the data nodes of a rediss+sentinel:// broker (kombu's Sentinel transport takes it here).
broker_use_ssl: Any = _broker.use_ssl or False
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
task_ignore_result = True
# Task events on, so Flower (``celery -A mqorder.app flower``) shows the stock workers' tasks
# without ``-E``. They cost little here: events are sent per Celery task, and a ConsumeRequest
# drains a whole batch or queue per task (8 tasks for a 20,000-message drain over 8 queues).
# ``mqorder.celery.install`` leaves both settings to the application.
worker_send_task_events = True
task_send_sent_event = True
worker_hijack_root_logger = False
timezone = "UTC"
# A ConsumeRequest lost from the broker costs one sweep, never a message (the sweep re-dispatches
# any queue with a backlog and no live request), so the stock workers need no unacked-message
# bookkeeping. Without it, a Redis restart cannot trip kombu 5.7's restore of unacked messages on
# a closed connection (AttributeError in _connparams), which made workers exit in the chaos runs.
# Redis only: ack emulation is the Redis transport's stand-in for broker acks. On RabbitMQ acks
# are the broker's own (a delivered, unacked message returns to its queue when the worker's
# connection closes), and the option would mean nothing there.
broker_transport_options: dict[str, Any] = (
    {**_broker.transport_options, "ack_emulation": False} if _settings.celery_transport == "redis" else {}
)

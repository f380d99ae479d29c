"""Celery configuration of the reference workers (``celery -A workers.app worker``).

mqorder's ``install()`` adds what the engine needs (JSON only, worker direct queues, beat
schedule); this module holds the application's own choices.
"""

from config.beat import beat_schedule
from config.settings import settings

broker_url = settings.effective_celery_broker_url
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
task_ignore_result = True
# Task events on, so Flower (``celery -A workers.app flower``) shows the stock workers' tasks
# without ``-E``. They cost little here: events are sent per Celery task, and a ConsumeRequest
# drains a whole batch or queue per task (8 tasks for a 20,000-message drain over 8 queues).
# ``mqorder.celery.install`` leaves both settings to the application.
worker_send_task_events = True
task_send_sent_event = True
worker_hijack_root_logger = False
timezone = "UTC"
beat_schedule = beat_schedule
# A ConsumeRequest lost from the broker costs one sweep, never a message (the sweep re-dispatches
# any queue with a backlog and no live request), so the stock workers need no unacked-message
# bookkeeping. Without it, a Redis restart cannot trip kombu 5.7's restore of unacked messages on
# a closed connection (AttributeError in _connparams), which made workers exit in the chaos runs.
# Redis only: ack emulation is the Redis transport's stand-in for broker acks. On RabbitMQ acks
# are the broker's own (a delivered, unacked message returns to its queue when the worker's
# connection closes), and the option would mean nothing there.
broker_transport_options = {"ack_emulation": False} if settings.celery_transport == "redis" else {}

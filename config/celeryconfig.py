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
worker_send_task_events = False
task_send_sent_event = False
worker_hijack_root_logger = False
timezone = "UTC"
beat_schedule = beat_schedule
# A ConsumeRequest lost from the broker costs one sweep, never a message (the sweep re-dispatches
# any queue with a backlog and no live request), so the stock workers need no unacked-message
# bookkeeping. Without it, a Redis restart cannot trip kombu 5.7's restore of unacked messages on
# a closed connection (AttributeError in _connparams), which made workers exit in the chaos runs.
broker_transport_options = {"ack_emulation": False}

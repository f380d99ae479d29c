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

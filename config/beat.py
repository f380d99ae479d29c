"""The beat schedule: mqorder's ``rebalance`` and ``lock_all`` every 20 s (RocketMQ's intervals)."""

from config.settings import settings
from mqorder.celery.setup import beat_schedule as _mqorder_schedule

beat_schedule = _mqorder_schedule(settings)

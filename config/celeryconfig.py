"""Celery configuration of the reference workers (``celery -A workers.app worker``).

The stock settings live once, in ``mqorder.celery.stock_config`` (the installed ``mqorder.app``
uses them too); an application adds or overrides its own choices below them. ``install()`` adds
what the engine needs, the beat schedule included (``mqorder.celery.setup.beat_schedule``).
"""

from config.settings import settings  # noqa: F401 - validates MQORDER_* first, with a clear exit
from mqorder.celery.stock_config import *  # noqa: F403

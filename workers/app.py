"""The stock mqorder workers.

Listener modules come from the reference ``tasks`` package and from ``MQORDER_LISTENERS``
(comma-separated import paths), so anyone can point these workers at their own handlers.
"""

from __future__ import annotations

import logging

from celery import Celery

import tasks  # noqa: F401 - the reference application's orderly listeners
from config.settings import settings
from mqorder.celery import install

app = Celery("workers")
app.config_from_object("config.celeryconfig")
install(app, settings)

logging.getLogger("mqorder").setLevel(logging.INFO)

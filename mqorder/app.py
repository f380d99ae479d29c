"""The stock Celery app of an installed mqorder: ``celery -A mqorder.app worker|beat|flower``.

It loads exactly the listener modules ``MQORDER_LISTENERS`` names (comma-separated import
paths), nothing else: a stock worker joins only the groups of the application it was started
for. (``mqorder demo`` runs these workers too, naming its own listener module the same way.)

A bad ``MQORDER_*`` value or a listener module that cannot be imported stops the process at
once with one line naming what was wrong and exit status 2, instead of a worker that starts and
silently consumes nothing, or a traceback inside Celery's "Unable to load celery application".
The checkout's reference app (``workers/app.py``) is the same app, written as an application
would write its own.
"""

from __future__ import annotations

import logging
import sys

from celery import Celery

from mqorder.celery import install
from mqorder.errors import ConfigError
from mqorder.settings import get_settings

try:
    app = Celery("mqorder")
    app.config_from_object("mqorder.celery.stock_config")
    install(app, get_settings())
except ConfigError as exc:
    sys.stderr.write(f"mqorder.app: {exc}\n")
    raise SystemExit(2) from None

logging.getLogger("mqorder").setLevel(logging.INFO)

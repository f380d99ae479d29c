"""The checkout's reference Celery app: ``celery -A workers.app worker|beat|flower``.

Written the way an application wires mqorder into its own Celery app: its configuration module
(``config.celeryconfig``, which takes the stock settings of ``mqorder.celery.stock_config``),
then ``install``. Listener modules come only from ``MQORDER_LISTENERS`` (comma-separated import
paths): the worker joins the groups of the modules named there and no other, so pointing it at
your own handlers never also runs the demo. The demo's listener is one such module
(``MQORDER_LISTENERS=mqorder.examples.order_lifecycle``). An installed package has the same app
as ``mqorder.app``.
"""

from __future__ import annotations

import logging
import sys

from celery import Celery

from config.settings import settings
from mqorder.celery import install
from mqorder.errors import ConfigError

app = Celery("workers")
app.config_from_object("config.celeryconfig")
try:
    install(app, settings)
except ConfigError as exc:
    # A listener module that cannot be imported: one line naming it, and the worker stops before
    # it joins any group (a traceback inside Celery's "Unable to load" would bury the cause).
    sys.stderr.write(f"workers.app: {exc}\n")
    raise SystemExit(2) from None

logging.getLogger("mqorder").setLevel(logging.INFO)

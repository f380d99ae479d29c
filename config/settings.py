"""Settings of the reference application: mqorder's ``MQORDER_*`` settings plus the demo's own.

Validated at import: a bad value stops the worker at once with a message naming the variable.
"""

from __future__ import annotations

import os
import sys

from mqorder.errors import ConfigError
from mqorder.settings import get_settings

try:
    settings = get_settings()
except ConfigError as exc:  # pragma: no cover - exercised by the CLI tests
    sys.stderr.write(f"{exc}\n")
    raise SystemExit(2) from None

#: The order-lifecycle demo's topic and group (overridable for tests and side-by-side runs).
ORDERS_TOPIC = os.environ.get("MQORDER_DEMO_TOPIC", "orders")
ORDERS_GROUP = os.environ.get("MQORDER_DEMO_GROUP", "order-lifecycle")

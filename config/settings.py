"""Settings of the reference application: mqorder's ``MQORDER_*`` settings.

Validated at import: a bad value stops the worker at once with a message naming the variable.
(The demo's topic and group are the demo listener's own: ``mqorder.examples.order_lifecycle``.)
"""

from __future__ import annotations

import sys

from mqorder.errors import ConfigError
from mqorder.settings import get_settings

try:
    settings = get_settings()
except ConfigError as exc:  # pragma: no cover - exercised by the CLI tests
    sys.stderr.write(f"{exc}\n")
    raise SystemExit(2) from None

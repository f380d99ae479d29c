"""A worker whose store is left on its default while Celery's broker was set elsewhere says so.

mqorder reads its settings from the environment (or the ``Settings`` given to ``install``), never
from a Django ``settings.py`` or a Celery configuration module. A Django walk-through put
``MQORDER_REDIS_URL`` in ``settings.py`` beside ``CELERY_BROKER_URL``: the worker took Celery's
broker from there, while mqorder's store stayed on ``redis://127.0.0.1:6379/0``, another Redis
that happened to run, and nothing said so (the worker's banner shows Celery's broker only). When
the store's URL was never set and Celery's broker is a Redis elsewhere, that is most likely the
mistake: a WARNING at the worker's start names both and the fix.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from mqorder.settings import Settings
from mqorder.store.brokers import redact_url

log = logging.getLogger("mqorder.celery")


def _where(url: str) -> tuple[str, int, str] | None:
    """(host, port, db) of a plain ``redis://`` / ``rediss://`` URL; None for anything else."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return None
    try:
        port = parts.port or 6379
    except ValueError:
        return None
    return (parts.hostname or "localhost").lower(), port, parts.path.strip("/") or "0"


def default_store_warning(settings: Settings, celery_broker_url: str | None) -> str | None:
    """The warning to log, or None: the store's URL was set, or Celery's broker is the same Redis
    (the stock setup: it follows the store), or not a plain Redis URL."""
    if "redis_url" in settings.model_fields_set or not celery_broker_url:
        return None
    store, broker = _where(settings.redis_url), _where(celery_broker_url)
    if store is None or broker is None or store == broker:
        return None
    local = {"localhost", "127.0.0.1", "::1"}
    if store[0] in local and broker[0] in local and store[1:] == broker[1:]:
        return None
    return (f"mqorder: the store is on its default {redact_url(settings.redis_url)} (MQORDER_REDIS_URL is not set) "
            f"while Celery's broker is {redact_url(celery_broker_url)}: if the store should be elsewhere, set "
            "MQORDER_REDIS_URL in the worker's environment (mqorder does not read Django's settings.py or the Celery "
            "configuration) or pass install(app, load_settings(redis_url=...))")


def warn_if_default_store(settings: Settings, celery_broker_url: str | None) -> None:
    message = default_store_warning(settings, celery_broker_url)
    if message:
        log.warning(message)

"""The transaction check-back, run once in the test's own process.

In a deployment the beat task ``mqorder.transaction_check`` asks each topic's
``@transaction_checker`` about half messages older than ``MQORDER_TRANSACTION_TIMEOUT_MS`` (6 s),
every ``MQORDER_TRANSACTION_CHECK_INTERVAL_MS`` (60 s). A test wants the pass now, in its own
process (where its checker is registered), without beat.

A half message is due ``transaction_timeout_ms`` after its prepare, as the *producer's* settings
said when it stored it (the due time is kept in Redis): a test that wants it checked at once
creates its ``TransactionProducer`` with ``transaction_timeout_ms=1``.
"""

from __future__ import annotations

from typing import Any

from mqorder.client.transaction_check import CheckReport, TransactionCheckService
from mqorder.settings import load_settings
from mqorder.store.brokers import BrokerRegistry


def check_transactions(redis_url: str | None = None, **settings: Any) -> CheckReport:
    """One check-back pass over the half messages due now, asking the ``@transaction_checker``
    functions registered in this process. ``redis_url`` defaults to ``MQORDER_REDIS_URL``; other
    keyword arguments are settings (``transaction_check_max=1`` ...). Returns what it checked,
    committed, rolled back or left UNKNOWN."""
    overrides: dict[str, Any] = dict(settings)
    if redis_url is not None:
        overrides["redis_url"] = redis_url
    s = load_settings(**overrides)
    brokers = BrokerRegistry(s.redis_url, s.brokers)
    try:
        return TransactionCheckService(brokers, s).check_once()
    finally:
        brokers.close()

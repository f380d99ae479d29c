"""The worker's start warns when mqorder's store is on its default while Celery's broker is a
Redis elsewhere (``mqorder.celery.store_check``): a Django walk-through put MQORDER_REDIS_URL in
settings.py, which mqorder does not read, and its store went to another Redis without a word."""

from __future__ import annotations

import pytest

from mqorder.celery.store_check import default_store_warning
from mqorder.settings import load_settings


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MQORDER_REDIS_URL", raising=False)
    s = load_settings()
    assert "redis_url" not in s.model_fields_set
    return s


def test_a_default_store_beside_a_broker_elsewhere_is_named(unset) -> None:
    msg = default_store_warning(unset, "redis://:secret@10.0.0.5:6380/2")
    assert msg is not None
    assert "redis://127.0.0.1:6379/0" in msg and "10.0.0.5:6380/2" in msg and "secret" not in msg
    assert "MQORDER_REDIS_URL" in msg and "settings.py" in msg


def test_no_warning_when_the_store_is_set_or_the_broker_is_the_same_redis_or_not_redis(unset) -> None:
    assert default_store_warning(load_settings(redis_url="redis://10.0.0.5:6380/2"), "redis://10.0.0.5:6380/2") is None
    assert default_store_warning(load_settings(redis_url="redis://h:1/0"), "redis://other:2/0") is None  # set: intended
    assert default_store_warning(unset, "redis://127.0.0.1:6379/0") is None  # the stock setup
    assert default_store_warning(unset, "redis://localhost:6379") is None
    assert default_store_warning(unset, "amqp://guest@rabbit//") is None
    assert default_store_warning(unset, None) is None

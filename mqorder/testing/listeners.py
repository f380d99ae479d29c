"""Registering listeners in tests: once per test, not once per process.

``@orderly_listener``/``@concurrent_listener`` register in a process-wide table, and refuse a
second, different listener for a group and topic (RocketMQ: one message listener per consumer
group) so that two modules of an application cannot silently share or steal a group. A listener
defined inside a test function is a new function at every call, so a parametrized test, or two
tests reusing a group, hit that refusal. These helpers undo a test's registrations instead of
weakening the check::

    @pytest.fixture(autouse=True)
    def _listeners():
        with isolated_listeners():
            yield
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mqorder.client.transaction_check import _checkers
from mqorder.consumer.listener import _REGISTRY, unregister_listener


def clear_listeners(group: str | None = None) -> None:
    """Forget every registered listener, or only ``group``'s (its retry subscription included)."""
    if group is None:
        _REGISTRY.clear()
        return
    for g, topic in [k for k in _REGISTRY if k[0] == group]:
        unregister_listener(g, topic)


@contextmanager
def isolated_listeners() -> Iterator[None]:
    """Listeners (and ``@transaction_checker`` functions) registered inside are forgotten on exit,
    and the ones registered before (an application module the test imported) are back exactly as
    they were."""
    saved, saved_checkers = dict(_REGISTRY), dict(_checkers)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
        _checkers.clear()
        _checkers.update(saved_checkers)

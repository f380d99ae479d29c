"""A listener defined inside a test can be registered by every test that defines it:
``mqorder.testing.isolated_listeners`` / ``clear_listeners`` undo a test's registrations, the
refusal of a second listener for a group says so, and the refusal itself still holds for apps."""

from __future__ import annotations

import pytest

from mqorder import ConsumeConcurrentlyStatus, ConsumeOrderlyStatus, concurrent_listener, orderly_listener
from mqorder.consumer.listener import ListenerError, get_listener, registered_listeners
from mqorder.testing.listeners import clear_listeners, isolated_listeners


def _define_and_register() -> None:
    """What a test body does: a new function object at every call, same name, same code."""
    @orderly_listener(topic="t-iso", group="g-iso")
    def on_order(msgs, ctx):  # type: ignore[no-untyped-def]
        return ConsumeOrderlyStatus.SUCCESS


@pytest.mark.parametrize("run", [1, 2])
def test_a_parametrized_test_registers_its_listener_each_time(run: int) -> None:
    before = {(s.group, s.topic) for s in registered_listeners()}
    with isolated_listeners():
        _define_and_register()
        assert get_listener("g-iso", "t-iso") is not None
    assert get_listener("g-iso", "t-iso") is None
    assert {(s.group, s.topic) for s in registered_listeners()} == before


def test_the_refusal_holds_and_names_the_test_helpers() -> None:
    with isolated_listeners():
        _define_and_register()
        with pytest.raises(ListenerError) as err:
            _define_and_register()  # a second listener for one group and topic: still refused
    assert "use another group name" in str(err.value)
    assert "mqorder.testing.isolated_listeners()" in str(err.value)
    assert "mqorder.testing.clear_listeners()" in str(err.value)


def test_isolated_listeners_restores_what_was_registered_before() -> None:
    with isolated_listeners():
        _define_and_register()
        app_listener = get_listener("g-iso", "t-iso")
        with isolated_listeners():
            clear_listeners()
            assert registered_listeners() == []
        assert get_listener("g-iso", "t-iso") is app_listener


def test_clear_listeners_of_one_group_takes_its_retry_subscription() -> None:
    with isolated_listeners():
        @concurrent_listener(topic="emails", group="g-mail")
        def send(msgs, ctx):  # type: ignore[no-untyped-def]
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

        _define_and_register()
        assert get_listener("g-mail", "%RETRY%g-mail") is not None
        clear_listeners("g-mail")
        assert [(s.group, s.topic) for s in registered_listeners() if s.group == "g-mail"] == []
        assert get_listener("g-iso", "t-iso") is not None  # other groups untouched


def test_isolated_listeners_forgets_a_tests_transaction_checker() -> None:
    from mqorder import LocalTransactionState, transaction_checker
    from mqorder.client.transaction_check import get_transaction_checker

    with isolated_listeners():
        @transaction_checker(topic="t-iso-txn")
        def check(msg):  # type: ignore[no-untyped-def]
            return LocalTransactionState.COMMIT

        assert get_transaction_checker("t-iso-txn") is check
    assert get_transaction_checker("t-iso-txn") is None

"""What the listener decorators and a listener's context accept, against RocketMQ's rules.

Found by a review: a suspend time set on the context was used raw (``-1``, RocketMQ's "the
consumer's default", retried in a hot loop; ``None`` raised out of the run), the decorators let a
suspend of a day through, hooks from a generator were checked and then dropped, a factory's second
listener silently replaced its first, a listener module refusing its arguments gave a traceback and
exit 1 instead of one line and exit 2, and client ids took C1 control characters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mqorder import ConsumeOrderlyStatus
from mqorder.consumer import listener as L
from mqorder.consumer.context import suspend_ms_of
from mqorder.consumer.hooks import ConsumeMessageHook
from mqorder.consumer.listener import ListenerSpec
from mqorder.errors import InvalidNameError, ListenerError
from mqorder.rebalance.lock_manager import RebalanceLockManager
from tests.engine_support import MQ

S = ConsumeOrderlyStatus


@pytest.fixture(autouse=True)
def _own_registry():
    saved = dict(L._REGISTRY)
    L._REGISTRY.clear()
    yield
    L._REGISTRY.clear()
    L._REGISTRY.update(saved)


@pytest.mark.parametrize(("value", "want"), [(-1, 1000), (None, 1000), ("5", 1000), (True, 1000), (float("nan"), 1000),
                                             (0, 10), (5, 10), (1500, 1500), (1500.7, 1500), (3_600_000, 30_000)])
def test_a_context_suspend_is_taken_as_rocketmq_takes_it(value: object, want: int) -> None:
    assert suspend_ms_of(value, 1000) == want


def test_a_suspend_that_is_not_a_number_is_logged_naming_the_listener(env, caplog: pytest.LogCaptureFixture) -> None:
    """"abc" was taken for the default without a word (a new-user walk-through); the queue mode
    run logs it, naming the listener, and still suspends the default time."""
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="A")

    def picky(msgs, ctx):
        ctx.suspend_current_queue_time_millis = "abc"
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    with caplog.at_level("WARNING", logger="mqorder.consumer.context"):
        out = eng.run(ListenerSpec(func=picky, topic="t", group="g", max_reconsume_times=5), "g", MQ, "tok0")
    assert out.countdown == pytest.approx(1.0)
    (rec,) = [r for r in caplog.records if "suspend_current_queue_time_millis" in r.getMessage()]
    assert "picky" in rec.getMessage() and "'abc'" in rec.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="mqorder.consumer.context"):
        assert suspend_ms_of(-1, 1000) == 1000  # RocketMQ's "the default": no warning
    assert not caplog.records


@pytest.mark.parametrize(("ms", "countdown"), [(-1, 1.0), (0, 0.01), (3_600_000, 30.0), (None, 1.0)])
def test_a_run_requeues_after_the_clamped_suspend(env, ms: object, countdown: float) -> None:
    """The queue mode run, on a real redis-server: its requeue countdown is the clamped suspend."""
    p, eng = env
    p.send_orderly("t", b"x", sharding_key="A")

    def listener(msgs, ctx):
        ctx.suspend_current_queue_time_millis = ms
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    out = eng.run(ListenerSpec(func=listener, topic="t", group="g", max_reconsume_times=5), "g", MQ, "tok0")
    assert out.countdown == pytest.approx(countdown)


@pytest.mark.parametrize("decorator", [L.orderly_listener, L.concurrent_listener])
def test_a_suspend_above_the_settings_bound_is_refused(decorator) -> None:
    with pytest.raises(ListenerError, match="suspend_current_queue_time_millis must be an int from 10 to 30000"):
        decorator(topic="t", group="g", suspend_current_queue_time_millis=86_400_000)


def test_hooks_from_a_generator_are_kept_and_a_lone_hook_is_refused() -> None:
    class Hook(ConsumeMessageHook):
        pass

    @L.orderly_listener(topic="t", group="g", hooks=(h for h in [Hook()]))
    def f(msgs, ctx):
        return S.SUCCESS

    assert len(L.get_listener("g", "t").hooks) == 1
    with pytest.raises(ListenerError, match="hooks must be a list of ConsumeMessageHook"):
        L.orderly_listener(topic="t2", group="g", hooks=Hook())


def test_a_factorys_second_listener_for_one_group_and_topic_is_refused() -> None:
    def make(status):
        def handle(msgs, ctx):
            return status
        return handle

    first = make(S.SUCCESS)
    L.orderly_listener(topic="t", group="g")(first)
    with pytest.raises(ListenerError, match="already has a listener for topic 't'"):
        L.orderly_listener(topic="t", group="g")(make(S.SUSPEND_CURRENT_QUEUE_A_MOMENT))
    assert L.get_listener("g", "t").func is first
    L.orderly_listener(topic="t", group="g")(first)  # the same function again: fine


def test_a_reloaded_listener_module_replaces_its_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    (tmp_path / "reloaded_listeners.py").write_text(textwrap.dedent("""
        from mqorder.consumer.listener import orderly_listener
        @orderly_listener(topic="t", group="g")
        def handle(msgs, ctx):
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("reloaded_listeners")
    try:
        importlib.reload(mod)
        assert L.get_listener("g", "t").func is mod.handle
    finally:
        sys.modules.pop("reloaded_listeners", None)


def test_a_client_id_with_a_c1_control_character_is_refused() -> None:
    from mqorder.names import check_client_id

    with pytest.raises(InvalidNameError):
        check_client_id("w1@host\x9b2J")  # CSI: clears a terminal showing `mqorder status`
    assert check_client_id("w1@hôst") == "w1@hôst"


def test_a_listener_module_refusing_its_arguments_stops_the_stock_app_in_one_line(tmp_path: Path,
                                                                                   redis_url: str) -> None:
    (tmp_path / "bad_listeners.py").write_text(textwrap.dedent("""
        from mqorder.consumer.listener import orderly_listener
        @orderly_listener(topic="t", group="g", pull_batch_size=0)
        def f(msgs, ctx):
            return None
    """))
    env = {**os.environ, "MQORDER_LISTENERS": "bad_listeners", "MQORDER_REDIS_URL": redis_url,
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    proc = subprocess.run([sys.executable, "-c", "import mqorder.app"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr[-600:]
    assert proc.stderr == ("mqorder.app: listener module 'bad_listeners' (MQORDER_LISTENERS): pull_batch_size must "
                           "be an int from 1 to 1024, got 0\n")


def test_key_mode_options_with_queue_ordering_and_a_grace_for_a_plain_function_are_refused() -> None:
    """Accepted and ignored: a user believed keys ran in parallel, or calls were cancelled."""
    with pytest.raises(ListenerError, match="key_concurrency applies to ordering='key'"):
        L.orderly_listener(topic="t", group="g", key_concurrency=8)
    with pytest.raises(ListenerError, match="consume_concurrently_max_span applies to ordering='key'"):
        L.orderly_listener(topic="t", group="g", ordering="queue", consume_concurrently_max_span=100)

    def plain(msgs, ctx):
        return S.SUCCESS

    async def coro(msgs, ctx):
        return S.SUCCESS

    for decorator in (L.orderly_listener, L.concurrent_listener):
        with pytest.raises(ListenerError, match="cancel_grace_ms applies to 'async def' listeners"):
            decorator(topic="t", group="g", cancel_grace_ms=100)(plain)
    L.orderly_listener(topic="t", group="g", cancel_grace_ms=100)(coro)
    assert L.get_listener("g", "t").cancel_grace_ms == 100


def test_cancel_grace_is_bounded_and_ordering_takes_any_case() -> None:
    """An async walk-through: cancel_grace_ms=10**12 (31 years) was taken, and ordering="KEY" refused
    where message_model="CLUSTERING" is taken."""
    from mqorder.consumer.listener import Ordering, get_listener, orderly_listener, unregister_listener

    async def f(msgs, ctx):
        return None

    with pytest.raises(ListenerError, match=r"cancel_grace_ms must be an int from 0 to 3600000, got 1000000000000"):
        orderly_listener(topic="t-case", group="g-case", cancel_grace_ms=10**12)(f)
    orderly_listener(topic="t-case", group="g-case", ordering="KEY", cancel_grace_ms=3_600_000)(f)
    try:
        spec = get_listener("g-case", "t-case")
        assert spec is not None and spec.ordering is Ordering.KEY and spec.cancel_grace_ms == 3_600_000
    finally:
        unregister_listener("g-case", "t-case")


def test_a_concurrent_clustering_listener_refuses_a_suspend_it_would_ignore() -> None:
    """A key-mode user's walk-through: accepted and ignored (retries go through %RETRY%<group>)."""
    from mqorder import concurrent_listener

    with pytest.raises(ListenerError, match=r"suspend_current_queue_time_millis applies to message_model='BROADCASTING'"):
        concurrent_listener(topic="bad", group="b", suspend_current_queue_time_millis=5000)


def test_a_listener_module_raising_at_import_stops_the_stock_app_in_one_line(tmp_path: Path, redis_url: str) -> None:
    """It gave Celery's "Unable to load celery application" and a 57-line traceback blaming
    mqorder.app, where OPERATING.md promises one line naming the module."""
    (tmp_path / "broken_listeners.py").write_text('raise RuntimeError("boom at import")\n')
    env = {**os.environ, "MQORDER_LISTENERS": "broken_listeners", "MQORDER_REDIS_URL": redis_url,
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    proc = subprocess.run([sys.executable, "-c", "import mqorder.app"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr[-600:]
    assert proc.stderr.startswith("mqorder.app: listener module 'broken_listeners' (MQORDER_LISTENERS) raised at "
                                  "import: RuntimeError: boom at import (")
    assert proc.stderr.count("\n") == 1

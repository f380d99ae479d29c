"""A listener or hook that raises something other than an ``Exception`` (``SystemExit`` from
argparse on a bad body, a ``CancelledError`` that is not the run's), against a real redis-server.

Each was a real bug (found by a read-only review, each reproduced before the fix):

* a key-mode lane thread died of a ``SystemExit``; once ``key_concurrency`` had, the next run
  waited forever for calls nobody ran (the queue stalled, the message never reached the DLQ);
* an async hook's ``CancelledError`` around a plain key-mode listener did the same;
* an async hook's own ``CancelledError`` was taken for the run's cancel: the call was settled
  as cancelled while the run went on, and the key's next message ran before it (key order broken,
  a successful message handled twice);
* an ``async def`` listener's ``SystemExit`` went out of the process's event loop.

Now each is the call's failure (``mqorder.consumer.escapes``): retried, then dead-lettered.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

from mqorder import ConsumeOrderlyStatus, keys
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.hooks import ConsumeMessageHook
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.log import MessageLog
from tests.engine_support import MQ, drain, run_in_thread
from tests.support import ROOT

S = ConsumeOrderlyStatus


def parse(body: bytes) -> int:
    """What a listener of command lines does: ``SystemExit(2)`` on a bad one."""
    pr = argparse.ArgumentParser(add_help=False)
    pr.add_argument("--count", type=int, required=True)
    return pr.parse_args(body.decode().split()).count


def parsing_listener(handled: list[int]) -> Callable:
    """A plain listener of command lines: ``SystemExit(2)`` on a bad body; the offsets it handled."""

    def listener(msgs, ctx):
        for m in msgs:
            parse(m.body)
            handled.append(m.queue_offset)
        return S.SUCCESS

    return listener


def drain_off_main(eng: ConsumerEngine, spec: ListenerSpec, runs: int = 30) -> list[Outcome]:
    """``drain`` with each run on a thread of its own that must end within 20 s (a hung run
    fails the test instead of hanging it)."""
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    token, outs = "tok0", []
    for _ in range(runs):
        out = run_in_thread(eng, spec, "g", MQ, token, timeout=20)
        assert out is not None
        outs.append(out)
        if not out.needs_dispatch or out.target != "c1":
            return outs
        threading.Event().wait(out.countdown)
        token = out.token
    raise AssertionError(f"not drained in {runs} runs: {[o.verb for o in outs]}")


def dead_offsets(eng: ConsumerEngine) -> list[int]:
    dlq = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)
    return [int(m.properties["ORIGIN_QUEUE_OFFSET"]) for m in MessageLog(eng.brokers).read(dlq, 0, 100)]


def send_bad_then_good(p, good: int) -> None:
    p.send_orderly_batch("t", [("bad", b"--count=notanint")] + [(f"k{j}", b"--count=1") for j in range(good)])


def key_spec(func: Callable, **kw) -> ListenerSpec:
    return ListenerSpec(func, "t", "g", ordering="key", max_reconsume_times=2,
                        suspend_current_queue_time_millis=10, **kw)


def test_a_plain_key_mode_listener_exiting_on_a_bad_body_dead_letters_it_and_the_lanes_live(env) -> None:
    p, eng = env
    send_bad_then_good(p, 20)
    handled: list[int] = []
    listener = parsing_listener(handled)

    # Three tries of the bad message, each ending a lane thread before the fix (2 lanes).
    drain_off_main(eng, key_spec(listener, key_concurrency=2))
    assert sorted(handled) == list(range(1, 21))
    assert dead_offsets(eng) == [0]
    assert MessageLog(eng.brokers).consume_offset("g", MQ) == 21


def test_an_async_hooks_own_cancel_around_a_plain_key_mode_listener_is_a_failing_hook(env) -> None:
    p, eng = env
    p.send_orderly_batch("t", [(f"k{j}", b"x") for j in range(10)])
    handled: list[int] = []
    cancels = {"left": 2}

    def listener(msgs, ctx):
        handled.extend(m.queue_offset for m in msgs)
        return S.SUCCESS

    class Hook(ConsumeMessageHook):
        async def consume_message_before(self, context) -> None:
            if cancels["left"]:
                cancels["left"] -= 1
                fut = asyncio.get_running_loop().create_future()
                fut.cancel()
                await fut  # a future its owner cancelled: CancelledError, not the run's

    drain_off_main(eng, key_spec(listener, key_concurrency=2, hooks=[Hook()]))
    assert cancels["left"] == 0
    assert sorted(handled) == list(range(10))  # a failing hook never changes the consume result


def test_an_async_hooks_own_cancel_after_an_async_listener_keeps_the_keys_order(env) -> None:
    p, eng = env
    seen: list[tuple[str, int]] = []
    fired = threading.Event()

    async def listener(msgs, ctx):
        seen.extend((m.body.decode().split(":")[0], m.queue_offset) for m in msgs)
        await asyncio.sleep(0.001)
        return S.SUCCESS

    class Hook(ConsumeMessageHook):
        async def consume_message_after(self, context) -> None:
            if context.msg_list[0].body.startswith(b"A:") and not fired.is_set():
                fired.set()
                p.send_orderly("t", b"A:1", sharding_key="A")  # the key's next message, pulled later
                fut = asyncio.get_running_loop().create_future()
                fut.cancel()
                await fut

    p.send_orderly("t", b"A:0", sharding_key="A")
    for i in range(5):
        p.send_orderly("t", f"B{i}:0".encode(), sharding_key=f"B{i}")
    drain(eng, key_spec(listener, key_concurrency=4, hooks=[Hook()]), max_runs=20)
    a = [off for k, off in seen if k == "A"]
    assert fired.is_set()
    # Before: [0, 6, 0]: the call was settled as cancelled, A:1 ran, then A:0 again.
    assert a == [0, 6], f"key A handled out of order or twice: {a}"


def test_an_async_key_mode_listener_exiting_on_a_bad_body_dead_letters_it(env) -> None:
    p, eng = env
    send_bad_then_good(p, 20)
    handled: list[int] = []

    async def listener(msgs, ctx):
        for m in msgs:
            parse(m.body)
            handled.append(m.queue_offset)
        return S.SUCCESS

    drain_off_main(eng, key_spec(listener, key_concurrency=4))
    assert sorted(handled) == list(range(1, 21))
    assert dead_offsets(eng) == [0]


def test_a_queue_mode_listener_exiting_on_a_bad_body_is_a_failure_on_the_main_thread_too(env) -> None:
    """A prefork child runs a queue-mode listener on its main thread: the ``SystemExit`` ended the
    child, and the next child met the same message (never dead-lettered). A plain ``SystemExit``
    is Celery's only when billiard's SIGTERM handler raised it (tested below); its
    ``WorkerShutdown`` is a subclass, and propagates."""
    p, eng = env
    send_bad_then_good(p, 3)
    handled: list[int] = []
    listener = parsing_listener(handled)

    assert threading.current_thread() is threading.main_thread()
    drain(eng, ListenerSpec(listener, "t", "g", max_reconsume_times=2, suspend_current_queue_time_millis=10))
    assert handled == [1, 2, 3]
    assert dead_offsets(eng) == [0]


def test_what_counts_as_a_calls_failure_and_what_goes_on_up() -> None:
    """A plain ``SystemExit`` is the listener's (argparse), unless billiard's SIGTERM handler raised
    it: a prefork child terminating (``revoke(terminate=True)``, a cold shutdown). Any other
    non-``Exception`` counts only on mqorder's own threads: elsewhere it is the pool's (Celery's
    ``WorkerShutdown``, a Ctrl-C, the gevent pool's hard time limit and its ``GreenletExit``)."""
    import billiard.common

    from mqorder.consumer.escapes import counts_as_failure, mark_own_thread

    class WorkerTerminate(SystemExit):
        pass

    class Timeout(BaseException):  # as gevent.Timeout
        pass

    class GreenletExit(BaseException):  # as greenlet's
        pass

    assert counts_as_failure(ValueError()) and counts_as_failure(SystemExit(2)) and counts_as_failure(SystemExit())
    assert not counts_as_failure(SystemExit(-241))  # sys.exit(-(256 - SIGTERM)) by billiard's handler
    fired = billiard.common._should_have_exited  # a one-item list, set by the handler
    fired[0] = True
    try:
        assert not counts_as_failure(SystemExit(2))
    finally:
        fired[0] = False
    others = [WorkerTerminate(1), KeyboardInterrupt(), Timeout(), GreenletExit(), GeneratorExit()]
    assert [counts_as_failure(e) for e in others] == [False] * 5

    def judged(own: bool) -> list[bool]:
        out: list[bool] = []

        def run() -> None:
            if own:
                mark_own_thread()
            out.extend(counts_as_failure(e) for e in others)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out

    assert judged(own=False) == [False] * 5  # a threads-pool task's thread, a gevent task's greenlet
    assert judged(own=True) == [True, True, True, False, False]  # a lane worker, the loop's thread


def test_a_prefork_childs_sigterm_during_a_listener_call_still_ends_it() -> None:
    """billiard's SIGTERM handler, installed in every prefork child, raises ``SystemExit(-241)``
    in the child's main thread, in the middle of a listener call: the child must exit, not count
    a reconsume and go on (a review found the first version of the rule did)."""
    code = textwrap.dedent("""
        import os, signal, sys, threading, time, types
        from billiard.common import reset_signals
        from mqorder.consumer.listener_call import ORDERLY, call_listener
        from mqorder.model import MessageQueue

        reset_signals(full=False)  # what billiard's Worker.after_fork does in each child
        spec = types.SimpleNamespace(func=lambda msgs, ctx: time.sleep(5), name="l", group="g")
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        call_listener(ORDERLY, spec, [], MessageQueue("t", "b", 0), [types.SimpleNamespace(queue_offset=7)],
                      types.SimpleNamespace(failure=""), 1, "c", "r", False)
        print("the call returned: SIGTERM swallowed")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == -241 % 256 or out.returncode == -241, (out.returncode, out.stdout, out.stderr[-500:])
    assert "swallowed" not in out.stdout

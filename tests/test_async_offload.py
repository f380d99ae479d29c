"""``ctx.still_owner_async()`` runs under whichever loop awaits it: a unit test that calls an
``async def`` listener with ``asyncio.run`` (no worker, no mqorder loop) gets its answer, off that
loop, without starting mqorder's process loop."""

from __future__ import annotations

import asyncio
import threading

from mqorder import ConsumeOrderlyContext, MessageQueue
from mqorder.consumer.async_loop import ProcessLoop


def test_still_owner_async_under_the_tests_own_loop() -> None:
    before = ProcessLoop._instance
    ran_in: list[threading.Thread] = []

    def still_owner() -> bool:
        ran_in.append(threading.current_thread())
        return True

    ctx = ConsumeOrderlyContext(MessageQueue("t", "broker-a", 0), epoch=1, client_id="c1", group="g",
                                still_owner=still_owner, suspend_current_queue_time_millis=1000)

    async def handler(msgs: list[object], ctx: ConsumeOrderlyContext) -> bool:
        return await ctx.still_owner_async()

    assert asyncio.run(handler([], ctx)) is True  # was: RuntimeError "attached to a different loop"
    assert ran_in and ran_in[0] is not threading.main_thread()  # off the loop, in its executor
    assert ProcessLoop._instance is before  # mqorder's loop (and its threads) not started for it

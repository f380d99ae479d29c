"""docs/ASYNC.md's runnable example runs as written against the test redis-server: its ``async def``
key-ordered listener handles every payment of every account in order, through the Celery-free
engine; and the example module the page tells you to run holds the same listener."""

from __future__ import annotations

import json
import re

from mqorder import Producer
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import get_listener, unregister_listener
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from tests.support import ROOT

PAGE = ROOT / "docs" / "ASYNC.md"


def _example() -> str:
    text = PAGE.read_text()
    section = text.split("## Runnable example\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under 'Runnable example' in docs/ASYNC.md"
    return match.group(1)


def test_the_page_shows_the_example_modules_listener() -> None:
    code = _example()
    listener = code[code.index("@orderly_listener"):]
    module = (ROOT / "mqorder" / "examples" / "async_orders.py").read_text()
    assert listener.strip() in module


def test_the_async_example_handles_every_payment_in_order(redis_url: str) -> None:
    ns: dict[str, object] = {}
    settings = load_settings(redis_url=redis_url, consume_linger_ms=0)
    eng = ConsumerEngine(settings, "c1")
    try:
        exec(_example(), ns)
        spec = get_listener("payments-async", "payments")
        assert spec is not None and spec.is_async
        # What ``python -m mqorder.examples.async_orders`` sends, smaller (the module is not
        # imported here: importing it would register its listener in this test process).
        p = Producer(redis_url)
        p.create_topic("payments", queues=16)
        accounts = [f"acct-{i}" for i in range(300)]
        for seq in (1, 2, 3):
            p.send_orderly_batch("payments", [(a, json.dumps({"account": a, "seq": seq}).encode()) for a in accounts])
        p.close()
        lm = RebalanceLockManager(eng.brokers)
        for q in range(16):
            mq = MessageQueue("payments", "broker-a", q)
            lm.assign("payments-async", [(mq, "c1", f"tok{q}")])
            out = eng.run(spec, "payments-async", mq, f"tok{q}")
            assert out is not None and out.verb in ("IDLE", "REQUEUE", "DISPATCH", "HANDOVER")
        applied = ns["applied"]
        assert isinstance(applied, dict)
        assert len(applied) == 300 and set(applied.values()) == {3}
        assert ns["out_of_order"] == 0
    finally:
        unregister_listener("payments-async", "payments")
        eng.brokers.close()

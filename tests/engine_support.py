"""Driving a ConsumerEngine in process, as the ``consume`` Celery task would, without Celery: the
engine tests of the concurrent and key orderings follow a queue's outcomes with ``drain``."""

from __future__ import annotations

import time

from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager

#: The queue the engine tests use: topic ``t``, queue 0.
MQ = MessageQueue("t", "broker-a", 0)


def drain(eng: ConsumerEngine, spec: ListenerSpec, mq: MessageQueue = MQ, client: str = "c1",
          token: str = "tok0", max_runs: int = 200) -> list[Outcome]:
    """Assign ``mq`` to ``client`` and follow the outcomes as the Celery task would: re-run after
    each countdown while the next request is for this client, stop when it is not or none is due."""
    RebalanceLockManager(eng.brokers).assign("g", [(mq, client, token)])
    outcomes = []
    for _ in range(max_runs):
        out = eng.run(spec, "g", mq, token)
        assert out is not None
        outcomes.append(out)
        if not out.needs_dispatch or out.target != client:
            break
        time.sleep(out.countdown)
        token = out.token
    return outcomes


def run_in_thread(eng: ConsumerEngine, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str,
                  timeout: float) -> Outcome | None:
    """``eng.run`` on a thread of its own (a listener may stop servers under it), joined within
    ``timeout``; its outcome."""
    import threading

    out: list[Outcome | None] = []
    t = threading.Thread(target=lambda: out.append(eng.run(spec, sub, mq, token)))
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the run did not end within {timeout:.0f} s"
    assert out, "the run raised (see the thread's traceback above)"
    return out[0]

"""Issue 28's stuck-key figures of ``mqorder exporter`` against a real redis-server, with the
Celery-free engine consuming in process (the e2e tests in ``test_metrics`` run the same engine in
real workers): a blocked head message makes ``head_age`` and ``stalled`` grow and shows its
reconsume count, all three go to 0 once it is released; a key-ordered lane shows its parked
messages and the age of its lowest unfinished offset."""

from __future__ import annotations

import time

from mqorder import ConsumeOrderlyStatus
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.metrics.exporter import ClusterCollector
from mqorder.model import MessageModel
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import Settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager
from tests.engine_support import MQ

S = ConsumeOrderlyStatus
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LANE = {"group": "g", "topic": "t", "broker": "broker-a", "queue": "0"}


def scrape(settings: Settings) -> Samples:
    """One scrape of the exporter's collector, as ``mqorder exporter`` serves it."""
    brokers = BrokerRegistry(settings.redis_url, settings.brokers)
    try:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in ClusterCollector(brokers, settings.heartbeat_timeout_ms).collect() for s in fam.samples}
    finally:
        brokers.close()


def lane(samples: Samples, name: str) -> float | None:
    return samples.get((name, tuple(sorted(LANE.items()))))


def runs(eng: ConsumerEngine, spec: ListenerSpec, n: int, token: str = "tok0") -> tuple[list[Outcome], str]:
    """Up to ``n`` runs of the queue, each re-dispatched as the Celery task would (no sleep: the
    suspend time is what the test waits out, or not)."""
    outs = []
    for _ in range(n):
        out = request_class(spec)(eng, spec, "g", MQ, token).run()
        outs.append(out)
        if not out.needs_dispatch or out.target != "c1":
            break
        token = out.token
    return outs, token


def test_a_blocked_head_grows_head_age_and_stalled_then_both_go_to_zero(env, settings) -> None:
    p, eng = env
    TopicManager(eng.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="order-1")
    release = {"on": False}

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 1 and not release["on"]:
            raise RuntimeError("payment service down")
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", suspend_current_queue_time_millis=10)
    caught_up = scrape(settings)
    assert lane(caught_up, "mqorder_queue_lag") == 3
    assert lane(caught_up, "mqorder_queue_head_age_seconds") >= 0  # never consumed: waits since stored

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    _, token = runs(eng, spec, 3)  # offset 0 committed, offset 1 raises three times
    first = scrape(settings)
    assert lane(first, "mqorder_queue_committed_offset") == 1
    assert lane(first, "mqorder_queue_head_retries") == 3
    age1, stalled1 = lane(first, "mqorder_queue_head_age_seconds"), lane(first, "mqorder_queue_stalled_seconds")
    assert age1 > 0 and stalled1 > 0
    assert lane(first, "mqorder_queue_keys_suspended") is None  # queue mode: no key-mode series
    time.sleep(0.3)
    later = scrape(settings)
    assert lane(later, "mqorder_queue_head_age_seconds") >= age1 + 0.25
    assert lane(later, "mqorder_queue_stalled_seconds") >= stalled1 + 0.25

    release["on"] = True
    runs(eng, spec, 5, token)
    done = scrape(settings)
    assert lane(done, "mqorder_queue_lag") == 0
    for name in ("mqorder_queue_head_age_seconds", "mqorder_queue_stalled_seconds", "mqorder_queue_head_retries"):
        assert lane(done, name) == 0, name

"""The Celery tasks: ``consume_request``, ``rebalance``, ``lock_all`` and ``sweep``.

All take JSON-serialisable arguments only (strings), ignore results, and do their real work in
the Celery-free engine; a task only carries the engine's outcome to the right worker.
"""

from __future__ import annotations

import logging
import time

import redis
from celery import shared_task

from mqorder import keys
from mqorder.celery.dispatch import CONSUME_REQUEST, dispatch
from mqorder.celery.runtime import engine_for
from mqorder.consumer.consume_request import ConsumeRequest, new_token
from mqorder.consumer.listener import get_listener
from mqorder.model import MessageQueue
from mqorder.rebalance.service import RebalanceService
from mqorder.settings import get_settings
from mqorder.store.brokers import BrokerRegistry

log = logging.getLogger(__name__)

_service: RebalanceService | None = None


def rebalance_service() -> RebalanceService:
    global _service
    if _service is None:
        s = get_settings()
        _service = RebalanceService(BrokerRegistry(s.redis_url, s.brokers), s)
    return _service


#: How long a ConsumeRequest keeps retrying through a Redis outage before leaving it to the sweep.
REDIS_RETRY_BUDGET_S = 120.0


def _run_with_redis_retry(engine, spec, sub: str, mq: MessageQueue, token: str):  # noqa: ANN001, ANN202
    """Run the request; through a Redis outage, retry in process with backoff.

    Nothing past the last fenced commit was persisted, so re-running from the committed offset
    is safe. The same ``runner`` id lets this execution re-enter its own run mark after Redis
    comes back (a duplicate delivery of the task, with another runner id, cannot). The Celery
    broker is usually the same Redis, so a ``self.retry`` publish would fail too.
    """
    runner = new_token()
    delay, waited = 0.25, 0.0
    while True:
        try:
            return ConsumeRequest(engine, spec, sub, mq, token, runner=runner).run()
        except redis.RedisError as exc:
            if waited >= REDIS_RETRY_BUDGET_S:
                log.error("ConsumeRequest %s %s: Redis unreachable for %.0fs (%s); the sweep will "
                          "re-dispatch when it is back", sub, mq.key, waited, exc)
                return None
            log.warning("ConsumeRequest %s %s: Redis error (%s); retrying in %.2fs", sub, mq.key, exc, delay)
            time.sleep(delay)
            waited += delay
            delay = min(delay * 2, 5.0)


@shared_task(name=CONSUME_REQUEST, bind=True, ignore_result=True, acks_late=False)
def consume_request(self, sub: str, mq_key: str, token: str) -> dict:  # noqa: ANN001
    """One ConsumeRequest run over one queue (see ``mqorder.consumer.consume_request``)."""
    client_id = self.request.hostname
    mq = MessageQueue.from_key(mq_key)
    spec = get_listener(keys.group_of_sub(sub), mq.topic)
    if spec is None:
        log.error(
            "worker %s has no orderly listener for group %r topic %r; import the module that "
            "defines it (MQORDER_LISTENERS) on every worker of the group",
            client_id, keys.group_of_sub(sub), mq.topic,
        )
        return {"verb": "NO_LISTENER"}
    engine = engine_for(client_id)
    outcome = _run_with_redis_retry(engine, spec, sub, mq, token)
    if outcome is None:
        return {"verb": "REDIS_DOWN"}
    if outcome.needs_dispatch:
        dispatch(self.app, sub, mq_key, outcome.token, outcome.target, outcome.countdown)
    return {"verb": outcome.verb, "consumed": outcome.consumed, "target": outcome.target}


@shared_task(name="mqorder.rebalance", bind=True, ignore_result=True)
def rebalance(self) -> dict:  # noqa: ANN001
    """Recompute the assignment of every group and apply it (beat, and on join/leave)."""
    report = rebalance_service().rebalance()
    for d in report.dispatches or []:
        dispatch(self.app, d.sub, d.mq.key, d.token, d.client)
    # A central sweep too: recovers queues whose owner's own sweep is not running.
    svc = rebalance_service()
    for d in svc.sweep(svc.all_lanes()):
        dispatch(self.app, d.sub, d.mq.key, d.token, d.client)
    return {
        "clients": report.clients,
        "dead": report.dead,
        "assigned": report.assigned,
        "moved": report.moved,
        "busy": report.busy,
        "took_ms": round(report.took_ms, 2),
    }


@shared_task(name="mqorder.lock_all", ignore_result=True)
def lock_all() -> dict:
    """Renew the leases of every live client's assigned queues (RocketMQ's 20 s ``lockAll``).

    Workers also renew their own leases from their bootstep, so leases never depend on beat alone.
    """
    return {"locked": rebalance_service().lock_all_clients()}

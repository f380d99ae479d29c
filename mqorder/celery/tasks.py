"""The Celery tasks: ``consume_request``, ``rebalance``, ``lock_all`` and ``sweep``.

All take JSON-serialisable arguments only (strings), ignore results, and do their real work in
the Celery-free engine; a task only carries the engine's outcome to the right worker.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.utils.nodenames import WORKER_DIRECT_EXCHANGE, WORKER_DIRECT_QUEUE_FORMAT
from redis import RedisError

from mqorder import keys
from mqorder.celery import beat_origin
from mqorder.celery.app_settings import settings_of
from mqorder.celery.dispatch import CONSUME_REQUEST, dispatch
from mqorder.celery.runtime import engine_for
from mqorder.client.transaction_check import TransactionCheckService
from mqorder.consumer.listener import get_listener, registered_listeners
from mqorder.errors import MQOrderError
from mqorder.metrics import worker as worker_metrics
from mqorder.model import MessageQueue
from mqorder.rebalance.service import RebalanceService
from mqorder.store.brokers import BrokerRegistry

log = logging.getLogger(__name__)

_service: RebalanceService | None = None


def rebalance_service() -> RebalanceService:
    global _service
    if _service is None:
        s = settings_of()
        _service = RebalanceService(BrokerRegistry(s.redis_url, s.brokers), s)
    return _service


_DIRECT_SUFFIX = WORKER_DIRECT_QUEUE_FORMAT.format(hostname="")


def addressee(request: Any) -> str:
    """The client a ConsumeRequest was sent to: the owner of the direct queue ``dispatch`` put it
    on (``<client>.dq2``; on AMQP the direct exchange's routing key), else ``request.hostname``.
    On a worker the two are one name; under ``celery.contrib.testing.worker.start_worker`` the
    request's hostname is the bare host name, which owned no queue, so every run handed its queue
    "to the owner" (itself) again: thousands of tasks, nothing consumed."""
    info = request.delivery_info or {}
    key = str(info.get("routing_key") or "")
    if key.endswith(_DIRECT_SUFFIX) and len(key) > len(_DIRECT_SUFFIX):
        return key[: -len(_DIRECT_SUFFIX)]
    if info.get("exchange") == WORKER_DIRECT_EXCHANGE.name and key:
        return key
    return str(request.hostname)


def _no_listener(client_id: str, group: str, topic: str) -> dict:
    """A ConsumeRequest for a (group, topic) this worker has no listener for: dropped, and why.

    The registry (``ClientRegistry``) tells the two causes apart: the rebalance gives a lane's
    queues only to clients registered for that (group, topic). When this node name is not among
    them, the request is stale (WARNING): it was queued before this worker's listener was removed
    (a retired group, a rolling deploy); its queue's pending token lapses and is dispatched again
    to whoever is assigned now. When this node name *is* registered for it while this process has
    no listener, it is a misconfiguration (ERROR): two apps or workers run under one Celery node
    name, and each reads the other's direct queue. Without an answer from Redis, a worker that
    consumes the group (other topics) logs the ERROR, any other the WARNING.
    """
    try:
        live, _, _ = rebalance_service().registry.clients()
        consumers: list[str] | None = sorted(
            c.client_id for c in live if any(s.group == group and s.topic == topic for s in c.subscriptions))
    except (RedisError, MQOrderError):
        consumers = None
    mine = any(s.group == group for s in registered_listeners())
    if consumers is None:
        stale = not mine
        others = "whether the group has other consumers is unknown (Redis did not answer)"
    else:
        stale = client_id not in consumers
        others = (f"the group's live consumers of the topic ({', '.join(consumers)}) get the queue's next request"
                  if consumers else f"the group has no live consumer of the topic: if it is retired, `mqorder group "
                  f"delete {group}` removes it")
    if stale:
        log.warning(
            "worker %s dropped a stale ConsumeRequest for group %r topic %r: this worker has no listener for it (a "
            "removed listener or a retired group; requests queued before then still arrive); %s",
            client_id, group, topic, others,
        )
        return {"verb": "STALE_REQUEST"}
    log.error(
        "worker %s has no listener for group %r topic %r, yet %s; import the module that defines it "
        "(MQORDER_LISTENERS) on every worker of the group. If this worker should not consume it, another app or "
        "worker runs under the same Celery node name and each reads the other's direct queue: give each its own "
        "name (celery worker -n NAME@%%h)",
        client_id, group, topic,
        f"node {client_id} is registered as consuming it" if consumers is not None
        else "it consumes other topics of the group (Redis did not answer to say more)",
    )
    return {"verb": "NO_LISTENER"}


@shared_task(name=CONSUME_REQUEST, bind=True, ignore_result=True, acks_late=False)
def consume_request(self, sub: str = "", mq_key: str = "", token: str = "") -> dict:
    """One ConsumeRequest run over one queue (see ``mqorder.consumer.consume_request``)."""
    client_id = addressee(self.request)
    if not (isinstance(sub, str) and sub and isinstance(mq_key, str) and mq_key and isinstance(token, str)
            and token):
        # Not one mqorder sent (a hand-made or foreign message on the worker's queue): a Python
        # traceback from deep inside said nothing of where it came from. Nothing is consumed.
        log.error("mqorder.consume_request %s got arguments %r, not (subscription, queue key, token) strings as "
                  "mqorder's own requests carry: ignored (was it sent by hand?)", self.request.id,
                  (sub, mq_key, token))
        return {"verb": "BAD_REQUEST"}
    mq = MessageQueue.from_key(mq_key)
    spec = get_listener(keys.group_of_sub(sub), mq.topic)
    if spec is None:
        return _no_listener(client_id, keys.group_of_sub(sub), mq.topic)
    engine = engine_for(client_id)
    worker_metrics.before_run(engine)
    outcome = engine.run(spec, sub, mq, token, execution=str(self.request.id or ""))
    # The queue the run ended on (a lingering run may have switched, to another group's too): its
    # keys and labels.
    if outcome is None:
        worker_metrics.after_run(sub, mq, outcome)
        return {"verb": "REDIS_DOWN"}
    last_sub = outcome.sub or sub
    worker_metrics.after_run(last_sub, outcome.queue or mq, outcome)
    if outcome.needs_dispatch:
        key = outcome.queue.key if outcome.queue is not None else mq_key
        dispatch(self.app, last_sub, key, outcome.token, outcome.target, outcome.countdown)
    for f in outcome.follow_ups:
        dispatch(self.app, f.sub or sub, f.mq.key, f.token, f.target, f.countdown)
    return {"verb": outcome.verb, "consumed": outcome.consumed, "target": outcome.target}


def _check_origin(task: Any) -> None:
    """``beat_origin.check`` of a beat task against the store it runs on (``rebalance_service``'s)."""
    beat_origin.check(task.name, task.request, rebalance_service().brokers.meta, settings_of().redis_url)


@shared_task(name="mqorder.rebalance", bind=True, ignore_result=True)
def rebalance(self) -> dict:
    """Recompute the assignment of every group and apply it (beat, and on join/leave)."""
    _check_origin(self)
    report = rebalance_service().rebalance()
    for d in report.dispatches:
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


@shared_task(name="mqorder.lock_all", bind=True, ignore_result=True)
def lock_all(self) -> dict:
    """Renew the leases of every live client's assigned queues (RocketMQ's 20 s ``lockAll``).

    Workers also renew their own leases from their bootstep, so leases never depend on beat alone.
    """
    _check_origin(self)
    return {"locked": rebalance_service().lock_all_clients()}


_txn_check: TransactionCheckService | None = None


@shared_task(name="mqorder.transaction_check", bind=True, ignore_result=True)
def transaction_check(self) -> dict:
    """The transaction check-back (beat, every ``transaction_check_interval_ms``): ask the
    ``@transaction_checker`` of each due half message's topic, commit, roll back or wait."""
    _check_origin(self)
    global _txn_check
    if _txn_check is None:
        s = settings_of()
        _txn_check = TransactionCheckService(BrokerRegistry(s.redis_url, s.brokers), s)
    report = _txn_check.check_once()
    return {"checked": report.checked, "committed": report.committed, "rolled_back": report.rolled_back,
            "unknown": report.unknown, "gave_up": report.gave_up, "failed_queues": report.failed_queues}


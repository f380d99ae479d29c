"""The worker bootstep that turns a Celery worker into an mqorder consumer client."""

from __future__ import annotations

import logging

from celery import bootsteps

from mqorder.celery import runtime
from mqorder.celery.app_settings import settings_of
from mqorder.celery.capacity import SIGNAL, CapacityPublisher
from mqorder.celery.dispatch import dispatcher
from mqorder.celery.django_fixup import install_django_fixup
from mqorder.celery.listener_modules import import_deferred
from mqorder.celery.lost_runs import LostRunWatch
from mqorder.celery.store_check import warn_if_default_store
from mqorder.client.transaction_check import transaction_checker_topics
from mqorder.consumer.client_instance import ClientInstance
from mqorder.consumer.nudge import LingerNudge
from mqorder.metrics import worker as worker_metrics
from mqorder.rebalance.membership import ClientDetails
from mqorder.store.brokers import BrokerRegistry

log = logging.getLogger(__name__)


def pool_name(pool: object) -> str:
    """Celery's name of a pool (``prefork``, ``threads``, ``solo``...), from its module
    (``celery.concurrency.prefork``): what ``-P`` takes, except ``thread`` for ``threads``."""
    name = type(pool).__module__.rsplit(".", 1)[-1]
    return "threads" if name == "thread" else name


def _say_what_it_serves(client: ClientInstance) -> None:
    """Warn about a worker that imported nothing to serve. One that defines only transaction
    checkers (TRANSACTIONS.md: the check-back runs on a worker) is set up as documented: it was
    warned, wrongly, that it had no listeners and that ``MQORDER_LISTENERS`` was not set."""
    if client.subscriptions:
        return
    checkers = transaction_checker_topics()
    if checkers:
        log.info("mqorder: worker %s has no listeners, only transaction checkers (topics %s)",
                 client.client_id, ", ".join(checkers))
    else:
        log.warning("mqorder: worker %s has no listeners and no transaction checkers; set MQORDER_LISTENERS to "
                    "the modules that define them", client.client_id)


class ConsumerClientStep(bootsteps.StartStopStep):
    """Starts the ``ClientInstance`` after the pool exists; stops it first on shutdown.

    Requiring the Pool means the client's threads start after the prefork children are forked,
    and stop (unregister, rebalance the queues away, unlock) before the pool is torn down, while
    running ConsumeRequests can still hand their queues over cleanly.
    """

    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker, **kwargs) -> None:
        super().__init__(worker, **kwargs)
        self.client: ClientInstance | None = None
        self.capacity: CapacityPublisher | None = None
        self.nudge: LingerNudge | None = None
        self.lost_runs: LostRunWatch | None = None
        # Here, not in start(): the pool forks between the two, and prefork children must inherit
        # the metrics directory and hook (mqorder.metrics.multiproc), and the listeners of the
        # modules install() deferred (they import the app, whole by now).
        import_deferred(worker.app)
        install_django_fixup()  # a Django project: its connections around every listener call
        warn_if_default_store(settings_of(worker.app), worker.app.conf.broker_url)
        worker_metrics.start(settings_of(worker.app), SIGNAL)

    def start(self, worker) -> None:
        if not worker.app.conf.worker_direct:
            # ConsumeRequests go to this worker's direct queue (<name>.dq2): without it the worker
            # took queue locks and dispatched requests to a queue it never read, consuming nothing
            # without a word (install(app) called before config_from_object, which reset it).
            log.critical("mqorder: worker %s will not consume: worker_direct is off, so it would not read the "
                         "direct queue its ConsumeRequests are sent to. Call mqorder.celery.install(app) after "
                         "the app's own configuration (config_from_object / conf.update)", worker.hostname)
            return
        s = settings_of(worker.app)
        self.nudge = LingerNudge(BrokerRegistry(s.redis_url, s.brokers), worker.hostname)
        self.capacity = runtime.enable_linger(
            worker.pool, worker.concurrency, bool(worker.app.conf.get("worker_disable_prefetch", False)),
            nudge=self.nudge,
        )
        details = ClientDetails(pool_name(worker.pool), int(worker.concurrency or 0))
        self.client = ClientInstance(worker.hostname, s, dispatcher(worker.app), details)
        _say_what_it_serves(self.client)
        self.client.start()
        self.lost_runs = LostRunWatch(self.client)

    def stop(self, worker) -> None:
        if self.lost_runs is not None:
            self.lost_runs.close()
            self.lost_runs = None
        if self.capacity is not None:
            self.capacity.stop()  # children stop lingering before the client leaves
            self.capacity = None
        if self.nudge is not None:
            self.nudge.close()
            self.nudge = None
        if self.client is not None:
            self.client.stop()
            self.client = None

    def terminate(self, worker) -> None:
        """A cold shutdown (SIGQUIT, a second Ctrl-C) calls this, not ``stop``: the client leaves
        all the same (unregister, rebalance, unlock; its pool is still up, being required). The
        base class's ``terminate`` acts only on a step's ``obj``, which this step has none of."""
        self.stop(worker)

    def shutdown(self, worker) -> None:
        self.stop(worker)

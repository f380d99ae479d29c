"""``install(app)``: wire mqorder into a Celery application."""

from __future__ import annotations

import logging

from celery import Celery
from celery.app.defaults import DEFAULTS
from celery.signals import before_task_publish

from mqorder.celery import beat_origin
from mqorder.celery.app_settings import remember
from mqorder.celery.bootsteps import ConsumerClientStep
from mqorder.celery.broker import DERIVED_FROM_STORE, celery_broker, transport_options
from mqorder.celery.listener_modules import import_listeners
from mqorder.settings import Settings, get_settings

log = logging.getLogger(__name__)


def beat_schedule(settings: Settings) -> dict[str, dict[str, object]]:
    """``rebalance`` and ``lock_all`` every 20 s (RocketMQ's rebalance and lock intervals)."""
    return {
        "mqorder-rebalance": {"task": "mqorder.rebalance", "schedule": settings.rebalance_interval_ms / 1000},
        "mqorder-lock-all": {"task": "mqorder.lock_all", "schedule": settings.lock_interval_ms / 1000},
        # RocketMQ's transaction check-back (transactionCheckInterval): resolves half messages.
        "mqorder-transaction-check": {"task": "mqorder.transaction_check",
                                      "schedule": settings.transaction_check_interval_ms / 1000},
    }


def _broker_origin(app: Celery, settings: Settings) -> str:
    """Where Celery's broker URL comes from, for an error about it."""
    if app.conf.broker_url:
        return "the Celery app's broker_url"
    return "MQORDER_CELERY_BROKER_URL" if settings.celery_broker_url else DERIVED_FROM_STORE


def _say_overrides(app: Celery, forced: dict[str, object]) -> None:
    """Log each setting of the application's own that ``install`` replaces: it was done without a
    word (a Celery user's pickle tasks were refused, their prefetch changed)."""
    for name, value in forced.items():
        had = app.conf.get(name)
        if had != value and had != DEFAULTS.get(name):
            log.warning("mqorder.celery.install: %s=%r replaces the app's %r (%s)", name, value, had,
                        "mqorder's workers accept JSON only" if "serializer" in name or name == "accept_content"
                        else "mqorder's short ConsumeRequest tasks must not wait behind prefetched ones")


def install(app: Celery, settings: Settings | None = None) -> Celery:
    """Configure ``app`` for mqorder: JSON only, direct queues, tasks, bootstep, beat schedule.

    Call it after the app's own configuration (``config_from_object``, ``conf.update``): a
    configuration loaded afterwards replaces what it set (a worker whose direct queue was switched
    off that way refuses to consume, ``bootsteps``). Add beat entries with
    ``app.conf.beat_schedule.update(...)``, not by assigning a new dict, which drops mqorder's.
    The worker's consumer, its tasks and engines use ``settings`` too (``app_settings``)."""
    settings = settings or get_settings()
    import mqorder.celery.tasks  # noqa: F401 - registers the shared tasks

    # A redis+sentinel:// URL (the store's, by default) becomes kombu's sentinel:// transport and
    # its options (mqorder.celery.broker); the application's own options win.
    # A redis+cluster:// one is refused here, at configuration, not at a worker's first fetch.
    broker = celery_broker(app.conf.broker_url or settings.effective_celery_broker_url,
                           sentinel_master=settings.celery_sentinel_master,
                           sentinel_password=settings.sentinel_password,
                           what=_broker_origin(app, settings))
    app_options = {**broker.transport_options, **(app.conf.broker_transport_options or {})}
    if broker.use_ssl and not app.conf.broker_use_ssl:
        app.conf.broker_use_ssl = broker.use_ssl
    if broker.transport and not app.conf.broker_transport:
        app.conf.broker_transport = broker.transport
    forced = {
        # JSON only: a worker that accepts pickle runs code from whoever can write to the broker.
        "task_serializer": "json", "result_serializer": "json", "accept_content": ["json"],
        "event_serializer": "json",
        # Tasks are short re-dispatching runs; prefetching many would only delay other queues.
        "worker_prefetch_multiplier": 1,
    }
    _say_overrides(app, forced)
    app.conf.update(
        broker_url=broker.url,
        worker_direct=True,
        broker_connection_retry_on_startup=True,
        # Redis transport options only on Redis (mqorder.celery.broker says what each broker needs).
        broker_transport_options=transport_options(broker.url, app_options),
        **forced,
    )
    # Not task_ignore_result=True for the whole app (it was: the application's own tasks' results
    # were dropped, `add.delay(2, 3).get()` answered None): mqorder's tasks ignore theirs each.
    schedule = dict(app.conf.beat_schedule or {})
    schedule.update(beat_schedule(settings))
    app.conf.beat_schedule = schedule
    app.steps["worker"].add(ConsumerClientStep)
    # Beat tasks carry their store's id, so a worker of another store that takes one says so.
    before_task_publish.connect(beat_origin.on_publish, weak=False, dispatch_uid="mqorder.beat_origin")
    remember(app, settings)
    import_listeners(settings.listener_modules, app)
    return app

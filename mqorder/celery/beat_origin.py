"""A worker that takes another mqorder store's beat task says so.

mqorder's beat tasks (``rebalance``, ``lock_all``, ``transaction_check``) go to Celery's default
queue. Two applications with stores of their own but one Celery broker and default queue take
each other's: application B's worker runs A's beat task against B's store, A's store misses the
run and B's gets it twice (OPERATING.md, "Several applications on one Redis"). Nothing said so.

Beat (or whatever sends one of these tasks from an application that ``install`` set up) stamps
it with its store's id (``mqorder.store.identity``, a header ``mqorder_store``); the worker that
takes it compares that id with its own store's and, when they differ, logs a WARNING naming the
fix (once per other store every ``WARN_EVERY_S``). The task still runs, as before: the warning is
the change. A task from a publisher that could not read its store's id (Redis down or not
answering: then it does not ask again for ``ID_TTL_S``, so a beat tick never waits on it twice),
or from an older mqorder, carries no stamp and is not checked.

Celery's ``before_task_publish`` does not say which application publishes: the stamp is the
current application's (``celery beat`` and ``worker -B`` make theirs current), and only when that
application was set up by ``install``; a process of several applications sending these tasks by
hand may stamp another's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import current_app

from mqorder.celery.app_settings import ATTRIBUTE, settings_of
from mqorder.settings import Settings
from mqorder.store.brokers import BrokerRegistry, redact_url
from mqorder.store.identity import store_id

log = logging.getLogger("mqorder.celery")

#: The tasks beat sends to Celery's default queue.
BEAT_TASKS = frozenset({"mqorder.rebalance", "mqorder.lock_all", "mqorder.transaction_check"})
#: The message header that names the publisher's store.
HEADER = "mqorder_store"
#: A worker warns about one other store at most this often.
WARN_EVERY_S = 600.0
#: A publisher reads its store's id again after this long (and, after a failed read, waits this
#: long before it tries again).
ID_TTL_S = 30.0

#: A publisher's meta store registry per store URL (no extra brokers: only the id is read).
_registries: dict[str, BrokerRegistry] = {}
#: Per store URL: (the id, or None after a failed read; when to read it again).
_ids: dict[str, tuple[str | None, float]] = {}
_warned: dict[str, float] = {}


def _registry(settings: Settings) -> BrokerRegistry:
    """One registry of the meta store per store URL for this process."""
    reg = _registries.get(settings.redis_url)
    if reg is None:
        reg = _registries[settings.redis_url] = BrokerRegistry(settings.redis_url, {})
    return reg


def _publisher_id(settings: Settings) -> str | None:
    """The store's id as a publisher stamps it: read at most every ``ID_TTL_S``, None for that
    long after a failed read."""
    now = time.monotonic()
    known = _ids.get(settings.redis_url)
    if known is not None and known[1] > now:
        return known[0]
    try:
        found: str | None = store_id(_registry(settings).meta) or None
    except Exception:  # the tasks go unstamped for a while; Redis being down is said elsewhere
        log.debug("mqorder: beat tasks sent without their store's id for %g s (the store did not answer)", ID_TTL_S,
                  exc_info=True)
        found = None
    _ids[settings.redis_url] = (found, now + ID_TTL_S)
    return found


def stamp(task_name: str | None, headers: dict[str, Any] | None, settings: Settings) -> None:
    """Add the publisher's store id to a beat task's ``headers`` (Celery's ``before_task_publish``)."""
    if task_name not in BEAT_TASKS or headers is None:
        return
    found = _publisher_id(settings)
    if found:
        headers[HEADER] = found


def foreign_store_warning(task_name: str, theirs: str | None, meta: redis.Redis, store_url: str) -> str | None:
    """The warning for a beat task stamped by another store than this worker's (``meta``, its
    meta broker's client, at ``store_url``), or None."""
    if not theirs:
        return None
    ours = store_id(meta)
    if theirs == ours:
        return None
    return (f"mqorder: this worker took {task_name} from another mqorder store (store id {theirs}; this worker's "
            f"store {redact_url(store_url)} has id {ours}): two applications share one Celery broker and "
            "default queue, so each runs the other's beat tasks against its own store, and the other's store misses "
            "them. Give each application its own Celery broker (MQORDER_CELERY_BROKER_URL: its own Redis database "
            "or RabbitMQ vhost) or, with install(app), its own task_default_queue; see OPERATING.md, "
            "'Several applications on one Redis'")


def check(task_name: str, request: Any, meta: redis.Redis, store_url: str) -> None:
    """Warn (rate-limited per other store) if ``request`` came from another store's publisher than
    this worker's (``meta`` at ``store_url``: the store the task runs against)."""
    theirs = request.get(HEADER) if request is not None else None
    if not theirs:
        return
    try:
        message = foreign_store_warning(task_name, str(theirs), meta, store_url)
    except Exception:  # a check only: the task itself says what is wrong with the store
        log.debug("mqorder: could not read this store's id to check %s", task_name, exc_info=True)
        return
    if message is None:
        return
    now = time.monotonic()
    if now - _warned.get(str(theirs), -WARN_EVERY_S) >= WARN_EVERY_S:
        _warned[str(theirs)] = now
        log.warning(message)


def on_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Celery's ``before_task_publish`` receiver (``install`` connects it): ``stamp`` with the
    current application's settings, if ``install`` set that application up."""
    if sender in BEAT_TASKS and isinstance(getattr(current_app, ATTRIBUTE, None), Settings):
        stamp(sender, headers, settings_of(current_app))

"""The per-process consumer engine used by the ``consume_request`` task.

Created lazily in each pool process (after fork), because kombu and redis-py connections must not
be shared across a fork.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime

from mqorder.celery.app_settings import settings_of
from mqorder.celery.capacity import (
    ACTIVE_WINDOW_S,
    SIGNAL,
    CapacityPublisher,
    WaitingRequests,
    celery_held,
    celery_spare,
)
from mqorder.consumer.engine import ConsumerEngine

log = logging.getLogger(__name__)
_lock = threading.Lock()
_engines: dict[tuple[int, str], ConsumerEngine] = {}
#: Set by the worker bootstep when tasks run in the worker's own process (threads pool).
_linger_pid: int | None = None
#: Requests waiting for a slot of this worker, with patience (``capacity.WaitingRequests``; its
#: ``slots`` is the pool size).
_waiting = WaitingRequests(1)


def enable_linger(
    pool: object, slots: int, prefetch_disabled: bool = False, nudge: Callable[[], None] | None = None,
) -> CapacityPublisher | None:
    """Let drained ConsumeRequests linger while this worker has idle pool slots (``slots``: its
    concurrency).

    Threads pool: tasks run in this process and read Celery's bookkeeping of received requests.
    Prefork: the children read it from ``capacity.SIGNAL``. Either way the returned
    ``CapacityPublisher`` (a thread of this main process; stop it on shutdown) keeps the signal
    current and calls ``nudge`` while requests wait for a slot, which ends the lingering reads at
    once (``mqorder.consumer.nudge``).
    Solo cannot receive while a task runs, so a lingering request there could keep another queue
    waiting: it never lingers. Neither does a worker with ``worker_disable_prefetch``: it stops
    fetching once every slot is busy, so requests waiting for a slot stay in the broker, where
    this worker cannot count them.
    """
    global _linger_pid, _waiting
    if prefetch_disabled:
        log.info("mqorder: worker_disable_prefetch is set; ConsumeRequests will not linger")
        return None
    module = type(pool).__module__
    if module.endswith(".thread"):
        _linger_pid = os.getpid()
    elif not module.endswith(".prefork"):
        return None
    threads = module.endswith(".thread")
    n = max(1, slots)
    _waiting = WaitingRequests(n)
    publisher = CapacityPublisher(_waiting, None if threads else SIGNAL, nudge=nudge,
                                  spare=lambda: celery_spare(n), held=celery_held)
    publisher.start()
    # A received request may be one a lingering request must give its slot back for: publish at
    # once rather than at the publisher's next (idle-rate) turn.
    global _publisher
    _publisher = publisher
    from celery.signals import task_received

    task_received.connect(_poke_publisher, weak=False, dispatch_uid="mqorder-capacity-poke")
    return publisher


#: The running ``CapacityPublisher`` of this process, poked by Celery's ``task_received``.
_publisher: CapacityPublisher | None = None


def _poke_publisher(request: object = None, **_: object) -> None:
    """Celery's ``task_received``: publish now, and for a request with an ETA keep publishing until
    a while after it (Celery applies it from its timer without a signal)."""
    if _publisher is None:
        return
    eta = getattr(request, "eta", None)
    hold = 0.0
    if isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo) if eta.tzinfo is not None else datetime.now()
        hold = max(0.0, (eta - now).total_seconds()) + ACTIVE_WINDOW_S
    _publisher.poke(hold)


def may_linger() -> bool:
    """True while no received request is waiting for a pool slot that only a lingering request
    could give, and the worker is not shutting down (a warm shutdown waits for active tasks)."""
    if _linger_pid != os.getpid():
        # A prefork child (or a pool that never lingers: the signal is then never published). Two
        # children that both linger (one began while the other's note had lapsed, in a long run)
        # settle on one: the child that is not the noted one stops.
        return SIGNAL.may_linger() and SIGNAL.lingerer() in (0, os.getpid())
    return _waiting() == 0


def may_start_linger() -> bool:
    """As ``may_linger``, for a request that has not lingered yet: it may begin only while another
    pool slot stays free for the next request (``capacity.celery_spare``), or, in a prefork child,
    while no other child of the worker lingers."""
    if _linger_pid != os.getpid():
        return SIGNAL.may_start_linger(os.getpid())
    return _waiting() == 0 and celery_spare(_waiting.slots)


def others_wait() -> bool:
    """Another received request of this worker waits for a pool slot (``capacity.WaitingRequests``):
    a run with a backlog then yields after ``consume_yield_after_ms``. A prefork child reads the
    published count (a stale one says nobody waits); the threads pool counts itself."""
    if _linger_pid != os.getpid():
        return SIGNAL.others_wait()
    return _waiting() > 0


def note_lingering(lingering: bool) -> None:
    """A prefork child's request lingers (said at every lingering read) or stopped lingering."""
    if _linger_pid != os.getpid():
        SIGNAL.note_lingerer(os.getpid(), lingering)


def engine_for(client_id: str) -> ConsumerEngine:
    key = (os.getpid(), client_id)
    eng = _engines.get(key)
    if eng is None:
        with _lock:
            eng = _engines.get(key)
            if eng is None:
                eng = ConsumerEngine(settings_of(), client_id)
                eng.may_linger = may_linger
                eng.may_start_linger = may_start_linger
                eng.others_wait = others_wait
                eng.note_lingering = note_lingering
                _engines[key] = eng
    return eng


def reset() -> None:
    with _lock:
        _engines.clear()

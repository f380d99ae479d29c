"""A ConsumeRequest whose pool process died mid-run: the worker's main process ends the run it left.

Why: a run marks its queue as running for the run lease (60 s, renewed by every commit), so that
no second request runs it at once. When the process running it dies (the OOM killer, ``kill -9``
of a prefork child, ``celery control terminate``), nothing ends the mark: the queue waited out the
lease, 60 s, while ``mqorder status`` called nothing stuck. Celery's main process learns of the
loss (``task_failure`` with ``WorkerLostError`` or a hard ``TimeLimitExceeded``, ``task_revoked``
with ``terminated``), and the run's runner id starts with the task id (``ConsumerEngine.run``), so
it can end exactly that execution's runs (``ClientInstance.abandon_runs``, ``abandon.lua``) and
sweep at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import signals
from celery.exceptions import TimeLimitExceeded

from mqorder.celery.dispatch import CONSUME_REQUEST
from mqorder.consumer.client_instance import ClientInstance

log = logging.getLogger(__name__)


def _ends_process(signum: Any) -> bool:
    """Whether Celery's terminate signal (a number or a name, ``SIGTERM`` by default) kills a pool
    process: SIGKILL, or SIGTERM (a prefork child does not handle it)."""
    if signum in (None, ""):
        return True  # Celery's default, SIGTERM
    try:
        sig = signal.Signals(int(signum)) if str(signum).isdigit() else signal.Signals[
            str(signum).upper() if str(signum).upper().startswith("SIG") else "SIG" + str(signum).upper()]
    except (KeyError, ValueError):
        return False
    return sig in (signal.SIGKILL, signal.SIGTERM)


class LostRunWatch:
    """Connected to Celery's signals while the worker's client runs (``ConsumerClientStep``)."""

    def __init__(self, client: ClientInstance) -> None:
        self.client = client
        #: The worker's main process: a prefork child forked later inherits the connection, and
        #: must not act on it (only the main process learns of a lost child).
        self.pid = os.getpid()
        self._failure: Callable[..., None] = self._on_failure
        self._revoked: Callable[..., None] = self._on_revoked
        signals.task_failure.connect(self._failure, weak=False)
        signals.task_revoked.connect(self._revoked, weak=False)

    def close(self) -> None:
        signals.task_failure.disconnect(self._failure)
        signals.task_revoked.disconnect(self._revoked)

    def _on_failure(self, sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                    **_: Any) -> None:
        # A hard time limit kills the pool process too (billiard terminates it after the limit).
        if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
            self._lost(sender, task_id)

    def _on_revoked(self, sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None,
                    **_: Any) -> None:
        # Only a signal that ends the pool process: `revoke --terminate --signal=SIGUSR1` (a soft
        # time limit) leaves it running its call, and a new run beside it would overlap its side
        # effects (its commits would be fenced, not its calls).
        if terminated and _ends_process(signum):
            self._lost(sender, getattr(request, "id", None))

    def _lost(self, sender: Any, task_id: str | None) -> None:
        if os.getpid() != self.pid or getattr(sender, "name", None) != CONSUME_REQUEST or not task_id:
            return
        # Off Celery's event loop: a few Redis round trips and maybe dispatches.
        threading.Thread(target=self._abandon, args=(task_id,), name="mqorder-lost-run", daemon=True).start()

    def _abandon(self, task_id: str) -> None:
        try:
            self.client.abandon_runs(task_id)
        except Exception:  # the run lease still ends the run, as before
            log.warning("mqorder: could not end the run of lost ConsumeRequest %s; its queue waits out its run "
                        "lease", task_id, exc_info=True)

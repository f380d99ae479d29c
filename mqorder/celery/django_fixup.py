"""Django's database connections around every listener call, as Celery's Django fixup does per task.

Why: Django's connections belong to the thread that opened them, and Django closes the stale or
obsolete ones (``close_old_connections``: ``CONN_MAX_AGE``, a connection an error left unusable)
at the start and end of each request; Celery's Django fixup does the same before and after each
task. A key-ordered or concurrent listener runs on lane threads that live as long as the process,
and a lingering ConsumeRequest runs many messages in one task, so none of that happened for them:
after the database restarted, every call on a lane raised on its dead connection until the
worker restarted (a Django walk-through: 1,700 failing calls, all 100 new messages dead-lettered,
0 rows written), and ``CONN_MAX_AGE`` was never applied.

So, when the worker runs a Django project (``DJANGO_SETTINGS_MODULE``, as Celery's fixup
decides), a global hook closes the calling thread's old connections before and after each plain
listener call. An ``async def`` listener's ORM calls run in asgiref's one thread-sensitive thread,
which the hook cannot reach from the event loop without a hand-off per call: after a failed call
it queues ``close_old_connections`` on that thread (first in line, before the retry's queries).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Callable

from mqorder.consumer.hooks import ConsumeMessageContext, ConsumeMessageHook, register_consume_message_hook

log = logging.getLogger("mqorder.celery")

_installed: DjangoConnections | None = None


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class DjangoConnections(ConsumeMessageHook):
    """``django.db.close_old_connections`` in the thread of each plain listener call, before and
    after it; after a failed ``async def`` call, on asgiref's thread-sensitive thread."""

    def __init__(self, close_old: Callable[[], None]) -> None:
        self.close_old = close_old

    def consume_message_before(self, context: ConsumeMessageContext) -> None:
        if not _on_event_loop():
            self.close_old()

    def consume_message_after(self, context: ConsumeMessageContext) -> None:
        if not _on_event_loop():
            self.close_old()
        elif not context.success:
            self._close_in_orm_thread()

    def _close_in_orm_thread(self) -> None:
        from asgiref.sync import SyncToAsync

        executor = getattr(SyncToAsync, "single_thread_executor", None)
        if executor is None:  # an asgiref without it: the retry may meet the dead connection again
            return
        executor.submit(self.close_old)


def install_django_fixup() -> DjangoConnections | None:
    """Register the hook once per process when this worker runs a Django project; None otherwise."""
    global _installed
    if _installed is not None:
        return _installed
    if not os.environ.get("DJANGO_SETTINGS_MODULE") or importlib.util.find_spec("django") is None:
        return None
    from django.db import close_old_connections  # type: ignore[import-untyped]

    _installed = DjangoConnections(close_old_connections)
    register_consume_message_hook(_installed)
    log.debug("mqorder: Django project: old database connections are closed around each listener call")
    return _installed

"""Which exceptions that are not ``Exception`` a listener or hook call counts as its failure.

``SystemExit`` (argparse or click on a bad message body), ``gevent.Timeout``, a
``KeyboardInterrupt`` raised by hand: user code raises them, and left to propagate they ended
whatever ran the call. On a key-mode lane thread that thread was gone for good, and once
``key_concurrency`` of them were, a run waited forever for calls nobody ran; on the process's
event loop thread ``asyncio`` re-raises ``SystemExit`` out of the loop, which stopped every
``async def`` listener of the process; in a prefork child the child exited, the queue's run
mark held it until the sweep, and the next child met the same message: a poison message that
never reached the DLQ. But the pools raise some of them on purpose, in the task's own thread or
greenlet, and those must go on up:

* A plain ``SystemExit`` is the call's failure (``sys.exit``, argparse), unless the process is
  terminating: billiard's SIGTERM handler in a prefork child raises ``SystemExit(-(256 -
  signum))`` in the child's main thread (``revoke(terminate=True)``, a cold shutdown, systemd
  stopping the group), and ``terminate_handler_fired()`` then says so. Celery's own
  ``WorkerShutdown`` and ``WorkerTerminate`` are subclasses, and propagate.
* Any other non-``Exception`` is the call's failure only on mqorder's own threads (key-mode lane
  workers, the process's event loop thread: ``mark_own_thread``), where nobody else raises them.
  Anywhere else it propagates: a Ctrl-C on the main thread, the gevent pool's hard time limit
  (``gevent.Timeout`` in the task's greenlet) and its terminate (``GreenletExit``).
* ``GeneratorExit`` (a coroutine closed) and ``GreenletExit`` (a greenlet killed) never are.

A failure is counted and retried like an exception, and ends in the DLQ after
``max_reconsume_times``.
"""

from __future__ import annotations

import asyncio
import sys
import threading

#: Set on mqorder's own threads (``mark_own_thread``): greenlet-local under gevent's patching.
_OWN = threading.local()


def mark_own_thread() -> None:
    """The calling thread is one of mqorder's own (a lane worker, the event loop's thread): a
    non-``Exception`` a call raises on it is that call's failure (see above)."""
    _OWN.mqorder = True


def _terminating(exc: SystemExit) -> bool:
    """Whether this ``SystemExit`` is the process terminating (billiard's signal handler), not
    the listener's own: read without importing billiard (the core imports nothing of Celery's)."""
    if isinstance(exc.code, int) and exc.code < 0:
        return True  # sys.exit(-(256 - signum)): no listener exits with a negative status
    common = sys.modules.get("billiard.common")
    if common is None:
        return False
    fired = getattr(common, "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    flag = getattr(common, "_should_have_exited", None)
    return bool(flag and flag[0])


def counts_as_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a listener or a hook, is that call's failure here (see above)."""
    if isinstance(exc, Exception):
        return True
    if type(exc) is SystemExit:
        return not _terminating(exc)
    if isinstance(exc, GeneratorExit) or type(exc).__name__ == "GreenletExit":
        return False
    return bool(getattr(_OWN, "mqorder", False))


def cancelled_by_run() -> bool:
    """Whether the ``CancelledError`` an async listener's call ended with is the run's own
    cancellation of the call's task (it lost its queue: nothing of the call is settled), not one
    the listener's code raised (it awaited a future someone else cancelled, an ``asyncio.timeout``
    of its own gone wrong): that is a listener failure like any exception, or its key would wait,
    neither finished nor retried, until the run's time budget ended. A task cancelled through
    ``Task.cancel`` counts it in ``cancelling()`` until it is uncancelled."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def goes_on_up(exc: BaseException) -> bool:
    """For the wrapper of an async call (which must report a result whatever happens): whether
    ``exc`` is re-raised (the run's own cancel, or what ``counts_as_failure`` lets through) rather
    than settled as the call's failure. A ``CancelledError`` the run did not cause is a failure:
    once it settled the call as cancelled while the run went on (a key's next message ran first)."""
    if isinstance(exc, asyncio.CancelledError):
        return cancelled_by_run()
    return not counts_as_failure(exc)

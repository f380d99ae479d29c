"""Which exceptions that are not ``Exception`` a listener or hook call counts as its failure.

``SystemExit`` (argparse or click on a bad message body), ``gevent.Timeout``, a
``KeyboardInterrupt`` raised by hand: user code raises them, and left to propagate they ended
whatever ran the call. On a key-mode lane thread that thread was gone for good, and once
``key_concurrency`` of them were, a run waited forever for calls nobody ran; on the process's
event loop thread ``asyncio`` re-raises ``SystemExit`` out of the loop, which stopped every
``async def`` listener of the process; in a prefork child the child exited, the queue's run
mark held it until the sweep, and the next child met the same message: a poison message that
never reached the DLQ.

* A plain ``SystemExit`` (``sys.exit``, argparse) is always the call's failure: Celery never
  raises one inside a task (its signal handlers set flags; its own ``WorkerShutdown`` and
  ``WorkerTerminate`` are subclasses, and propagate).
* Any other non-``Exception`` is the call's failure off the main thread, where nothing else
  raises them (signal handlers run in the main thread), and propagates on the main thread: a
  ``KeyboardInterrupt`` there is the user's Ctrl-C.
* ``GeneratorExit`` never is: it closes a coroutine.

A failure is counted and retried like an exception, and ends in the DLQ after
``max_reconsume_times``.
"""

from __future__ import annotations

import asyncio
import threading


def counts_as_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a listener or a hook, is that call's failure here (see above)."""
    if isinstance(exc, Exception) or type(exc) is SystemExit:
        return True
    return not isinstance(exc, GeneratorExit) and threading.current_thread() is not threading.main_thread()


def cancelled_by_run() -> bool:
    """Whether the ``CancelledError`` an async listener's call ended with is the run's own
    cancellation of the call's task (it lost its queue: nothing of the call is settled), not one
    the listener's code raised (it awaited a future someone else cancelled, an ``asyncio.timeout``
    of its own gone wrong): that is a listener failure like any exception, or its key would wait,
    neither finished nor retried, until the run's time budget ended. A task cancelled through
    ``Task.cancel`` counts it in ``cancelling()`` until it is uncancelled."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0

"""Child processes that end with the process that started them.

The harnesses start ``celery worker``/``beat`` in a session of their own (``start_new_session``),
so that a test can signal a worker's whole process group (its pool children too) without
signalling itself. The price: a test run killed with its process group (a CI job cancelled, a
``timeout`` expiring, SIGKILL) no longer takes them along. Orphaned, reparented to init, they kept
retrying a Redis that was gone for minutes, and held their ports and CPU under the next run.

On Linux, ``prctl(PR_SET_PDEATHSIG)`` asks the kernel to signal the child when its parent dies.
Servers get SIGTERM (a clean exit). Celery processes get SIGKILL: a run killed with its group takes
the test's Redis down at the same moment, and a worker that got SIGTERM while its consumer was in
Celery's broker-reconnect loop stayed in that loop, its warm shutdown waiting (seen in
``tests/test_launcher_lifetime.py``: 2 runs of 8 here). Its prefork children go with it
(Celery sets SIGKILL as their own death signal); a clean leave was impossible anyway, Redis gone.

Two limits of the kernel's rule, both handled by returning no hook:

* "Parent" is the **thread** that forked, not the process: a child started from a short-lived
  thread would be signalled when that thread ends, however long the test goes on. So the hook is
  only installed when the child is started from the main thread; started from any other thread,
  the child outlives its parent as before (stopping from threads is fine).
* It is Linux only; elsewhere nothing is installed.

The hook runs between ``fork`` and ``exec`` (``preexec_fn``), where only async-signal-safe work
belongs: it makes one ``prctl`` call through a function resolved beforehand, imports nothing and
takes no lock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

#: ``<linux/prctl.h>``
PR_SET_PDEATHSIG = 1


def _load_prctl() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent ``sig`` when this process dies, or None where that
    cannot be promised (not Linux, or not called from the main thread: see the module docstring)."""
    prctl = _PRCTL
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    signum = int(sig)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os._exit(1)

    return preexec

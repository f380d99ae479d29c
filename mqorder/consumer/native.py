"""Real OS threads and cross-thread hand-offs that work in a gevent-patched worker too.

``celery worker -P gevent`` monkey-patches ``threading``, ``time.sleep``, ``queue`` and
``selectors`` before mqorder is imported: a ``threading.Thread`` there is a greenlet of the hub's
thread, and a ``queue.SimpleQueue`` wakes only greenlets of that thread. The process's asyncio loop
(``async_loop``) must run in a real thread all the same (asyncio cannot run on gevent's hub), so it
starts it, sleeps and selects with the originals kept here, and hands a result back to a greenlet
through the hub's thread-safe callback (``to_caller``), never by touching a gevent primitive from
the loop's thread. Without gevent, every function here is the plain standard-library one.
"""

from __future__ import annotations

import _thread
import selectors
import sys
import time
from collections.abc import Callable
from typing import Any


def gevent_patched() -> bool:
    """Whether this process runs under gevent's monkey-patching (``-P gevent``). Read from
    ``sys.modules``: a process that never imported gevent is not patched, and mqorder does not
    import it for nothing."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))


def _original(module: str, name: str, default: Any) -> Any:
    if not gevent_patched():
        return default
    return sys.modules["gevent.monkey"].get_original(module, name)


def gevent_module() -> Any:
    """The imported ``gevent`` package (only when ``gevent_patched()``)."""
    return sys.modules["gevent"]


def start_thread(fn: Callable[[], None]) -> None:
    """Start ``fn`` in a real OS thread (a native thread under gevent, not a greenlet)."""
    _original("_thread", "start_new_thread", _thread.start_new_thread)(fn, ())


def sleep(seconds: float) -> None:
    """``time.sleep`` that blocks only the calling OS thread (gevent's would need a hub there)."""
    _original("time", "sleep", time.sleep)(seconds)


def new_selector() -> selectors.BaseSelector:
    """The platform selector for an asyncio loop in a native thread (gevent's cooperates with the
    hub of the main thread only)."""
    sel: selectors.BaseSelector = _original("selectors", "DefaultSelector", selectors.DefaultSelector)()
    return sel


def to_caller() -> Callable[[Callable[..., Any], Any], None]:
    """A function ``hand(fn, arg)`` to call from any thread that runs ``fn(arg)`` where the caller
    of ``to_caller`` can see it: under gevent in the hub's thread (``run_callback_threadsafe``:
    a greenlet waiting on a gevent queue wakes), otherwise at once (the standard queues are
    thread-safe)."""
    if not gevent_patched():
        return _direct
    hub = gevent_module().get_hub()
    run = hub.loop.run_callback_threadsafe

    def hand(fn: Callable[..., Any], arg: Any) -> None:
        run(fn, arg)

    return hand


def _direct(fn: Callable[..., Any], arg: Any) -> None:
    fn(arg)

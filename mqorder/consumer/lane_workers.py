"""Lane workers: the threads (greenlets under gevent) that run a key-ordered run's listener calls.

A key-ordered or concurrent run (``key_request``, ``concurrent_request``) hands each ready key's
head to a lane worker and settles the results in its own thread; the workers are kept per process
between runs (``LANE_POOL``), so a run starts no thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mqorder.consumer.context import CallContext
from mqorder.consumer.escapes import mark_own_thread
from mqorder.consumer.run_types import Handled
from mqorder.model import MessageExt

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LaneResult:
    """One finished listener call of one key, reported to the dispatcher."""

    key: int
    msgs: list[MessageExt]
    handled: Handled
    ctx: CallContext
    #: An async call cancelled (or never started) because its run lost the queue: its messages
    #: stay unfinished, with no reconsume counted (the next owner delivers them).
    cancelled: bool = False


class LaneWorkers:
    """``size`` daemon threads (greenlets under gevent) running the calls handed to ``submit``, in
    turn, from one queue. Cheaper per call than ``ThreadPoolExecutor``, whose futures and idle
    semaphore cost a few locks per call that nothing here needs: a call reports its own result."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.SimpleQueue()
        for i in range(size):
            threading.Thread(target=self._work, name=f"mqorder-lane-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._jobs.put((fn, args))

    def _work(self) -> None:
        mark_own_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException:
                # A SystemExit or gevent.Timeout that got here once ended this thread for good;
                # with every lane gone, a run waited forever for calls nobody ran.
                log.exception("lane worker: a call escaped its own error handling")


class LanePool:
    """Lane workers, kept per process between runs (a run borrows ``key_concurrency`` workers and
    gives them back), so a run does not start threads. Per pid: after a fork the parent's threads
    are gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._free: dict[int, list[LaneWorkers]] = {}

    def borrow(self, size: int) -> LaneWorkers:
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._free = os.getpid(), {}
            free = self._free.get(size)
            if free:
                return free.pop()
        return LaneWorkers(size)

    def give_back(self, pool: LaneWorkers) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._free.setdefault(pool.size, []).append(pool)


LANE_POOL = LanePool()

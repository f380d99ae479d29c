"""``LeaseKeeper``: renews a run's lease while its plain listener call runs on the run's thread.

Why: in queue mode a run calls a plain (``def``) listener on its own thread, and nothing renewed
the run's mark (``run``, ``run_lease_ms``: 60 s) or its lock lease until the call returned. A
call longer than the run lease let the mark lapse under it: the sweep dispatched a second
ConsumeRequest, which ran the same message *beside* the first call under a new epoch, and the
first call's commit was refused, round after round, so the queue never moved (a configuration
walk-through: 20 calls of offsets 0 and 1, 7 of them overlapping, nothing committed). Key and
concurrent runs, and queue runs of ``async def`` listeners, wait for their calls on a dispatcher
that renews the lease meanwhile; this gives the plain queue-mode call the same.

RocketMQ keeps a queue through a long call the same way (``lockAll`` renews the broker lock while
its ConsumeRequest runs), and BullMQ extends a job's lock on a timer while its processor runs. A
process that dies renews nothing, so failover after a crash is unchanged; a call that hangs for
good holds its queue for good, as in RocketMQ, and is logged (a WARNING once it has run longer
than the run lease, naming the listener and the queue).

One daemon thread per process, started at the first call (again in a forked child), wakes every
sixth of the shortest lease it keeps and renews each call at its first tick, then whenever it has
gone a third of its lease without a renewal (``touch.lua``: fenced by owner, epoch and token; a
lapsed lease is never renewed). So a mark is renewed at least every half lease while the call runs. Registering a call
is two dict operations and wakes nothing: a trickling message pays no thread wake-up for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("mqorder.consumer")

#: The keeper's wake-up interval, as a fraction of the shortest lease it keeps.
TICK_FRACTION = 1 / 6
#: A call is renewed once this fraction of its lease has gone by since the last renewal.
RENEW_FRACTION = 1 / 3


class KeptCall:
    """A listener call in flight whose run's lease the keeper renews. Slots, no dataclass: one is
    made per plain queue-mode call, on the trickle path."""

    __slots__ = ("renew", "lease_s", "describe", "started", "renewed", "warned", "lost")

    def __init__(self, renew: Callable[[], bool], lease_s: float, describe: Callable[[], str]) -> None:
        #: The run's fenced ``touch.lua`` (renewing): True while the run still holds its queue.
        self.renew = renew
        self.lease_s = lease_s
        #: What the WARNING names (the listener and its queue), built only when it is logged.
        self.describe = describe
        self.started = time.monotonic()
        # Due at the keeper's first tick: the run mark was last renewed before the call, up to a
        # client lock expiry earlier, not when the call began.
        self.renewed = self.started - lease_s
        self.warned = False
        self.lost = False


class LeaseKeeper:
    """The process's keeper of leases for calls in flight (``keeper()``)."""

    def __init__(self) -> None:
        self._calls: dict[int, KeptCall] = {}
        self._ids = iter(range(1, 1 << 62))
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._start_lock = threading.Lock()
        self._tick_s = 1.0

    def keep(self, renew: Callable[[], bool], lease_ms: int, describe: Callable[[], str]) -> int:
        """Keep the lease of a call that starts now; the handle to ``release`` when it returns."""
        lease_s = lease_ms / 1000
        tick = lease_s * TICK_FRACTION
        if tick < self._tick_s:
            self._tick_s = tick
        if self._pid != os.getpid():
            self._start()
        handle = next(self._ids)
        self._calls[handle] = KeptCall(renew, lease_s, describe)
        return handle

    def release(self, handle: int) -> KeptCall | None:
        """The call returned: stop renewing its lease."""
        return self._calls.pop(handle, None)

    def _start(self) -> None:
        with self._start_lock:
            if self._pid == os.getpid():
                return
            # In a forked child the parent's thread does not exist, nor do its calls.
            self._calls.clear()
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._loop, name="mqorder-lease-keeper", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self._tick_s)
            try:
                self.renew_due(time.monotonic())
            except Exception:  # a bug here must not end every later renewal (logged with its traceback)
                log.exception("mqorder: the lease keeper's pass failed; going on")

    def renew_due(self, now: float) -> None:
        """Renew every call that has gone a third of its lease without a renewal."""
        for call in list(self._calls.values()):
            if call.lost or now - call.renewed < call.lease_s * RENEW_FRACTION:
                continue
            if not call.warned and now - call.started > call.lease_s:
                call.warned = True
                log.warning("mqorder: listener call %s has run for %.1f s, longer than the run lease "
                            "(MQORDER_RUN_LEASE_MS, %.1f s); its lease is being renewed while it runs, so the "
                            "queue waits for it", call.describe(), now - call.started, call.lease_s)
            try:
                held = call.renew()
            except Exception as exc:  # noqa: BLE001 - a Redis error or worse: the thread must live on
                log.info("mqorder: could not renew the lease of listener call %s (%s); trying again", call.describe(),
                         exc)
                continue
            if held:
                call.renewed = now
            else:
                # Lost (revoked, or a lapsed lease re-granted): the run's next fenced call is
                # refused, and nothing of this call will be committed.
                call.lost = True
                log.info("mqorder: listener call %s lost its queue while running; its result will not be "
                         "committed", call.describe())


_KEEPER = LeaseKeeper()


def keeper() -> LeaseKeeper:
    """The process's ``LeaseKeeper``."""
    return _KEEPER

"""``LingerNudge``: wakes this client's lingering ConsumeRequests when a request waits for a slot.

A drained request lingers in a blocking ``XREAD`` over its queues (``ConsumeRequest._linger``) and
gives its pool slot back as soon as another request of its worker waits for one. It used to find
out by waking every 10 ms to ask, which on a worker with a slot per queue meant a hundred round
trips per second per idle slot: most of a worker's CPU at a steady trickle, and on 2 cores the CPU
the messages themselves then waited for. Instead each lingering read also watches this client's
nudge stream (``keys.linger_nudge``) and blocks for a long slice; the worker's main process, which
sees the requests it received (``mqorder.celery.capacity``), appends to that stream while one
waits, which ends every lingering read of the client at once.
"""

from __future__ import annotations

import logging
import time

import redis

from mqorder import keys
from mqorder.store.brokers import BrokerRegistry

log = logging.getLogger(__name__)

#: While requests keep waiting, nudge again at most this often (a read that started between a
#: nudge and its check sees the next one).
NUDGE_EVERY_S = 0.02
#: About how many entries a nudge stream keeps: only the newest id matters.
NUDGE_MAX_LEN = 16


class LingerNudge:
    """Appends to ``keys.linger_nudge(client_id)`` on every broker: "a request waits for a slot"."""

    def __init__(self, brokers: BrokerRegistry, client_id: str) -> None:
        self.brokers = brokers
        self.key = keys.linger_nudge(client_id)
        self._last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last < NUDGE_EVERY_S:
            return
        self._last = now
        for name in self.brokers.names:
            try:
                self.brokers.get(name).client.xadd(self.key, {"w": 1}, maxlen=NUDGE_MAX_LEN, approximate=True)
            except redis.RedisError as exc:
                # Lingering reads then end at their slice: slower to hand a slot over, never stuck.
                log.debug("mqorder: could not nudge lingering requests on %s: %s", name, exc)

    def close(self) -> None:
        self.brokers.close()

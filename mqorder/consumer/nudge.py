"""``LingerNudge``: wakes this client's lingering ConsumeRequests when a request waits for a slot.

A drained request lingers in a blocking ``XREAD`` over its queues (``ConsumeRequest._linger``) and
gives its pool slot back once another request of its worker has waited for one a little while
(``capacity.YIELD_AFTER_S``). It used to find
out by waking every 10 ms to ask, which on a worker with a slot per queue meant a hundred round
trips per second per idle slot: most of a worker's CPU at a steady trickle, and on 2 cores the CPU
the messages themselves then waited for. Instead each lingering read also watches this client's
nudge stream (``keys.linger_nudge``) and blocks for a long slice; the worker's main process, which
sees the requests it received (``mqorder.celery.capacity``), appends to that stream while one
waits, which ends every lingering read of the client at once.

A send to an idle queue that a lingering request adopted rings the same stream (an ``m`` entry
naming the queue's state key: ``read_nudges``): the read returns and the request runs that queue.

The same stream says "queue X of subscription S just went idle" (an entry with ``s`` and ``q``
fields, ``idle_entry``): a run that ends without lingering (its worker's slots are busy, or another
request lingers already) leaves its queue idle and un-watched, so the producer's next message there
would wake the worker and cost a new Celery task, whose run would end the same way, and so on: at
stock prefork -c 2,
1 to 2 % of the messages took that path in the latency bench, in bursts. A lingering read that
sees the entry adopts the queue at once (``IdleQueueWatch.adopt_soon``) rather than at its next
full refresh, up to ``ADOPT_REFRESH_S`` later.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from mqorder import keys
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.replies import text

log = logging.getLogger(__name__)

#: While requests keep waiting, nudge again at most this often (a read that started between a
#: nudge and its check sees the next one).
NUDGE_EVERY_S = 0.02
#: About how many entries a nudge stream keeps, every writer's cap alike: a lingering read takes
#: its doorbells from it (``ring_doorbell`` in ``_append.lua`` keeps the same 128), so a smaller
#: cap of another writer could trim doorbells not read yet.
NUDGE_MAX_LEN = 128
#: Field of a "request waiting" entry and of a "queue went idle" one (its value: the queue's key,
#: after a ``SUB_FIELD`` naming the queue's subscription), and of a doorbell (its value: the state
#: key of an adopted queue a send just reached, ``ring_doorbell`` in ``_append.lua``).
WAITING_FIELD, IDLE_FIELD, SUB_FIELD, DOORBELL_FIELD = b"w", b"q", b"s", b"m"


def idle_entry(client_id: str, went_idle: list[tuple[str, str]]) -> tuple[Any, ...]:
    """The ``XADD`` that tells ``client_id``'s lingering reads these (subscription, queue key) went idle."""
    fields: list[str] = []
    for sub, k in went_idle:
        fields += ["s", sub, "q", k]
    return ("XADD", keys.linger_nudge(client_id), "MAXLEN", "~", NUDGE_MAX_LEN, "*", *fields)


def read_nudges(entries: list[Any]) -> tuple[list[tuple[str, str]], list[str]]:
    """What a batch of nudges (raw XREAD entries of the nudge stream) says, in one pass: the
    (subscription, queue key) its "queue went idle" entries name, and the state keys its doorbells
    name, in order. A lingering read takes both from every batch it reads, at a trickle once per
    message (nearly every entry a doorbell: two fields, looked at once). A queue named without its
    subscription (an entry of a version before groups were watched together, read after a
    restart) is skipped: the next full refresh finds it."""
    idle: list[tuple[str, str]] = []
    bells: list[str] = []
    for _id, fields in entries:
        if len(fields) == 2 and fields[0] == DOORBELL_FIELD:
            bells.append(text(fields[1]))
            continue
        sub = None
        for i in range(0, len(fields) - 1, 2):
            name = fields[i]
            if name == SUB_FIELD:
                sub = text(fields[i + 1])
            elif name == IDLE_FIELD and sub is not None:
                idle.append((sub, text(fields[i + 1])))
    return idle, bells


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

"""A per-queue script call that must be findable first: record the queue (or its topic) in an
index on the default broker, then run the script, in one round trip when they share a Redis.

The transaction check-back and the delay mover find their work through such an index
(``keys.txn_topics``, ``keys.delay_queues``): a half or delayed message stored before its index
entry could be missed for good. Sent in one pipeline on one connection, the ``SADD`` still runs
before the script, and a repeated ``SADD`` changes nothing, so the call may be retried whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from mqorder.store.brokers import Broker, BrokerRegistry


def run_indexed(
    brokers: BrokerRegistry, index_key: str, member: str, broker: Broker, script: str,
    keys: Sequence[Any], args: Sequence[Any],
) -> Any:
    """``SADD index_key member`` on the default broker, then script ``script`` on ``broker``."""
    if broker is not brokers.default:
        brokers.meta.sadd(index_key, member)
        return getattr(broker.scripts, script)(keys=keys, args=args)
    for attempt in (0, 1):
        pipe = broker.client.pipeline(transaction=False)
        pipe.sadd(index_key, member)
        broker.scripts.queue_in(pipe, script, keys, args)
        try:
            return pipe.execute()[1]
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
            broker.scripts.load(script)
    raise AssertionError("unreachable")  # pragma: no cover

"""The demo's listener. Order lifecycle: created -> paid -> shipped -> delivered, strictly in that
order per order.

Loaded only by workers started with ``MQORDER_LISTENERS=mqorder.examples.order_lifecycle`` (what
``mqorder demo`` and the compose ``demo`` profile's instructions do): importing this module
registers the group, and a worker that joined it would consume every message of the topic. The
topic and group are this module's own settings, ``MQORDER_DEMO_TOPIC`` (default ``orders``) and
``MQORDER_DEMO_GROUP`` (default ``order-lifecycle``), so side-by-side runs and tests can keep apart.

Each event is JSON ``{"order": id, "seq": 1..4, "event": name, "ts": send time}``; all events of
one order share the sharding key (the order id), so they land in one queue. The listener keeps
each order's last applied step in Redis (``demo:{<group>}:*`` keys, written by nothing else) and
records, instead of applying:

* a *duplicate* (a step already applied: redelivery after a failover) — skipped, counted;
* an *illegal transition* (a step arriving before its predecessor) — recorded with its order id.

Ordered delivery means the demo ends with zero illegal transitions. The two lists are capped
(``LATENCY_CAP``, ``ILLEGAL_CAP``) so repeated runs against one Redis cannot grow them without
bound; the counts in the ``counts`` hash stay exact.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from mqorder import ConsumeOrderlyStatus, orderly_listener
from mqorder.examples.demo_keys import demo_prefix
from mqorder.settings import get_settings
from mqorder.store.connect import connect

#: The demo's topic and group (overridable for tests and side-by-side runs).
ORDERS_TOPIC = os.environ.get("MQORDER_DEMO_TOPIC", "orders")
ORDERS_GROUP = os.environ.get("MQORDER_DEMO_GROUP", "order-lifecycle")

STEPS = ("created", "paid", "shipped", "delivered")

PREFIX = demo_prefix(ORDERS_GROUP)
STATE = f"{PREFIX}:state"  # HASH order -> last step (1..4)
COUNTS = f"{PREFIX}:counts"  # HASH handled / duplicates / illegal / bad
ILLEGAL = f"{PREFIX}:illegal"  # LIST of "order:got:expected", the latest ILLEGAL_CAP
LATENCY = f"{PREFIX}:latency_ms"  # LIST of produce-to-handle latencies, the latest LATENCY_CAP
#: The latest latencies kept: all of a default ``mqorder demo`` run (8,000 events) many times over.
LATENCY_CAP = 1_000_000
#: The latest illegal transitions kept (any at all already fails the demo).
ILLEGAL_CAP = 10_000

# Applies one event atomically: check the transition and record the outcome in one step.
# KEYS: STATE, COUNTS, ILLEGAL, LATENCY; ARGV: order id, seq, latency ms, LATENCY_CAP, ILLEGAL_CAP.
APPLY = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or 0)
local seq = tonumber(ARGV[2])
if seq <= last then redis.call('HINCRBY', KEYS[2], 'duplicates', 1) return 'duplicate' end
redis.call('HINCRBY', KEYS[2], 'handled', 1)
redis.call('RPUSH', KEYS[4], ARGV[3])
redis.call('LTRIM', KEYS[4], -tonumber(ARGV[4]), -1)
if seq ~= last + 1 then
  redis.call('HINCRBY', KEYS[2], 'illegal', 1)
  redis.call('RPUSH', KEYS[3], ARGV[1] .. ':' .. seq .. ':' .. (last + 1))
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[5]), -1)
end
redis.call('HSET', KEYS[1], ARGV[1], seq)
return 'ok'
"""

_client: redis.Redis | None = None
_apply: Any = None


def _script() -> tuple[redis.Redis, Any]:
    """The Redis client and the registered APPLY script, made on first use in the pool process
    (not at import, so importing the module needs no Redis and no settings)."""
    global _client, _apply
    if _client is None or _apply is None:
        _client = connect(get_settings().redis_url)
        _apply = _client.register_script(APPLY)
    return _client, _apply


@orderly_listener(topic=ORDERS_TOPIC, group=ORDERS_GROUP)
def on_order_event(msgs: list[Any], ctx: Any) -> ConsumeOrderlyStatus:
    client, apply = _script()
    for m in msgs:
        try:
            event = json.loads(m.body)
            order, seq = str(event["order"]), int(event["seq"])
        except (ValueError, KeyError, TypeError):
            # Not an order event: count it and move on (the message is kept in the log).
            client.hincrby(COUNTS, "bad", 1)
            continue
        latency = time.time() * 1000 - float(event.get("ts", m.born_timestamp))
        apply(keys=[STATE, COUNTS, ILLEGAL, LATENCY], args=[order, seq, f"{latency:.3f}", LATENCY_CAP, ILLEGAL_CAP])
    return ConsumeOrderlyStatus.SUCCESS

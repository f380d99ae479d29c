"""Order lifecycle: created -> paid -> shipped -> delivered, strictly in that order per order.

Each event is JSON ``{"order": id, "seq": 1..4, "event": name, "ts": send time}``; all events of
one order share the sharding key (the order id), so they land in one queue. The listener keeps
each order's last applied step in Redis and records, instead of applying:

* a *duplicate* (a step already applied: redelivery after a failover) — skipped, counted;
* an *illegal transition* (a step arriving before its predecessor) — recorded with its order id.

Ordered delivery means the demo ends with zero illegal transitions.
"""

from __future__ import annotations

import json
import time

import redis

from config.settings import ORDERS_GROUP, ORDERS_TOPIC, settings
from mqorder import ConsumeOrderlyStatus, orderly_listener

STEPS = ("created", "paid", "shipped", "delivered")
PREFIX = f"demo:{ORDERS_GROUP}"
STATE = f"{PREFIX}:state"  # HASH order -> last step (1..4)
COUNTS = f"{PREFIX}:counts"  # HASH handled / duplicates / illegal / bad
ILLEGAL = f"{PREFIX}:illegal"  # LIST of "order:got:expected"
LATENCY = f"{PREFIX}:latency_ms"  # LIST of produce-to-handle latencies

# Applies one event atomically: check the transition and record the outcome in one step.
APPLY = """
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or 0)
local seq = tonumber(ARGV[2])
if seq <= last then redis.call('HINCRBY', KEYS[2], 'duplicates', 1) return 'duplicate' end
redis.call('HINCRBY', KEYS[2], 'handled', 1)
redis.call('RPUSH', KEYS[4], ARGV[3])
if seq ~= last + 1 then
  redis.call('HINCRBY', KEYS[2], 'illegal', 1)
  redis.call('RPUSH', KEYS[3], ARGV[1] .. ':' .. seq .. ':' .. (last + 1))
end
redis.call('HSET', KEYS[1], ARGV[1], seq)
return 'ok'
"""

_client: redis.Redis | None = None
_apply = None


def _script():
    global _client, _apply
    if _apply is None:
        _client = redis.Redis.from_url(settings.redis_url)
        _apply = _client.register_script(APPLY)
    return _apply


@orderly_listener(topic=ORDERS_TOPIC, group=ORDERS_GROUP)
def on_order_event(msgs, ctx):
    apply = _script()
    for m in msgs:
        try:
            event = json.loads(m.body)
            order, seq = str(event["order"]), int(event["seq"])
        except (ValueError, KeyError, TypeError):
            # Not an order event: count it and move on (the message is kept in the log).
            _client.hincrby(COUNTS, "bad", 1)  # type: ignore[union-attr]
            continue
        latency = time.time() * 1000 - float(event.get("ts", m.born_timestamp))
        apply(keys=[STATE, COUNTS, ILLEGAL, LATENCY], args=[order, seq, f"{latency:.3f}"])
    return ConsumeOrderlyStatus.SUCCESS

"""A user's listener module, as an application would write one (``MQORDER_LISTENERS=tests.user_listeners``).

One group on topic ``orders``: the very topic the README's first example and the demo listener
use, so a stock worker that also loaded the demo would join ``order-lifecycle`` on it as well.
Every message's body goes to the Redis list ``user:<group>:seen``, in the order handled.
"""

from __future__ import annotations

import os

import redis

from mqorder import ConsumeOrderlyStatus, orderly_listener

TOPIC = "orders"
GROUP = "user-billing"
SEEN = f"user:{GROUP}:seen"

_r: redis.Redis | None = None


def _redis() -> redis.Redis:
    """One client per pool process (a forked child must not share its parent's sockets)."""
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["MQORDER_REDIS_URL"])
    return _r


@orderly_listener(topic=TOPIC, group=GROUP)
def on_order(msgs, ctx) -> ConsumeOrderlyStatus:
    _redis().rpush(SEEN, *[m.body for m in msgs])
    return ConsumeOrderlyStatus.SUCCESS

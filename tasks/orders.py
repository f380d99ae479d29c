"""The demo's order-lifecycle listener, for the checkout: ``MQORDER_LISTENERS=tasks.orders``.

It lives in the package (``mqorder.examples.order_lifecycle``) so that ``mqorder demo`` works
from an installed mqorder; this module re-exports it under the reference app's layout. Either
name loads the same listener once (one module object registers the group).
"""

from mqorder.examples.order_lifecycle import (
    COUNTS,
    ILLEGAL,
    LATENCY,
    ORDERS_GROUP,
    ORDERS_TOPIC,
    STATE,
    STEPS,
    on_order_event,
)

__all__ = ["COUNTS", "ILLEGAL", "LATENCY", "ORDERS_GROUP", "ORDERS_TOPIC", "STATE", "STEPS", "on_order_event"]

"""The checkout's reference listener modules (name one in ``MQORDER_LISTENERS`` to load it).

Importing this package loads no listener: a stock worker runs only what ``MQORDER_LISTENERS``
names. ``tasks.orders`` is the demo's order-lifecycle listener, which lives in the package as
``mqorder.examples.order_lifecycle``.
"""

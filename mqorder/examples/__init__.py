"""Example listeners that ship with mqorder, loaded only when a worker names them.

Nothing imports these modules by itself: a worker runs one only if ``MQORDER_LISTENERS`` names
it (``mqorder demo`` does, for ``order_lifecycle``), so a stock worker started for an
application never joins an example's group.
"""

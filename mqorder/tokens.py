"""Random tokens: dispatch tokens of ConsumeRequests, runner and run ids, mutex values.

A token only has to be unique; it never carries meaning, so every layer (producer, rebalance,
consumer) takes it from here rather than from another layer's module.
"""

from __future__ import annotations

import uuid


def new_token() -> str:
    return uuid.uuid4().hex

"""Where the demo listener keeps its state in Redis, shared by the listener and the demo's driver."""

from __future__ import annotations


def demo_prefix(group: str) -> str:
    """The prefix of a group's demo keys: ``demo:{<group>}``, the group a hash tag so that on a
    Redis Cluster the four keys the listener's script writes share a slot (without it every call
    failed CROSSSLOT and every queue of the demo suspended for good)."""
    return f"demo:{{{group}}}"

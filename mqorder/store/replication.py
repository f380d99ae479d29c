"""``ReplicaWait``: how many replicas must hold a new lock epoch before anybody acts under it.

Redis replicates asynchronously: a lock grant acknowledged by the primary may be missing on the
replica that a failover promotes. The epoch fence (``grant_epoch`` in ``_lock.lua``) keeps such a
lost grant harmless for correctness: no later grant can repeat its epoch, and the lost holder's
commits are refused. What it cannot do is stop the lost holder and the new one from *both* calling
listeners for a while, each under its own epoch. ``WAIT`` closes most of that window: a run
calls no listener under an epoch until ``n`` replicas acknowledged it, and Sentinel promotes the
replica with the most data, so an acknowledged grant survives a failover (unless the replicas that
have it are lost too; the fence still holds then).

``WAIT`` cannot run inside a Lua script; it is sent after the script, on the same connection, and
counts replicas that acknowledged everything written before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mqorder.settings import Settings
from mqorder.store.brokers import Broker
from mqorder.store.urls import is_sentinel_url


class ReplicaWait:
    """The replicas to wait for on each broker, and the ``WAIT`` itself."""

    def __init__(self, replicas: int | None, timeout_ms: int) -> None:
        #: ``None``: decided per broker (1 behind Sentinel, 0 on a plain Redis).
        self.replicas = replicas
        self.timeout_ms = timeout_ms

    @classmethod
    def from_settings(cls, settings: Settings) -> ReplicaWait:
        return cls(settings.lock_wait_replicas, settings.lock_wait_timeout_ms)

    def wanted(self, broker: Broker, tag: str | None = None) -> int:
        """Replicas to wait for on ``broker``: the setting, else 1 behind Sentinel (a Sentinel set
        exists to fail over to a replica), else 0 (a standalone Redis has none). On a Redis
        Cluster, 1 where the primary serving ``tag`` (a queue's hash tag) has a replica in the slot
        map, the one the cluster would promote; 0 on a shard without replicas, whose WAIT could
        never be satisfied."""
        if self.replicas is not None:
            return self.replicas
        if broker.is_cluster:
            return min(1, broker.replicas_of(tag)) if tag is not None else 0
        return 1 if is_sentinel_url(broker.url) else 0

    def wait(self, execute: Callable[[tuple[Any, ...]], Any], n: int) -> int:
        """``WAIT n timeout`` through ``execute`` (one command on the connection that wrote the
        grant); the number of replicas that acknowledged."""
        return int(execute(("WAIT", n, self.timeout_ms)))

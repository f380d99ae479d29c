"""Capacity guards: a Redis that may evict keys is refused, and a full one refuses sends clearly.

Why both matter more here than in RocketMQ: the broker is Redis memory, not disk.

* **Eviction is silent data loss.** Under any ``maxmemory-policy`` but ``noeviction``, Redis
  deletes keys to make room: a queue's stream (acknowledged messages gone), a lock hash (two
  owners at once) or an offset (a queue consumed again from 0). So workers and producers refuse
  such a Redis at start with ``EvictionPolicyError``, unless ``MQORDER_ALLOW_EVICTION=1``.
  The policy is read with ``CONFIG GET``; where ``CONFIG`` is disabled (managed Redis) from
  ``INFO memory``; when neither answers, a warning says it cannot be known.
* **A full broker answers producers, not with an OOM half way through a batch.** Past
  ``MQORDER_MAX_MEMORY_RATIO`` (0.75, RocketMQ's ``diskMaxUsedSpaceRatio``) of ``maxmemory``,
  sends are refused with ``BrokerFullError`` before anything is written. The reading is cached
  for about a second, so the check costs one ``INFO memory`` per second per process, not a round
  trip per send. Consumption (fenced commits, DLQ moves) and trimming are not guarded: they are
  what drains the broker.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from mqorder.errors import BrokerFullError, EvictionPolicyError
from mqorder.store.brokers import Broker

log = logging.getLogger(__name__)

#: How long a memory reading is trusted before the next send reads it again.
MEMORY_TTL_S = 1.0
#: The only policy under which Redis never deletes a key to make room.
SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class MemoryReading:
    """Redis's own memory figures (``INFO memory``)."""

    used: int
    maxmemory: int  # 0: no limit
    policy: str  # '' when it could not be read

    @property
    def ratio(self) -> float | None:
        """Used share of ``maxmemory``; None without a limit."""
        return self.used / self.maxmemory if self.maxmemory else None


def _mib(n: int) -> str:
    return f"{n / 1048576:,.1f} MiB"


def primaries(client: Any) -> list[Any]:
    """The plain client of each primary of a Redis Cluster (redis-py sends ``INFO`` and ``CONFIG
    GET`` of a ``RedisCluster`` to one node only: a non-default shard with an evicting policy passed
    the check, and a full one never refused a send), or ``[client]`` for any other Redis."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def read_memory(client: redis.Redis) -> MemoryReading:
    """The reading of ``client``'s Redis; on a cluster, of its fullest primary (by the share of its
    ``maxmemory``, else by bytes used): the shard a send may be refused by."""
    readings = [_read_memory(c) for c in primaries(client)]
    return max(readings, key=lambda r: (r.ratio if r.ratio is not None else -1.0, r.used))


def _read_memory(client: redis.Redis) -> MemoryReading:
    info = client.info("memory")
    return MemoryReading(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)),
                         str(info.get("maxmemory_policy", "")))


def eviction_policy(client: redis.Redis) -> tuple[str, str]:
    """(policy, how it was read: ``CONFIG``, ``INFO`` or ``''`` when it cannot be known). On a
    cluster, the first primary whose policy is not ``noeviction`` decides (else any's)."""
    found = [_eviction_policy(c) for c in primaries(client)]
    unsafe = [f for f in found if f[1] and f[0] != SAFE_POLICY]
    if unsafe:
        return unsafe[0]
    if any(not f[1] for f in found):
        return ("", "")
    return found[0]


def _eviction_policy(client: redis.Redis) -> tuple[str, str]:
    try:
        reply = client.config_get("maxmemory-policy")
        policy = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
        if policy:
            return str(policy), "CONFIG"
    except redis.ResponseError:
        pass  # CONFIG disabled or renamed (managed Redis): INFO still says it
    try:
        policy = _read_memory(client).policy
    except redis.ResponseError:
        policy = ""
    return (policy, "INFO") if policy else ("", "")


def check_eviction_policy(broker: Broker, *, allow: bool) -> str:
    """Refuse a broker whose policy may evict keys (``EvictionPolicyError``); returns the policy.

    Raises ``redis.RedisError`` when the broker does not answer (the caller decides when to
    check again)."""
    policy, source = eviction_policy(broker.client)
    if not source:
        log.warning(
            "cannot read maxmemory-policy of Redis broker %r at %s (CONFIG and INFO refused): make sure it "
            "is noeviction, or an evicted stream or lock is silent data loss", broker.name, broker.safe_url,
        )
        return ""
    if policy != SAFE_POLICY:
        if allow:
            log.warning("Redis broker %r at %s has maxmemory-policy %s: keys may be evicted (allowed by "
                        "MQORDER_ALLOW_EVICTION)", broker.name, broker.safe_url, policy)
            return policy
        raise EvictionPolicyError(
            f"Redis broker {broker.name!r} at {broker.safe_url} has maxmemory-policy {policy} (read with "
            f"{source}): it may evict a queue's stream or a lock hash, which is silent data loss. Set "
            "`maxmemory-policy noeviction` in that Redis (CONFIG SET maxmemory-policy noeviction, and in "
            "redis.conf), or set MQORDER_ALLOW_EVICTION=1 for a throwaway setup"
        )
    return policy


class CapacityGuard:
    """What a producer (or the Spark writer) asks before each send: is this broker safe and not full?

    The eviction policy is checked on first use of each broker (a producer may be built before
    Redis is up), then again whenever the memory reading, refreshed at most every
    ``MEMORY_TTL_S``, shows another policy than ``noeviction``.
    """

    def __init__(self, *, allow_eviction: bool, max_memory_ratio: float) -> None:
        self.allow_eviction = allow_eviction
        self.max_memory_ratio = max_memory_ratio
        self._lock = threading.Lock()
        self._policy_ok: set[str] = set()
        self._memory: dict[str, tuple[float, MemoryReading]] = {}

    def before_send(self, broker: Broker, action: str = "send") -> None:
        """``EvictionPolicyError`` or ``BrokerFullError`` (nothing stored yet); Redis errors pass
        through for the caller's usual translation."""
        if broker.name not in self._policy_ok:
            check_eviction_policy(broker, allow=self.allow_eviction)
            with self._lock:
                self._policy_ok.add(broker.name)
        reading = self.memory(broker)
        if reading.policy and reading.policy != SAFE_POLICY and not self.allow_eviction:
            # Set after the first check (a managed Redis's parameter change, a restart from a
            # redis.conf that never got noeviction): sends went on into an evicting Redis.
            with self._lock:
                self._policy_ok.discard(broker.name)
            check_eviction_policy(broker, allow=False)
        ratio = reading.ratio
        if ratio is not None and ratio >= self.max_memory_ratio:
            raise BrokerFullError(
                f"{action} refused: Redis broker {broker.name!r} at {broker.safe_url} uses {ratio:.0%} of its "
                f"maxmemory ({_mib(reading.used)} of {_mib(reading.maxmemory)}), at or over "
                f"MQORDER_MAX_MEMORY_RATIO={self.max_memory_ratio}; nothing was stored. Retention frees "
                "what consumers committed (and, with the time policy, what is old), unless Redis is past its "
                "maxmemory for them too (`used_memory` over `maxmemory` refuses their commits: free memory "
                "first): retry later, raise maxmemory, or shorten the topics' retention (`mqorder topic "
                "retention`)"
            )

    def memory(self, broker: Broker) -> MemoryReading:
        now = time.monotonic()
        hit = self._memory.get(broker.name)
        if hit is not None and now - hit[0] < MEMORY_TTL_S:
            return hit[1]
        reading = read_memory(broker.client)
        with self._lock:
            self._memory[broker.name] = (now, reading)
        return reading

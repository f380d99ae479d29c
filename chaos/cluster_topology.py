"""The store under test as a Redis Cluster: the ``cluster-*`` scenarios' topology.

``masters`` masters (3) and ``replicas_per_master`` replicas of each
(``mqorder.testing.cluster.ClusterDeployment``), each node with AOF on at the scenario's
``appendfsync``. Workers, beat, traffic and the evidence reach the store through its
``redis+cluster://`` URL, so each of them follows a migrated slot (``MOVED``/``ASK``) and a
promoted replica by itself. Celery's broker cannot be a cluster (kombu has no cluster transport,
and mqorder refuses it): it is the ledger's plain Redis, in a database of its own, which no fault
touches either.

Like ``chaos.topology`` for Sentinel, this class starts and stops the deployment and *reads* its
nodes (which master serves which queue); the faults (kill and restart of a master, slot
migrations) are ``chaos.cluster_faults``'s.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from redis.crc import key_slot

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer

#: Celery's broker in the cluster scenarios: this database of the ledger's Redis.
BROKER_DB = 1


@dataclass(frozen=True)
class ClusterSpec:
    """How a scenario's cluster is built, and how its traffic sends.

    ``send_wait``: ``wait_replicas`` of every send (0: acknowledged by the shard's master alone).
    ``node_timeout_ms``: ``cluster-node-timeout``, how long a master is unreachable before its
    replica is promoted. 2 s, as Sentinel's ``down-after-milliseconds`` in the ``sentinel-*`` rows:
    a shorter one risks a failover nobody asked for on this loaded 2-core machine.
    """

    masters: int = 3
    replicas_per_master: int = 0
    send_wait: int = 0
    node_timeout_ms: int = 2000

    def describe(self) -> dict[str, str]:
        """The settings the report shows beside the scenario's ``MQORDER_*`` ones."""
        return {"Redis Cluster": f"{self.masters} masters × {self.replicas_per_master} replica(s)",
                "cluster-node-timeout": f"{self.node_timeout_ms} ms",
                "wait_replicas (sends)": str(self.send_wait),
                "Celery broker": "a plain Redis"}


def queue_slot(mq: MessageQueue) -> int:
    """The hash slot of every key of ``mq`` (they share its hash tag)."""
    return key_slot(keys.queue_next(mq.tag).encode())


class ClusterRedis:
    """The Redis Cluster under test, and reads of who serves what."""

    def __init__(self, spec: ClusterSpec, *, fsync: str) -> None:
        self.spec = spec
        self.fsync = fsync
        self.deployment = ClusterDeployment(masters=spec.masters, replicas_per_master=spec.replicas_per_master,
                                            node_timeout_ms=spec.node_timeout_ms, appendonly=True,
                                            appendfsync=fsync)

    @property
    def url(self) -> str:
        return self.deployment.url()

    def start(self) -> None:
        self.deployment.start(timeout=60)

    def stop(self, keep: Path | None = None) -> None:
        """Stop every node; ``keep``: copy their logs there first (the deployment's own directory
        is removed with it)."""
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for f in self.deployment.dir.rglob("*.log"):
                shutil.copy(f, keep / f"{f.parent.name}-{f.name}")
        self.deployment.stop()

    @property
    def nodes(self) -> list[RedisServer]:
        return self.deployment.nodes

    def name(self, node: RedisServer) -> str:
        """``node-<i>:<port>`` as in the deployment's directory (stable across restarts, unlike roles)."""
        return f"node-{self.nodes.index(node)}:{node.port}"

    def masters(self) -> list[RedisServer]:
        """The masters serving slots now, in ``nodes`` order."""
        return self.deployment.masters_serving()

    def serving(self, mqs: list[MessageQueue]) -> dict[int, RedisServer]:
        """Queue id -> the master serving its slot now."""
        ranges = self.deployment.slot_map()
        return {mq.queue_id: next(m for lo, hi, m in ranges if lo <= queue_slot(mq) <= hi) for mq in mqs}

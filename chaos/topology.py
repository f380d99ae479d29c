"""The Redis under test as a Sentinel deployment: the ``sentinel-*`` scenarios' topology.

A primary, two replicas and three Sentinels (``mqorder.testing.sentinel.SentinelDeployment``), each
node with AOF on at the scenario's ``appendfsync`` and, where the scenario asks for it,
``min-replicas-to-write``/``min-replicas-max-lag``. Workers, beat, traffic and the evidence reach it
through its ``redis+sentinel://`` URL, so every one of them follows a failover by itself; the
ledger Redis stays a plain ``redis-server`` that no fault touches.

Besides starting and stopping, this class only *reads* the nodes directly (roles, the state hashes
of a queue, error counters): what the faults and the missed-grant scenario record as evidence of
what each node held at a given moment. Faults themselves (kill, pause) are ``chaos.faults``'s.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from chaos.listeners import GROUP
from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.testing.embedded import RedisServer
from mqorder.testing.sentinel import SentinelDeployment

#: The deployment of every Sentinel scenario: a primary and this many replicas, three Sentinels.
REPLICAS = 2
SENTINELS = 3


@dataclass(frozen=True)
class SentinelSpec:
    """How a scenario's Sentinel deployment is configured, and how its traffic sends.

    ``send_wait``: ``wait_replicas`` of every send of the traffic (0: the send is acknowledged by
    the primary alone, asynchronous replication). ``min_replicas_to_write`` > 0 makes each node
    refuse writes (``NOREPLICAS``) while it is a primary with fewer replicas acknowledging within
    ``min_replicas_max_lag_s``: what stops an old primary that comes back from a pause, still
    believing it is the primary, from taking writes nobody will ever see.
    """

    send_wait: int = 0
    min_replicas_to_write: int = 0
    min_replicas_max_lag_s: int = 10
    #: Sentinel's ``down-after-milliseconds``. 1 s (the tests' default) made Sentinel fail over a
    #: just-promoted primary again on this loaded 2-core machine (its first PING answer took over
    #: 1 s): a second, unplanned failover no event records. 2 s did not.
    down_after_ms: int = 2000

    def redis_args(self, fsync: str) -> tuple[str, ...]:
        args = ["--appendfsync", fsync]
        if self.min_replicas_to_write:
            args += ["--min-replicas-to-write", str(self.min_replicas_to_write),
                     "--min-replicas-max-lag", str(self.min_replicas_max_lag_s)]
        return tuple(args)

    def describe(self) -> dict[str, str]:
        """The settings the report shows beside the scenario's ``MQORDER_*`` ones."""
        out = {"wait_replicas (sends)": str(self.send_wait), "down-after-milliseconds": str(self.down_after_ms)}
        if self.min_replicas_to_write:
            out["min-replicas-to-write"] = str(self.min_replicas_to_write)
            out["min-replicas-max-lag"] = f"{self.min_replicas_max_lag_s} s"
        return out


@dataclass(frozen=True)
class QueueState:
    """What one node holds of one queue at one moment: the lock (owner, epoch), the committed
    offset and the queue's next offset (its end)."""

    owner: str
    epoch: int
    offset: int
    next: int


class SentinelRedis:
    """The Sentinel deployment under test, and direct reads of its nodes."""

    def __init__(self, spec: SentinelSpec, *, fsync: str) -> None:
        self.spec = spec
        self.fsync = fsync
        self.deployment = SentinelDeployment(replicas=REPLICAS, sentinels=SENTINELS, appendonly=True,
                                             down_after_ms=spec.down_after_ms, extra_args=spec.redis_args(fsync))

    @property
    def url(self) -> str:
        return self.deployment.url()

    def start(self) -> None:
        self.deployment.start(timeout=60)

    def stop(self, keep: Path | None = None) -> None:
        """Stop every node and Sentinel; ``keep``: copy their logs there first (the deployment's
        own directory is removed with it)."""
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for f in self.deployment.dir.rglob("*.log"):
                shutil.copy(f, keep / f"{f.parent.name}-{f.name}")
        for n in self.nodes:  # a paused node would sit out SIGTERM's whole grace period
            if n.proc is not None and n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)
        self.deployment.stop()

    # -- nodes -----------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[RedisServer]:
        return self.deployment.nodes

    def primary(self) -> RedisServer:
        return self.deployment.primary()

    def replicas(self) -> list[RedisServer]:
        return self.deployment.replicas()

    def name(self, node: RedisServer) -> str:
        """``node-<i>`` as in the deployment's directory (stable across restarts, unlike roles)."""
        return f"node-{self.nodes.index(node)}:{node.port}"

    def client(self, node: RedisServer, timeout: float = 2.0) -> redis.Redis:
        return self.deployment.direct_client(node, timeout=timeout)

    def _ask(self, node: RedisServer, *cmd: Any) -> Any:
        c = self.client(node)
        try:
            return c.execute_command(*cmd)
        finally:
            c.close()

    def role(self, node: RedisServer) -> str:
        """``master``/``slave`` as the node itself says (``ROLE``), ``down`` if it does not answer."""
        try:
            role = self._ask(node, "ROLE")
        except (redis.RedisError, OSError):
            return "down"
        r = role[0]
        return r.decode() if isinstance(r, bytes) else str(r)

    def set_priority(self, node: RedisServer, priority: int) -> None:
        """``replica-priority`` (0: Sentinel never promotes this node)."""
        self._ask(node, "CONFIG", "SET", "replica-priority", str(priority))

    def errorstats(self, node: RedisServer) -> dict[str, int]:
        """Error replies the node gave, by code (``INFO errorstats``: ``NOREPLICAS``, ``READONLY``...)."""
        c = self.client(node)
        try:
            info: Any = c.info("errorstats")
        finally:
            c.close()
        return {k.removeprefix("errorstat_"): int(v["count"]) for k, v in info.items()}

    def queue_states(self, node: RedisServer, mqs: list[MessageQueue]) -> dict[int, QueueState]:
        """Every queue's lock, committed offset and end as ``node`` holds them now (a replica too:
        what it would hold if it were promoted this moment)."""
        c = self.client(node)
        try:
            pipe = c.pipeline(transaction=False)
            for mq in mqs:
                pipe.hmget(keys.sub_state(mq.tag, GROUP), "owner", "epoch", "offset")
                pipe.get(keys.queue_next(mq.tag))
            res = pipe.execute()
        finally:
            c.close()
        out = {}
        for i, mq in enumerate(mqs):
            (owner, epoch, offset), nxt = res[2 * i], res[2 * i + 1]
            out[mq.queue_id] = QueueState((owner or b"").decode(), int(epoch or 0), int(offset or 0), int(nxt or 0))
        return out

    def config_epoch(self) -> int:
        """The Sentinels' configuration epoch of the primary: it goes up by one with each failover
        (the highest any reachable Sentinel reports)."""
        seen = [0]
        for s in self.deployment.sentinels:
            c = s.client()
            try:
                m: Any = c.sentinel_master(self.deployment.master_name)
                seen.append(int(m.get("config-epoch", 0)))
            except redis.RedisError:
                continue
            finally:
                c.close()
        return max(seen)

    # -- waiting ---------------------------------------------------------------------------------

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> RedisServer:
        return self.deployment.node(self.deployment.wait_failover(old_port, timeout))

    def wait_replicas(self, n: int = REPLICAS, timeout: float = 60.0) -> None:
        """The primary has ``n`` replicas online, and every Sentinel knows them again."""
        deadline = time.monotonic() + timeout
        self.deployment.wait_replicas_online(n, timeout)
        d = self.deployment
        while time.monotonic() < deadline:
            if all(self._sentinel_sees(s.client(), n) for s in d.sentinels):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the Sentinels did not see {n} replicas again within {timeout:.0f} s")

    def _sentinel_sees(self, c: redis.Redis, n: int) -> bool:
        """One Sentinel names the current primary with ``n`` replicas that are not down."""
        try:
            m: Any = c.sentinel_master(self.deployment.master_name)
            replicas: Any = c.sentinel_slaves(self.deployment.master_name)
        except redis.RedisError:
            return False
        finally:
            c.close()
        up = [r for r in replicas if not ({"s_down", "o_down", "disconnected"} & set(str(r.get("flags", "")).split(",")))]
        return int(m.get("port", 0)) == self.deployment.primary_port() and len(up) >= n

    def wait_role(self, node: RedisServer, role: str, timeout: float = 60.0) -> float:
        """Seconds until ``node`` says it is ``role`` (an old primary demoted by Sentinel)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.role(node) == role:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{self.name(node)} did not become a {role} within {timeout:.0f} s")

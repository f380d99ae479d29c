"""A Redis Cluster on free loopback ports, for cluster tests, chaos and benches.

``masters`` masters (and ``replicas_per_master`` replicas of each), every node a real
``redis-server --cluster-enabled yes``, joined by ``redis-cli --cluster create``. Short
``cluster-node-timeout`` so a killed master's replica takes over in a couple of seconds.
``url()`` is the store URL (``redis+cluster://...``) clients are given.

For the chaos rows, faults an operator causes on a live cluster: ``kill`` a node and
``restart`` it (it rejoins from its ``nodes.conf``, as a replica of whoever was promoted in its
place), and ``migrate_slot``: one hash slot moved to another master with the steps
``redis-cli --cluster reshard`` takes for each slot (``SETSLOT IMPORTING``/``MIGRATING``,
``MIGRATE`` of its keys in batches, ``SETSLOT NODE`` everywhere), for a slot *we* choose, where
``redis-cli`` picks the lowest slots of the source itself.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from mqorder.admin.doctor_cluster import parse_cluster_nodes
from mqorder.errors import BrokerUnavailableError
from mqorder.store.replies import text
from mqorder.testing.embedded import RedisServer

#: ``cluster-node-timeout`` in tests: a master unreachable this long is failed over by its replica.
DEFAULT_NODE_TIMEOUT_MS = 1000


def redis_cli_binary() -> str:
    path = shutil.which("redis-cli")
    if path is None:
        raise BrokerUnavailableError("redis-cli is not installed; `apt-get install -y redis-tools` (or redis-server)")
    return path


class ClusterDeployment:
    """A Redis Cluster of real processes. Use as a context manager."""

    def __init__(self, *, masters: int = 3, replicas_per_master: int = 0,
                 node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS, appendonly: bool = False,
                 appendfsync: str = "everysec") -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.masters = masters
        self.replicas_per_master = replicas_per_master
        self.dir = Path(tempfile.mkdtemp(prefix="mqorder-cluster-"))
        n = masters * (1 + replicas_per_master)
        self.nodes: list[RedisServer] = []
        for i in range(n):
            d = self.dir / f"node-{i}"
            d.mkdir()
            self.nodes.append(RedisServer(workdir=str(d), appendonly=appendonly, appendfsync=appendfsync,
                                          cluster_bus=True, extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # A master with no replica left keeps its slots served (the rest of the cluster works).
                "--cluster-require-full-coverage", "no",
                # A new replica syncs at once (Redis waits 5 s for more replicas by default).
                "--repl-diskless-sync-delay", "0",
            ]))

    def start(self, timeout: float = 60.0) -> ClusterDeployment:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            [redis_cli_binary(), "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas_per_master),
             "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout,
        )
        if out.returncode != 0:
            raise BrokerUnavailableError(f"redis-cli --cluster create failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        self.wait_ok(timeout)
        self._wait_replicas_attached(timeout)
        return self

    def _wait_replicas_attached(self, timeout: float) -> None:
        """Every replica ``start`` asked for is one, its link to its master up. ``wait_ok`` alone
        can pass before: a node ``redis-cli`` has not made a replica yet is a master without
        slots, with no link to judge (seen in CI under load: a doctor then found 6 primaries)."""
        want = self.masters * self.replicas_per_master
        deadline = time.monotonic() + timeout
        up = 0
        while time.monotonic() < deadline:
            up = 0
            for n in self._alive():
                c = self.client(n)
                try:
                    info = c.info("replication")
                except redis.RedisError:
                    continue
                finally:
                    c.close()
                up += info.get("role") == "slave" and info.get("master_link_status") == "up"
            if up >= want and self._every_node_sees_replicas(want):
                return
            time.sleep(0.1)
        raise BrokerUnavailableError(f"{up} of {want} cluster replicas attached within {timeout:.0f} s")

    def _every_node_sees_replicas(self, want: int) -> bool:
        """Every live node's ``CLUSTER NODES`` names ``want`` replicas: the roles have gone round
        the cluster bus, which lags a replica's own ``INFO`` (seen in CI under load: a doctor that
        read ``CLUSTER NODES`` right after ``start`` found 5 primaries and 1 replica)."""
        for n in self._alive():
            c = self.client(n)
            try:
                raw = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                return False
            finally:
                c.close()
            # The doctor's own parser and its own notion of a replica: the wait ends where its
            # view does.
            if sum(not e.is_primary for e in parse_cluster_nodes(text(raw))) < want:
                return False
        return True

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ClusterDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self) -> str:
        """``redis+cluster://h:p,h:p,...`` naming every master (any one is enough to bootstrap)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters]) + "/"

    def client(self, node: RedisServer, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def cluster_info(self, node: RedisServer | None = None) -> dict[str, str]:
        raw = self.client(node or self._alive()[0]).execute_command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text(raw).strip().splitlines() if ":" in line)

    def _alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Every live node reports ``cluster_state:ok`` and all 16,384 slots assigned, and every
        live replica's link to its master is up (synced: a failover before that promotes nothing)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                infos = [self.cluster_info(n) for n in self._alive()]
                last = infos[0]
                links = [self.client(n).info("replication") for n in self._alive()]
                if (all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos)
                        and all(r.get("master_link_status", "up") == "up" for r in links)):
                    return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise BrokerUnavailableError(f"cluster not ok within {timeout:.0f} s: {last}")

    def slot_map(self) -> list[tuple[int, int, RedisServer]]:
        """``(first slot, last slot, master)`` of every slot range, as a live node sees it now
        (``CLUSTER SLOTS``)."""
        c = self.client(self._alive()[0])
        try:
            entries = c.execute_command("CLUSTER", "SLOTS")
        finally:
            c.close()
        by_port = {n.port: n for n in self.nodes}
        return [(int(e[0]), int(e[1]), by_port[int(e[2][1])]) for e in entries if int(e[2][1]) in by_port]

    def master_of_slot(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now (``CLUSTER SLOTS`` from a live node)."""
        for lo, hi, master in self.slot_map():
            if lo <= slot <= hi:
                return master
        raise KeyError(slot)

    def kill(self, node: RedisServer) -> None:
        node.kill()

    def wait_failover(self, dead: RedisServer, slot: int, timeout: float = 30.0) -> RedisServer:
        """Wait until ``slot`` (served by ``dead``) is served by another node (its replica)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                node = self.master_of_slot(slot)
                if node is not dead:
                    return node
            except (redis.RedisError, StopIteration, KeyError):
                pass
            time.sleep(0.1)
        raise BrokerUnavailableError(f"slot {slot} not failed over away from port {dead.port} within {timeout:.0f} s")

    # -- faults an operator causes: restarts and slot migrations ----------------------------------

    def _ask(self, node: RedisServer, *cmd: Any, timeout: float = 5.0) -> Any:
        """One command on one node, on a connection of its own (closed after)."""
        c = self.client(node, timeout=timeout)
        try:
            return c.execute_command(*cmd)
        finally:
            c.close()

    def node_id(self, node: RedisServer) -> str:
        """The node's cluster id (``CLUSTER MYID``): what ``SETSLOT`` and ``REPLICATE`` name it by."""
        raw = self._ask(node, "CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def role(self, node: RedisServer) -> str:
        """``master``/``slave`` as the node itself says (``ROLE``), ``down`` if it does not answer."""
        try:
            r = self._ask(node, "ROLE", timeout=2.0)[0]
        except (redis.RedisError, OSError):
            return "down"
        return r.decode() if isinstance(r, bytes) else str(r)

    def masters_serving(self) -> list[RedisServer]:
        """The nodes that serve slots now (``CLUSTER SLOTS`` of a live node), in ``nodes`` order."""
        serving = {id(master) for _, _, master in self.slot_map()}
        return [n for n in self.nodes if id(n) in serving]

    def restart(self, node: RedisServer, timeout: float = 60.0) -> None:
        """Start a killed node again on its port, its data and ``nodes.conf``. A master that was
        failed over meanwhile learns from the others that its slots have a newer owner (a higher
        config epoch) and turns itself into that owner's replica: nothing is reconfigured here."""
        node.start(timeout=timeout)

    def wait_replica_of(self, node: RedisServer, master: RedisServer, timeout: float = 60.0) -> float:
        """Seconds until ``node`` is a replica of ``master`` with its replication link up (synced)."""
        t0 = time.monotonic()
        last: object = None
        while time.monotonic() - t0 < timeout:
            try:
                c = self.client(node)
                try:
                    info: Any = c.info("replication")
                finally:
                    c.close()
                last = {k: info.get(k) for k in ("role", "master_port", "master_link_status")}
                if (info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port
                        and info.get("master_link_status") == "up"):
                    return time.monotonic() - t0
            except (redis.RedisError, OSError) as exc:
                last = exc
            time.sleep(0.1)
        raise BrokerUnavailableError(f"node {node.port} did not become an in-sync replica of {master.port} "
                                     f"within {timeout:.0f} s (last seen: {last})")

    def migrate_slot(self, slot: int, target: RedisServer, *, batch: int = 100,
                     timeout_ms: int = 10_000) -> int:
        """Move hash slot ``slot`` to master ``target`` while clients use it; the number of keys moved.

        The steps of ``redis-cli --cluster reshard`` for one slot: the target marks it IMPORTING,
        the source MIGRATING (from then on the source answers ``ASK`` for a key it no longer has,
        and ``TRYAGAIN`` to a multi-key command whose keys are split between the two), the keys are
        moved in batches with ``MIGRATE`` (atomic per call), then ``SETSLOT NODE`` is sent to the
        target first (it bumps its config epoch, so its claim wins), the source next, every other
        master last. Clients that still send to the source get ``MOVED`` from then on."""
        if not 0 <= slot < 16384:
            raise ValueError(f"slot {slot} is not a hash slot (0..16383)")
        source = self.master_of_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is already served by node {target.port}: choose another target")
        if target not in self.masters_serving():
            raise ValueError(f"node {target.port} serves no slot (a replica or down): migrate to a live master")
        src_id, dst_id = self.node_id(source), self.node_id(target)
        self._ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        self._ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            names = self._ask(source, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not names:
                break
            self._ask(source, "MIGRATE", "127.0.0.1", target.port, "", 0, timeout_ms, "KEYS", *names,
                      timeout=timeout_ms / 1000 + 5)
            moved += len(names)
        others = [n for n in self.masters_serving() if n is not source and n is not target]
        for n in (target, source, *others):
            self._ask(n, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        return moved

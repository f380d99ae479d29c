"""A Redis Cluster on free loopback ports, for cluster tests, chaos and benches.

``masters`` masters (and ``replicas_per_master`` replicas of each), every node a real
``redis-server --cluster-enabled yes``, joined by ``redis-cli --cluster create``. Short
``cluster-node-timeout`` so a killed master's replica takes over in a couple of seconds.
``url()`` is the store URL (``redis+cluster://...``) clients are given.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from mqorder.errors import BrokerUnavailableError
from mqorder.testing.embedded import RedisServer, free_port

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
                 node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS, appendonly: bool = False) -> None:
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
            self.nodes.append(RedisServer(workdir=str(d), appendonly=appendonly, extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(d / "nodes.conf"),
                # The bus on a free port of its own (by default port + 10000, which may be taken or > 65535).
                "--cluster-port", str(free_port()),
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
        return self

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
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)

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

    def master_of_slot(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now (CLUSTER SHARDS from a live node)."""
        for entry in self.client(self._alive()[0]).execute_command("CLUSTER", "SLOTS"):
            lo, hi, master = int(entry[0]), int(entry[1]), entry[2]
            if lo <= slot <= hi:
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
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

"""A replicated Redis watched by Sentinels, on free loopback ports: for HA tests, chaos and benches.

A primary, ``replicas`` replicas and ``sentinels`` Sentinels (``redis-server --sentinel``), each a
real process, with a short ``down-after-milliseconds`` so a failover takes a couple of seconds.
``kill_primary()``, ``pause()``/``resume()`` and ``wait_failover()`` are what the chaos scenarios
do to it; ``url`` is the store URL (``redis+sentinel://...``) that clients are given.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from mqorder.errors import BrokerUnavailableError
from mqorder.testing.embedded import RedisServer, free_port, redis_server_binary, wait_online_replicas
from mqorder.testing.lifetime import die_with_parent

DEFAULT_MASTER_NAME = "mqorder"
#: Sentinel's ``down-after-milliseconds`` in tests: a primary silent this long is subjectively down.
#: Measured here: a kill -9 of the primary is followed by a promoted replica in ~2-3 s at 1,000 ms.
DEFAULT_DOWN_AFTER_MS = 1000
#: Sentinel's ``failover-timeout``: also the time before a failed failover may be retried.
DEFAULT_FAILOVER_TIMEOUT_MS = 4000


class SentinelProcess:
    """One ``redis-server --sentinel`` with its own config file (Sentinel rewrites it)."""

    def __init__(self, workdir: Path, *, password: str | None = None) -> None:
        self.port = free_port()
        self.dir = workdir
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, master_name: str, primary_port: int, *, quorum: int, down_after_ms: int,
              failover_timeout_ms: int, auth_pass: str | None, timeout: float = 10.0) -> None:
        """Start the Sentinel and wait until it is *this* process that answers on its port.

        Between ``free_port`` and the bind another process (another test worker's server) may
        take the port: the Sentinel then exits, and a deployment that talked to whatever answers
        there waited 30 s for Sentinels to find each other (seen under a parallel test run). A
        taken port is replaced by another free one, as ``RedisServer.start`` does."""
        for _ in range(5):
            self._spawn(master_name, primary_port, quorum=quorum, down_after_ms=down_after_ms,
                        failover_timeout_ms=failover_timeout_ms, auth_pass=auth_pass)
            if self._answers_itself(timeout):
                return
            self.stop()
            self.port = free_port()
        raise BrokerUnavailableError(f"a Sentinel could not start on a free port (see {self.dir})")

    def _answers_itself(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # it could not bind: the port was taken
            client = self.client()
            try:
                info = client.info("server")
                if int(info.get("process_id", -1)) == self.proc.pid:
                    return True
            except redis.RedisError:
                pass
            finally:
                client.close()
            time.sleep(0.05)
        return False

    def _spawn(self, master_name: str, primary_port: int, *, quorum: int, down_after_ms: int,
               failover_timeout_ms: int, auth_pass: str | None) -> None:
        conf = self.dir / f"sentinel-{self.port}.conf"
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.dir}",
            f"logfile {self.dir / f'sentinel-{self.port}.log'}",
            f"sentinel monitor {master_name} 127.0.0.1 {primary_port} {quorum}",
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
            f"sentinel parallel-syncs {master_name} 1",
        ]
        if auth_pass:
            lines.append(f"sentinel auth-pass {master_name} {auth_pass}")
        if self.password:
            lines += [f"requirepass {self.password}", f"sentinel sentinel-pass {self.password}"]
        conf.write_text("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class SentinelDeployment:
    """A primary, its replicas and the Sentinels that watch them. Use as a context manager."""

    def __init__(
        self,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        master_name: str = DEFAULT_MASTER_NAME,
        down_after_ms: int = DEFAULT_DOWN_AFTER_MS,
        failover_timeout_ms: int = DEFAULT_FAILOVER_TIMEOUT_MS,
        password: str | None = None,
        sentinel_password: str | None = None,
        appendonly: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.password = password
        self.sentinel_password = sentinel_password
        self.dir = Path(tempfile.mkdtemp(prefix="mqorder-sentinel-"))
        extra = [*extra_args]
        if password:
            # Replicas authenticate to whichever node is primary now (all share one password).
            extra += ["--masterauth", password]
        self._extra = extra
        self._appendonly = appendonly
        self.nodes: list[RedisServer] = [self._node(i) for i in range(1 + replicas)]
        self.sentinels = [SentinelProcess(self.dir, password=sentinel_password) for _ in range(sentinels)]

    def _node(self, i: int, replicaof: int | None = None) -> RedisServer:
        args = list(self._extra)
        if replicaof is not None:
            args += ["--replicaof", "127.0.0.1", str(replicaof)]
        d = self.dir / f"node-{i}"
        d.mkdir(exist_ok=True)
        return RedisServer(password=self.password, appendonly=self._appendonly, workdir=str(d), extra_args=args)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SentinelDeployment:
        primary = self.nodes[0].start()
        for node in self.nodes[1:]:
            node.extra_args += ["--replicaof", "127.0.0.1", str(primary.port)]
            node.start()
        self.wait_replicas_online(len(self.nodes) - 1, timeout)
        quorum = len(self.sentinels) // 2 + 1
        for s in self.sentinels:
            s.start(self.master_name, primary.port, quorum=quorum, down_after_ms=self.down_after_ms,
                    failover_timeout_ms=self.failover_timeout_ms, auth_pass=self.password)
        self._wait_sentinels_agree(timeout)
        return self

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SentinelDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses -------------------------------------------------------------------------------

    @property
    def sentinel_addrs(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def url(self, db: int = 0) -> str:
        """The store URL: ``redis+sentinel://[:password@]h:p,h:p/<master>/<db>``."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addrs)
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.master_name}/{db}{query}"

    def primary_port(self) -> int:
        """The primary's port as a majority of reachable Sentinels see it now."""
        seen: dict[int, int] = {}
        for s in self.sentinels:
            if s.proc is None or s.proc.poll() is not None:
                continue
            try:
                addr: Any = s.client().sentinel_get_master_addr_by_name(self.master_name)
                _host, port = addr
            except (redis.RedisError, TypeError, ValueError):
                continue
            seen[int(port)] = seen.get(int(port), 0) + 1
        if not seen:
            raise BrokerUnavailableError("no Sentinel answered get-master-addr-by-name")
        return max(seen, key=lambda p: seen[p])

    def node(self, port: int) -> RedisServer:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(port)

    def primary(self) -> RedisServer:
        return self.node(self.primary_port())

    def replicas(self) -> list[RedisServer]:
        p = self.primary_port()
        return [n for n in self.nodes if n.port != p]

    def direct_client(self, node: RedisServer, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password,
                           socket_timeout=timeout, socket_connect_timeout=timeout)

    # -- faults ----------------------------------------------------------------------------------

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary (as a crash would); returns the dead node."""
        node = self.primary()
        node.kill()
        return node

    @staticmethod
    def pause(node: RedisServer) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a GC-paused VM, a hung host)."""
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGSTOP)

    @staticmethod
    def resume(node: RedisServer) -> None:
        assert node.proc is not None
        os.kill(node.proc.pid, signal.SIGCONT)

    def restart_as_replica(self, node: RedisServer) -> None:
        """Start a killed node again as a replica of the current primary (as an operator, or
        Sentinel's reconfiguration of a returning old primary, would)."""
        primary = self.primary_port()
        node.extra_args = [a for a in self._extra] + ["--replicaof", "127.0.0.1", str(primary)]
        node.start()

    # -- waiting ---------------------------------------------------------------------------------

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a primary other than ``old_port`` and it answers as one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
            except BrokerUnavailableError:
                port = old_port
            if port != old_port and self._answers_as_primary(self.node(port)):
                return port
            time.sleep(0.05)
        raise BrokerUnavailableError(f"no failover away from port {old_port} within {timeout:.0f} s")

    def wait_sole_primary(self, port: int, timeout: float = 30.0) -> None:
        """Wait until ``port`` answers as the primary and no other live node does.

        From then on only ``port`` can acknowledge a write. Until Sentinel reconfigures a demoted
        primary that is still running (a primary failed over because it missed its PINGs for
        ``down-after-milliseconds``, not because it died), that node still takes writes, and they
        are lost when it resyncs from the new one.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            if {n.port for n in live if self._answers_as_primary(n)} == {port}:
                return
            time.sleep(0.05)
        raise BrokerUnavailableError(f"port {port} is not the only primary after {timeout:.0f} s")

    def _answers_as_primary(self, node: RedisServer) -> bool:
        """Whether ``node``'s ``ROLE`` says master (False if it does not answer)."""
        client = self.direct_client(node)
        try:
            role = client.execute_command("ROLE")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return bool(role) and role[0] in (b"master", "master")

    def wait_replicas_online(self, n: int, timeout: float = 30.0) -> None:
        """Wait until the primary reports ``n`` replicas online and in sync."""
        primary = self.primary() if self.sentinels[0].proc else self.nodes[0]
        wait_online_replicas(primary, n, timeout, self.password)

    def _wait_sentinels_agree(self, timeout: float) -> None:
        """Every Sentinel knows the primary, the replicas and the other Sentinels (so a quorum and
        a majority for the leader election exist before a test kills anything)."""
        deadline = time.monotonic() + timeout
        want_replicas = len(self.nodes) - 1
        want_others = len(self.sentinels) - 1
        while time.monotonic() < deadline:
            ok = True
            for s in self.sentinels:
                try:
                    m: Any = s.client().sentinel_master(self.master_name)
                    if int(m.get("num-slaves", 0)) < want_replicas or int(m.get("num-other-sentinels", 0)) < want_others:
                        ok = False
                except redis.RedisError:
                    ok = False
            if ok:
                return
            time.sleep(0.1)
        raise BrokerUnavailableError(f"Sentinels did not discover each other within {timeout:.0f} s (see {self.dir})")

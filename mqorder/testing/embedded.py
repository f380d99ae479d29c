"""A throw-away ``redis-server`` on a free loopback port, for the demo, tests, chaos runs and benchmarks.

Real Redis, never a fake: it runs the same Lua, the same TIME and the same AOF as production.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from mqorder.errors import BrokerUnavailableError
from mqorder.testing.lifetime import die_with_parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Free ports tried in turn when each is taken before our server binds it.
_PORT_ATTEMPTS = 5


class _PortTaken(Exception):
    """Another process holds the port (it answers there, or our server could not bind it)."""


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise BrokerUnavailableError(
            "redis-server is not installed; run `make test` or `make demo` (they install it with "
            "apt-get), or `apt-get install -y redis-server`"
        )
    return path


class RedisServer:
    """Start with ``start()`` (or as a context manager); ``kill()``/``restart()`` for chaos tests."""

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        password: str | None = None,
        workdir: str | None = None,
        tls: bool = False,
        extra_args: Sequence[str] = (),
        cluster_bus: bool = False,
    ) -> None:
        self.port = port or free_port()
        #: A port we picked may be replaced if another process takes it before our server binds it.
        self._may_move = port is None
        #: A cluster node's bus port (``--cluster-port``; Redis's default, port + 10000, may be taken
        #: or past 65535). Picked like ``port`` and picked again with it: the bus port taken is as
        #: likely as the port, and retrying with the same one fails every time.
        self.bus_port: int | None = free_port() if cluster_bus else None
        #: More ``redis-server`` arguments (``--maxmemory-policy allkeys-lru``, ``--rename-command``...).
        self.extra_args = list(extra_args)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.password = password
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="mqorder-redis-"))
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.dir / 'ca.crt'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _make_certs(self) -> None:
        """A self-signed CA and a server certificate for 127.0.0.1 (openssl, for TLS tests)."""
        d = str(self.dir)
        run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=mqorder-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
            "-out", "server.csr")
        (self.dir / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.crt")

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start ``redis-server`` and wait until it is *this* process that answers on the port.

        ``free_port`` only finds a port that was free a moment ago: between it and the server's
        bind, another process (another test worker's server, a test's own) may take the port. Our
        server then exits with "Address already in use", but until it does a ping on the port is
        answered by the other one, and a caller that trusted it would use (and a fixture flush) a
        server that is not ours. So the answer must come from our pid (``INFO server``'s
        ``process_id``). A port we picked ourselves is replaced by another free one and the start
        retried; a port the caller chose (or the one a ``restart`` must keep) is an error.
        """
        attempts = _PORT_ATTEMPTS if self._may_move else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                self._may_move = False  # clients now hold this port: restarts keep it
                return self
            except _PortTaken as exc:
                if attempt == attempts:
                    raise BrokerUnavailableError(
                        f"port {self.port} is taken by another process ({exc}); "
                        + ("choose a free port" if attempts == 1 else f"{attempts} free ports were taken in turn")
                    ) from None
                self.port = free_port()
                if self.bus_port is not None:
                    self.bus_port = free_port()
        raise AssertionError("unreachable")  # pragma: no cover

    def _args(self) -> list[str]:
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.bus_port is not None:
            args += ["--cluster-port", str(self.bus_port)]
        args += self.extra_args
        if self.tls:
            if not (self.dir / "server.crt").exists():
                self._make_certs()
            i = args.index("--port")
            args[i + 1] = "0"
            args += [
                "--tls-port", str(self.port), "--tls-cert-file", str(self.dir / "server.crt"),
                "--tls-key-file", str(self.dir / "server.key"), "--tls-ca-cert-file", str(self.dir / "ca.crt"),
                "--tls-auth-clients", "no",
            ]
        return args

    def _start_once(self, timeout: float) -> None:
        log_path = self.dir / "redis.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0  # restarts append to one log
        self.proc = proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            preexec_fn=die_with_parent())  # not left behind by a killed run
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if client.ping():
                        answering = int(client.info("server")["process_id"])
                        if answering != proc.pid:
                            self._discard(proc)
                            raise _PortTaken(f"redis-server pid {answering} answers there, ours was pid {proc.pid}")
                        # Wait for the AOF to be loaded (LOADING errors) before handing it out. A
                        # cluster node serves no key before its slots are assigned: INFO instead.
                        if "--cluster-enabled" in self.extra_args:
                            if client.info("persistence").get("loading"):
                                raise redis.BusyLoadingError("loading")
                        else:
                            client.get("mqorder:probe")
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.ResponseError):
                    # Not up yet, or loading its AOF, or (ResponseError) a foreign server refusing our AUTH.
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    self._discard(proc)
                    log = log_path.read_bytes()[log_start:].decode(errors="replace") if log_path.exists() else ""
                    if "Address already in use" in log:
                        raise _PortTaken("our redis-server could not bind it: Address already in use")
                    raise BrokerUnavailableError(f"redis-server did not start on port {self.port}:\n{log[-2000:]}")
                time.sleep(0.02)
        finally:
            client.close()

    @staticmethod
    def _discard(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)

    def owns_port(self) -> bool:
        """True if the server answering on ``port`` is this object's process (not one that took
        the port after ours died or never bound it)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return int(client.info("server")["process_id"]) == self.proc.pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def flushall(self) -> None:
        """``FLUSHALL``, only if the server on the port is ours: the per-test flush must never
        wipe another process's server (another test worker's, or a chaos run's)."""
        if not self.owns_port():
            pid = self.proc.pid if self.proc is not None else None
            raise BrokerUnavailableError(
                f"refusing to FLUSHALL 127.0.0.1:{self.port}: the server answering there is not our "
                f"redis-server (pid {pid}, {'running' if self.proc and self.proc.poll() is None else 'not running'}); "
                "restart this RedisServer or start a new one"
            )
        client = redis.Redis.from_url(self.url)
        try:
            client.flushall()
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no AOF rewrite, no clean shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def url_answers(url: str, timeout: float = 0.5) -> bool:
    try:
        c = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        ok = bool(c.ping())
        c.close()
        return ok
    except (redis.RedisError, OSError, ValueError):
        return False



def online_replicas(info: dict) -> int:
    """Replicas an ``INFO replication`` reply lists as ``online`` (connected and synced)."""
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")


def wait_online_replicas(primary: RedisServer, n: int, timeout: float = 30.0, password: str | None = None) -> None:
    """Wait until ``primary`` reports ``n`` replicas online (a WAIT before that proves nothing)."""
    c = redis.Redis(host="127.0.0.1", port=primary.port, password=password, socket_timeout=2)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                if online_replicas(c.info("replication")) >= n:
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
    finally:
        c.close()
    raise BrokerUnavailableError(f"{n} replicas of port {primary.port} did not come online within {timeout:.0f} s")

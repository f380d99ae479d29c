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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    ) -> None:
        self.port = port or free_port()
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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    # Wait for the AOF to be loaded (LOADING errors) before handing it out.
                    client.get("mqorder:probe")
                    break
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text()[-2000:] if (self.dir / "redis.log").exists() else ""
                raise BrokerUnavailableError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.02)
        client.close()
        return self

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


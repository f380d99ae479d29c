"""A throw-away RabbitMQ virtual host, for tests, chaos runs and benchmarks with RabbitMQ as
Celery's broker.

Each run gets a vhost of its own (``rabbitmqctl add_vhost``, deleted at the end with every queue
and exchange in it), so two runs on one RabbitMQ never see each other's worker-direct queues or
a stale ConsumeRequest left by the other. RabbitMQ itself is not started here: it runs as a
service (127.0.0.1:5672, guest/guest by default). When it is missing or down, ``start`` raises
``BrokerUnavailableError`` saying so and how to get it, instead of letting workers retry forever.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from urllib.parse import quote

from mqorder.errors import BrokerUnavailableError

_HOW = (
    "the RabbitMQ variants need a RabbitMQ server at {where} (user {user}) and its rabbitmqctl: "
    "`apt-get install -y rabbitmq-server && service rabbitmq-server start` (CI runs it as a service)"
)


class RabbitVhost:
    """Start with ``start()`` (or as a context manager); ``url`` is an ``amqp://`` URL into it."""

    def __init__(
        self,
        prefix: str = "mqorder-test",
        *,
        host: str = "127.0.0.1",
        port: int = 5672,
        user: str = "guest",
        password: str = "guest",
        timeout: float = 60.0,
    ) -> None:
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        self.host, self.port, self.user, self.password = host, port, user, password
        self.timeout = timeout
        self.started = False

    @property
    def url(self) -> str:
        return f"amqp://{quote(self.user, safe='')}:{quote(self.password, safe='')}@{self.host}:{self.port}/" \
               f"{quote(self.name, safe='')}"

    def _how(self) -> str:
        return _HOW.format(where=f"{self.host}:{self.port}", user=self.user)

    def ctl(self, *args: str) -> str:
        """Run ``rabbitmqctl args...``; its output, or ``BrokerUnavailableError`` with its reason."""
        exe = shutil.which("rabbitmqctl")
        if exe is None:
            raise BrokerUnavailableError(f"rabbitmqctl is not installed; {self._how()}")
        try:
            proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise BrokerUnavailableError(f"rabbitmqctl {args[0]} took over {self.timeout:.0f}s; {self._how()}") from None
        if proc.returncode != 0:
            reason = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise BrokerUnavailableError(
                f"rabbitmqctl {' '.join(args)} failed ({' / '.join(reason) or proc.returncode}); {self._how()}"
            )
        return proc.stdout

    def start(self) -> RabbitVhost:
        self.ctl("add_vhost", self.name)
        self.started = True
        self.ctl("set_permissions", "-p", self.name, self.user, ".*", ".*", ".*")
        self.check()
        return self

    def check(self) -> None:
        """One AMQP connection into the vhost: the port answers and the user may use the vhost."""
        import amqp  # type: ignore[import-untyped]  # py-amqp: kombu's AMQP client, not Celery

        conn = amqp.Connection(host=f"{self.host}:{self.port}", userid=self.user, password=self.password,
                               virtual_host=self.name, connect_timeout=5)
        try:
            conn.connect()
        except Exception as exc:  # any failure here means the same to the caller
            raise BrokerUnavailableError(
                f"cannot open an AMQP connection to vhost {self.name!r} at {self.host}:{self.port}: {exc!r}; "
                f"{self._how()}"
            ) from exc
        finally:
            try:
                conn.collect()
            except Exception:  # noqa: BLE001 - nothing to release on a failed connect
                pass

    def queues(self, column: str = "messages_ready") -> dict[str, int]:
        """Every queue of the vhost with one count of ``rabbitmqctl list_queues``: ready messages by
        default, ``messages_unacknowledged`` (delivered to a consumer, not yet acked) or ``consumers``."""
        out = self.ctl("list_queues", "-p", self.name, "--quiet", "--no-table-headers", "name", column)
        counts: dict[str, int] = {}
        for line in out.splitlines():
            name, _, n = line.rpartition("\t")
            if name:
                counts[name] = int(n)
        return counts

    def stop(self) -> None:
        """Delete the vhost, and with it every queue, exchange and message of the run."""
        if self.started:
            self.started = False
            self.ctl("delete_vhost", self.name)

    def __enter__(self) -> RabbitVhost:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

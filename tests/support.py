"""Helpers of the tests: the worker cluster of a test, the ledger the test listeners write, and
waiting for a condition. Test modules import them from here; ``tests/conftest.py`` holds only
fixtures (importing from a conftest makes pytest's plugin module and a plain import two copies of
one module, and mixes what pytest injects with what a test calls)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import redis

from mqorder.testing.launcher import BeatProcess, WorkerProcess, project_env
from mqorder.testing.rabbit_vhost import RabbitVhost

ROOT = Path(__file__).resolve().parent.parent

#: Faster membership and sweeps than production so tests do not wait on 20 s timers.
FAST = {
    "MQORDER_LISTENERS": "tests.listeners",
    "MQORDER_HEARTBEAT_INTERVAL_MS": "500",
    "MQORDER_HEARTBEAT_TIMEOUT_MS": "3000",
    "MQORDER_SWEEP_INTERVAL_MS": "1000",
    "MQORDER_PENDING_TTL_MS": "10000",
}


def xdist_worker() -> str:
    """This test process's pytest-xdist worker id (``gw0``, ``gw1``...), ``main`` without xdist: for
    names of resources shared by every process of the run (RabbitMQ vhosts, Spark app names), so a
    leftover can be traced to the worker that made it."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class Cluster:
    """Worker subprocesses (and optionally beat) of one test, all stopped at teardown."""

    def __init__(self, url: str, tmp: Path, client: redis.Redis) -> None:
        self.url = url
        self.tmp = tmp
        self.client = client
        self.workers: dict[str, WorkerProcess] = {}
        self.beat: BeatProcess | None = None
        #: Celery's broker when it is not the store's Redis (``broker_cluster``: a RabbitMQ vhost).
        self.celery_broker_url: str | None = None
        self.rabbit: RabbitVhost | None = None

    def env(self, **extra: str) -> dict[str, str]:
        broker = {"MQORDER_CELERY_BROKER_URL": self.celery_broker_url} if self.celery_broker_url else {}
        return project_env(self.url, **{**FAST, **broker, **extra})

    def start_worker(self, name: str, *, concurrency: int = 2, pool: str = "prefork", wait: bool = True,
                     **extra: str) -> WorkerProcess:
        w = WorkerProcess(name, env=self.env(**extra), concurrency=concurrency, pool=pool,
                          logfile=self.tmp / f"{name}.log", cwd=ROOT, loglevel="INFO")
        w.start()
        self.workers[name] = w
        if wait:
            w.wait_registered(self.client, timeout=60)
        return w

    def start_beat(self, **extra: str) -> BeatProcess:
        self.beat = BeatProcess(env=self.env(**extra), workdir=self.tmp / "beat", logfile=self.tmp / "beat.log", cwd=ROOT)
        return self.beat.start()

    def stop(self) -> None:
        for w in self.workers.values():
            w.stop(timeout=30)
        if self.beat:
            self.beat.stop()


def body(key: str, seq: int) -> bytes:
    return json.dumps({"k": key, "s": seq}).encode()


def ledger(client: redis.Redis, group: str) -> list[dict]:
    out = []
    for raw in client.lrange(f"ledger:{group}", 0, -1):
        f = raw.decode().split("|")
        out.append({
            "key": f[0], "seq": int(f[1]), "queue": int(f[2]), "offset": int(f[3]), "epoch": int(f[4]),
            "client": f[5], "pid": int(f[6]), "start": int(f[7]), "end": int(f[8]), "reconsume": int(f[9]),
            "ok": f[10] == "S", "topic": f[11] if len(f) > 11 else "",
        })
    return out


def wait_for(pred, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def check_order(entries: list[dict]) -> tuple[list[str], int, int]:
    """Per key, successful handling must go seq 1, 2, 3... with redeliveries only repeating a
    prefix. Returns (violations, distinct handled, duplicates)."""
    last: dict[str, int] = {}
    violations, dups, handled = [], 0, 0
    for e in entries:
        if not e["ok"]:
            continue
        prev = last.get(e["key"], 0)
        if e["seq"] == prev + 1:
            last[e["key"]] = e["seq"]
            handled += 1
        elif e["seq"] <= prev:
            dups += 1
        else:
            violations.append(f"key {e['key']}: seq {e['seq']} after {prev}")
    return violations, handled, dups


def grant_floor(client: redis.Redis) -> int:
    """The lowest epoch a lock grant made from now on can carry: Redis's clock in ms, times 1000
    (``grant_epoch`` in ``_lock.lua``: epochs are a hybrid clock, the failover fence)."""
    sec, usec = client.time()
    return (sec * 1000 + usec // 1000) * 1000


def damaged(rng: random.Random, data: bytes, alphabet: bytes, most: int = 2, least: int = 1) -> bytes:
    """``data`` with ``least`` to ``most`` random bytes changed (to one of ``alphabet``), dropped or
    doubled: the damage the parsers' fuzz tests feed them."""
    out = bytearray(data)
    for _ in range(rng.randint(least, most)):
        at = rng.randrange(len(out))
        what = rng.randrange(3)
        if what == 0:
            out[at] = rng.choice(alphabet)
        elif what == 1:
            del out[at]
        else:
            out.insert(at, out[at])
    return bytes(out)


def use_parsers(which: str, monkeypatch) -> None:
    """The Spark readers' compiled cut and parsers (``which == "native"``: ``mqorder.spark._resp``
    must be built, which ``make install`` does; a skip would hide a read ~2.6x costlier in Python)
    or numpy's and Arrow's (``"numpy"``: the extension hidden from every module that uses it)."""
    from mqorder.spark import headers, resp_pages

    if which == "native":
        assert headers._resp is not None, (
            "mqorder.spark._resp is not built: run `make install` (setup.py compiles it; it needs a C compiler)")
    else:
        monkeypatch.setattr(resp_pages, "_resp", None)
        monkeypatch.setattr(headers, "_resp", None)


def ping_refused(url: str, timeout: float = 1.0) -> BaseException:
    """The ``BrokerUnavailableError`` a ``Broker`` of ``url`` raises on its first ``ping`` (it
    must raise one), the broker closed either way: how a bad or unreachable store URL reads."""
    import pytest

    from mqorder.errors import BrokerUnavailableError
    from mqorder.store.brokers import Broker

    b = Broker("broker-a", url, socket_timeout=timeout)
    try:
        with pytest.raises(BrokerUnavailableError) as exc:
            b.ping()
    finally:
        b.close()
    return exc.value


def evalsha_of(command: tuple | bytes) -> str | None:
    """The script hash an ``EVALSHA`` command of a ``ConnectionLease.round_trip`` calls, None for
    any other command: queued as a tuple, or packed already (``RawPipeline.execute_packed``:
    ``switch.lua`` behind a lingering read), as ``*<n>``, ``$7``, ``EVALSHA``, ``$40``, the hash."""
    if isinstance(command, bytes):
        parts = command.split(b"\r\n", 5)
        return parts[4].decode() if len(parts) > 4 and parts[2] == b"EVALSHA" else None
    return command[1] if command[0] == "EVALSHA" else None

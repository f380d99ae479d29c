"""Transactional traffic for the ``transactions`` scenario: producers killed between the phases.

Beside the scenario's regular traffic, producer *processes* (``python -m chaos.txn``) send
transactional messages to topic ``chaos-tx``, each with a local outcome picked at random:

* ``commit`` / ``rollback``: the executor answers at once;
* ``unknown-commit``: the executor answers UNKNOWN, its local state says COMMIT;
* ``late``: UNKNOWN, and the checker answers UNKNOWN for its first ``LATE_CHECKS`` check-backs
  before it finds the local state committed;
* ``never``: UNKNOWN forever: rolled back after ``transaction_check_max`` check-backs;
* ``hang-commit`` / ``hang-none``: the executor records its local state (COMMIT, or nothing) and
  hangs; the scenario kills the process with ``kill -9`` between the two phases.

Every intent and local state lives in the ledger Redis (never killed). ``TxnTraffic.verify`` then
waits until no half message is left and checks that exactly the committed ones are in the log,
once each, and nothing else.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from mqorder.client.transaction import LocalTransactionState, TransactionProducer
from mqorder.client.transaction_check import transaction_checker
from mqorder.model import MessageExt

TOPIC = "chaos-tx"
QUEUES = 4
KINDS = ("commit", "rollback", "unknown-commit", "late", "never", "hang-commit", "hang-none")
VISIBLE = {"commit", "unknown-commit", "late", "hang-commit"}
LATE_CHECKS = 2
INTENTS = "tx:intents"
#: Set when the traffic ends: producers finish their transaction and exit (a kill there could
#: land between the intent and the local state, which no real producer can tell apart either).
STOP = "tx:stop"
#: The settings the scenario runs with: quick check-backs, so the drain does not wait minutes.
ENV = {"MQORDER_TRANSACTION_TIMEOUT_MS": "2000", "MQORDER_TRANSACTION_CHECK_INTERVAL_MS": "1000",
       "MQORDER_TRANSACTION_CHECK_MAX": "5"}

_r: redis.Redis | None = None


def _ledger() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["CHAOS_LEDGER_URL"], socket_timeout=5)
    return _r


@transaction_checker(topic=TOPIC)
def check(msg: MessageExt) -> LocalTransactionState:
    """Answers from the local state the producer left in the ledger Redis."""
    checks = _ledger().incr(f"tx:checks:{msg.msg_id}")
    local = _ledger().get(f"tx:local:{msg.msg_id}")
    if local == b"COMMIT" or (local == b"LATE" and checks > LATE_CHECKS):
        return LocalTransactionState.COMMIT
    if local == b"ROLLBACK":
        return LocalTransactionState.ROLLBACK
    return LocalTransactionState.UNKNOWN


# -- the producer process -----------------------------------------------------------------------


def produce(seed: int, hang_every: int) -> None:
    """Send transactions until killed; about one in ``hang_every`` hangs mid-transaction."""
    rng = random.Random(seed)
    producer = TransactionProducer()
    led = _ledger()

    while not led.exists(STOP):
        kind = rng.choice(KINDS if rng.randrange(hang_every) == 0 else KINDS[:5])

        def executor(msg: MessageExt, arg: object, kind: str = kind) -> LocalTransactionState:
            led.rpush(INTENTS, json.dumps({"id": msg.msg_id, "kind": kind}))
            local = {"rollback": "ROLLBACK", "unknown-commit": "COMMIT", "late": "LATE", "hang-commit": "COMMIT",
                     "commit": "COMMIT"}.get(kind)
            if local:
                led.set(f"tx:local:{msg.msg_id}", local)
            if kind.startswith("hang"):
                led.set(f"tx:hang:{os.getpid()}", msg.msg_id)
                time.sleep(3600)  # killed here, between phase one and phase two
            return {"commit": LocalTransactionState.COMMIT,
                    "rollback": LocalTransactionState.ROLLBACK}.get(kind, LocalTransactionState.UNKNOWN)

        key = f"tx{rng.randrange(50)}"
        producer.send_in_transaction(TOPIC, json.dumps({"k": key}).encode(), sharding_key=key, executor=executor)
        time.sleep(0.05)


# -- the scenario side --------------------------------------------------------------------------


class TxnTraffic:
    """Keeps ``producers`` producer processes running; kills each one that hangs mid-transaction
    and starts another in its place."""

    def __init__(self, url: str, env: dict[str, str], ledger_url: str) -> None:
        self.url = url
        self.env = env
        self.ledger = redis.Redis.from_url(ledger_url)
        self.killed = 0
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._seed = 0
        p = TransactionProducer(url)
        p.create_topic(TOPIC, queues=QUEUES)
        self.mqs = p.describe_topic(TOPIC).message_queues
        p.close()

    def _spawn(self) -> subprocess.Popen[bytes]:
        self._seed += 1
        return subprocess.Popen([sys.executable, "-m", "chaos.txn", str(self._seed), "8"], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @contextmanager
    def running(self, producers: int = 2) -> Iterator[TxnTraffic]:
        self._procs = [self._spawn() for _ in range(producers)]
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            self._stop.set()
            watcher.join(10)
            self.ledger.set(STOP, 1)
            for p in self._procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()  # hanging mid-transaction: its intent and local state are recorded
                    p.wait(10)
                    self.killed += 1

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for i, p in enumerate(self._procs):
                if self.ledger.get(f"tx:hang:{p.pid}") is not None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(10)
                    self.killed += 1
                    self._procs[i] = self._spawn()

    def verify(self, timeout: float = 90.0) -> dict[str, int]:
        """Wait until no half message is left; then exactly the committed ones are stored, once."""
        from mqorder.store.log import MessageLog
        from mqorder.store.transactions import HalfStore

        p = TransactionProducer(self.url)
        try:
            store = HalfStore(p.brokers, p.appender, timeout=5)
            deadline = time.monotonic() + timeout
            while any(store.pending(mq) for mq in self.mqs):
                if time.monotonic() > deadline:
                    left = sum(len(store.pending(mq)) for mq in self.mqs)
                    raise AssertionError(f"{left} transaction(s) still half-way {timeout:.0f}s after the traffic")
                time.sleep(0.5)
            log = MessageLog(p.brokers)
            stored = Counter(m.msg_id for mq in self.mqs for m in log.read(mq, 0, 1_000_000))
            intents = [json.loads(x) for x in self.ledger.lrange(INTENTS, 0, -1)]
        finally:
            p.close()
        kinds = Counter(i["kind"] for i in intents)
        problems = []
        for i in intents:
            n = stored.get(i["id"], 0)
            want = 1 if i["kind"] in VISIBLE else 0
            if n != want:
                problems.append(f"{i['kind']} transaction {i['id']} stored {n} time(s), expected {want}")
        strays = set(stored) - {i["id"] for i in intents}
        if strays:
            problems.append(f"{len(strays)} stored message(s) of no recorded transaction, e.g. {sorted(strays)[:3]}")
        if problems:
            raise AssertionError(f"{len(problems)} transaction problem(s): {problems[:5]}")
        return {"transactions": len(intents), "committed": sum(stored.values()), "producers_killed": self.killed,
                **{f"kind_{k}": n for k, n in sorted(kinds.items())}}


if __name__ == "__main__":
    produce(int(sys.argv[1]), int(sys.argv[2]))

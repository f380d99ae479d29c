"""Durable sends: ``WAIT`` for replicas after an append, and what to say when they fall short.

Redis replication is asynchronous: a send the primary acknowledged may be on no replica yet when
the primary dies, and Sentinel may promote a replica that lacks it (DESIGN, "Redis topologies").
``WAIT n t`` after a write answers how many replicas have it. It cannot run inside a Lua script,
and it counts the writes of *its own connection*, so the appender sends it in the same pipeline
as the append scripts, on their connection, right behind them: no extra round trip.

A send with ``wait_replicas=n`` (or ``MQORDER_SEND_WAIT_REPLICAS=n``), step by step:

1. Before anything is written, the primary must have at least ``n`` replicas connected
   (``connected_slaves`` of ``INFO replication``, cached ``REPLICA_COUNT_TTL_S`` per broker and
   read afresh before a refusal). Fewer: ``NotEnoughReplicasError``, nothing stored. Waiting for
   replicas that are not there could only time out, and must never quietly become a wait for 0.
2. One round trip: the append scripts, then for an idempotent append a *fence write*
   (``INCRBY <queue's next-offset counter> 0``), then ``WAIT n t``.
3. Fewer than ``n`` acknowledged within ``t`` ms: ``ReplicasBehindError``. The message IS stored
   on the primary; a failover now could lose it; a resend with the same dedup key is safe.

Why the fence write: ``WAIT`` is documented to cover "the previous write commands sent in the
context of the current connection". A resend of a dedup key (or a Spark commit run again) stores
nothing, so its script writes nothing, and by that contract its ``WAIT`` may answer "acknowledged"
while the first copy, written by another connection or another process, is on no replica. (Redis
7.0 records the primary's offset after *every* command of a connection, read or write, so there the
script call alone would do; measured: an idle connection's ``WAIT`` does answer "acknowledged" at
once with the only replica stopped, one that ran a read-only script after the write waits. The
contract is what later versions may hold to, and what holds on every topology.) ``INCRBY k 0``
changes no value but is propagated, so the connection's offset becomes the primary's offset *now*,
past the first copy. A plain append always writes (``XADD``): it needs no fence.

The same fence makes a ``WAIT`` on any connection cover every write made before it, which is what
the Spark commit (many round trips, one ``WAIT`` per broker at the end: ``wait_after``) and a
delayed send (its schedule script is not the append path) rely on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mqorder.errors import NotEnoughReplicasError, ReplicasBehindError
from mqorder.store.brokers import Broker
from mqorder.store.failures import translated
from mqorder.store.raw_pipe import RawPipeline

#: Seconds a broker's count of connected replicas is trusted before a waiting send reads it again
#: (a send that would be refused always reads it again first).
REPLICA_COUNT_TTL_S = 1.0
#: The setting a wait comes from, named in every message.
SETTING = "MQORDER_SEND_WAIT_REPLICAS"


#: The most replicas a write may wait for (as ``lock_wait_replicas``): more is a typo, which
#: otherwise passed the start and failed every send with ``NotEnoughReplicasError``.
MAX_WAIT_REPLICAS = 16


def parse_wait_replicas(value: object) -> int:
    """A number of replicas to wait for: a whole number, 0 (do not wait) or more.

    Raises ``ValueError`` (the settings' validator and ``Producer`` turn it into ``ConfigError``
    naming the variable or the argument). Digits in a string are accepted: the environment's form.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WAIT_REPLICAS:
        raise ValueError(
            f"must be a whole number of replicas from 0 (sends do not wait) to {MAX_WAIT_REPLICAS}: 1 makes an "
            "acknowledged send survive a failover to the replica that has it"
        )
    return value


@dataclass(frozen=True, slots=True)
class SendWait:
    """Wait for ``replicas`` replicas, at most ``timeout_ms``, after a write (Redis ``WAIT``)."""

    replicas: int
    timeout_ms: int

    def commands(self, fence_key: str | None) -> list[tuple[Any, ...]]:
        """What follows the writes in their pipeline: the fence write (when the writes may have
        written nothing: an idempotent append), then ``WAIT``."""
        out: list[tuple[Any, ...]] = [] if fence_key is None else [("INCRBY", fence_key, 0)]
        out.append(("WAIT", self.replicas, self.timeout_ms))
        return out


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


class ReplicaGate:
    """Per broker: the connected-replica check before a waiting write, and the error after one."""

    def __init__(self, ttl_s: float = REPLICA_COUNT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, int]] = {}

    def connected(self, broker: Broker, *, fresh: bool = False) -> int:
        """``connected_slaves`` of the broker's primary (cached ``ttl_s`` unless ``fresh``); -1 if
        the broker's URL leads to a replica (its writes are refused, ``READONLY``, saying so)."""
        now = time.monotonic()
        seen = self._seen.get(broker.name)
        if seen is not None and not fresh and now - seen[0] < self.ttl_s:
            return seen[1]
        if broker.is_cluster:
            # Every shard replicates on its own: the fewest replicas any primary has.
            infos: Any = broker.client.info("replication", target_nodes="primaries")
            n = min(int(i.get("connected_slaves", 0)) for i in infos.values())
        else:
            info: Any = broker.client.info("replication")
            n = int(info.get("connected_slaves", 0)) if info.get("role", "master") == "master" else -1
        self._seen[broker.name] = (now, n)
        return n

    def before_write(self, broker: Broker, wait: SendWait, action: str = "send") -> None:
        """``NotEnoughReplicasError`` (nothing written) if the primary has fewer replicas than asked."""
        have = self.connected(broker)
        if have < 0 or wait.replicas <= have:
            return
        have = self.connected(broker, fresh=True)
        if have < 0 or wait.replicas <= have:
            return
        raise NotEnoughReplicasError(
            f"{action} refused before anything was stored: it asks to wait for {wait.replicas} "
            f"{_plural(wait.replicas, 'replica', 'replicas')} (wait_replicas / {SETTING}), but the primary "
            f"of broker {broker.name!r} at {broker.safe_url} has connected_slaves:{have}, so the wait could "
            f"only time out. Ask for at most {have}, or bring the missing replicas back (INFO replication on "
            "the primary lists the connected ones; `mqorder doctor` explains the replication)"
        )

    def behind(self, broker: Broker, wait: SendWait, acked: int, messages: int, action: str = "send",
               *, what: str | None = None) -> str:
        """The sentence of ``ReplicasBehindError`` for one broker whose ``WAIT`` fell short.

        ``what`` names what IS on the primary when it is not "the message(s) IS/ARE stored": a
        transaction's commit says "the commit IS applied" (``mqorder.store.transactions``)."""
        try:
            have: object = self.connected(broker, fresh=True)
        except redis.RedisError:
            have = "?"
        if what is None:
            what = "the message IS stored" if messages == 1 else f"the {messages} messages ARE stored"
        return (
            f"{action}: {what} on the primary of broker {broker.name!r} at {broker.safe_url}, but only "
            f"{acked} of {wait.replicas} {_plural(wait.replicas, 'replica', 'replicas')} acknowledged within "
            f"{wait.timeout_ms} ms (connected_slaves:{have}), so a failover now could lose "
            f"{_plural(messages, 'it', 'them')}"
        )


#: What a resend of a send does, said by every ``ReplicasBehindError`` of a send.
RESEND = (
    "A resend with the same dedup key is safe: it stores nothing again and waits for the replicas again "
    "(succeeding once they catch up). Without a dedup key a resend stores a second copy"
)


def behind_error(parts: list[str], resend: str = RESEND) -> ReplicasBehindError:
    """One error for every broker whose ``WAIT`` fell short, saying what a resend does."""
    return ReplicasBehindError(
        "; ".join(parts) + f". {resend}. Check the replicas' lag with `mqorder doctor`, or raise "
        "MQORDER_SEND_WAIT_TIMEOUT_MS"
    )


def wait_after(gate: ReplicaGate, wait: SendWait, targets: Sequence[tuple[Broker, str, int]], *, timeout: float,
               action: str = "send", resend: str = RESEND, what: dict[str, str] | None = None) -> None:
    """``WAIT`` for every write made so far on each broker of ``targets`` (``(broker, fence key,
    messages written there)``), on any connection: the fence write then ``WAIT``, a round trip of
    its own per broker. ``ReplicasBehindError`` naming each broker that fell short, once all were
    asked. A broker that does not answer is ``BrokerUnavailableError`` (``timeout`` is quoted).

    For writes that are many round trips (a Spark commit) or not the append path (a delayed
    send's schedule); a send through ``QueueAppender`` waits in its own round trip instead.
    ``what``: by broker name, what IS stored there when it is not messages (``behind``'s ``what``).
    """
    behind = []
    for broker, fence_key, messages in targets:
        pipe = RawPipeline(broker.client)
        for cmd in wait.commands(fence_key):
            pipe.execute_command(*cmd)
        with translated(broker.name, broker.safe_url, timeout, action):
            acked = int(pipe.execute()[-1])
        if acked < wait.replicas:
            behind.append(gate.behind(broker, wait, acked, messages, action, what=(what or {}).get(broker.name)))
    if behind:
        raise behind_error(behind, resend)

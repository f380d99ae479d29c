"""Consumer clients and their heartbeats (RocketMQ's client registration with the broker).

A client is one Celery worker node (client id = its hostname). Its heartbeat is a deadline in a
sorted set, computed from Redis's clock, so "is it alive" never depends on a worker's clock. A
client whose deadline has passed is *dead* for rebalance, which may then take its queues at once:
safe, because every commit is fenced by the lock epoch.

A client's subscriptions are stored as a JSON array of ``{"group", "topic", "model"}`` objects
(``encode_subscriptions`` / ``decode_subscriptions``): group and topic names may hold ``|`` and
``%`` (RocketMQ's charset), so no separator-joined string could be split back safely.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.exceptions import RedisClusterException

from mqorder import keys
from mqorder.model import MessageModel
from mqorder.store.replies import text

log = logging.getLogger(__name__)

_SUB_FIELDS = frozenset({"group", "topic", "model"})
#: The ``pool`` a ``PullConsumer`` registers with: it takes queues in the rebalance like a worker,
#: but takes no ConsumeRequests (its application pulls), so nobody dispatches to it.
PULL_POOL = "pull"


@dataclass(frozen=True)
class Subscription:
    group: str
    topic: str
    model: MessageModel

    def to_json(self) -> dict[str, str]:
        return {"group": self.group, "topic": self.topic, "model": self.model.value}

    @classmethod
    def from_json(cls, obj: object) -> Subscription:
        """The subscription of one ``to_json`` object; ``ValueError`` for anything else."""
        if (
            not isinstance(obj, dict)
            or set(obj) != _SUB_FIELDS
            or not all(isinstance(v, str) for v in obj.values())
        ):
            raise ValueError(f"not a subscription: {obj!r}")
        return cls(obj["group"], obj["topic"], MessageModel(obj["model"]))


def encode_subscriptions(subscriptions: Iterable[Subscription]) -> str:
    """The ``subs`` field of a client's info hash: a sorted JSON array, the same for the same set."""
    return json.dumps([s.to_json() for s in sorted(set(subscriptions), key=_sort_key)])


def decode_subscriptions(raw: bytes | str) -> tuple[Subscription, ...]:
    """Parse ``encode_subscriptions``'s output; ``ValueError`` if ``raw`` is not that."""
    items = json.loads(raw)
    if not isinstance(items, list):
        raise ValueError(f"not a subscription list: {raw[:100]!r}")
    return tuple(Subscription.from_json(item) for item in items)


def _sort_key(s: Subscription) -> tuple[str, str, str]:
    return s.group, s.topic, s.model.value


@dataclass(frozen=True)
class ClientInfo:
    """A registered client, as ``ClientRegistry.clients`` reads it back.

    ``pool`` and ``concurrency`` are the Celery pool the client consumes with (``""`` / 0 when the
    registrant did not say, e.g. an older mqorder); ``heartbeat_timeout_ms`` is the timeout *that
    client* heartbeats with, so ``mqorder consumers`` computes a heartbeat's age from the deadline
    without assuming its own setting; ``started_ms`` is when it registered (Redis clock).
    """

    client_id: str
    subscriptions: tuple[Subscription, ...]
    pid: int = 0
    host: str = ""
    deadline_ms: int = 0
    pool: str = ""
    concurrency: int = 0
    heartbeat_timeout_ms: int = 0
    started_ms: int = 0
    #: ``<mqorder version>+<scripts digest>`` of the client (``""``: an older mqorder): a rolling
    #: upgrade shows which worker runs what (``mqorder consumers``, ``mqorder doctor``).
    version: str = ""

    @property
    def heartbeat_ms(self) -> int:
        """When the client last heartbeated (its deadline minus its timeout), 0 if unknown."""
        return self.deadline_ms - self.heartbeat_timeout_ms if self.heartbeat_timeout_ms else 0


@dataclass(frozen=True)
class ClientDetails:
    """What a client says about how it consumes, stored with its registration for operators
    (``mqorder consumers``): the Celery worker bootstep knows its pool and concurrency."""

    pool: str = ""
    concurrency: int = 0


def _int(raw: Any) -> int:
    """A registration field as int; 0 when missing or unreadable (written by another version)."""
    try:
        return int(raw or 0)
    except (TypeError, ValueError):
        return 0


def client_info(client_id: str, raw: dict[bytes, Any], deadline_ms: int) -> ClientInfo:
    """A client's registration hash (``keys.client_info``) read back; ``ValueError`` if its
    subscriptions are unreadable. Fields an older mqorder did not write read as empty / 0."""
    return ClientInfo(
        client_id, decode_subscriptions(raw.get(b"subs", b"[]")), _int(raw.get(b"pid")), text(raw.get(b"host")),
        deadline_ms, text(raw.get(b"pool")), _int(raw.get(b"concurrency")), _int(raw.get(b"hb_timeout_ms")),
        _int(raw.get(b"started_ms")), text(raw.get(b"version")),
    )


def client_version() -> str:
    """What a client registers as its version: ``mqorder.__version__`` and its scripts' digest."""
    from mqorder import __version__
    from mqorder.store.scripts import bundle_digest

    return f"{__version__}+{bundle_digest()}"


def redis_now_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return sec * 1000 + usec // 1000


@dataclass(frozen=True)
class Heartbeat:
    """What ``ClientRegistry.heartbeat_and_watch`` read: Redis's clock (ms) when it heartbeated,
    the membership fingerprint right after, and the watched keys' values (``None``: unset)."""

    now_ms: int
    fingerprint: str
    watched: list[Any]
    #: Whether the client's registration (its subscriptions) is still there: another process
    #: under the same client id that unregistered on its way out removed it.
    registered: bool = True
    #: ``pid@host`` of the process whose registration it is, when not this process's: another
    #: process registered under the same client id since (two apps' workers both named
    #: ``w1@host``), and the subscriptions stored are its own.
    taken_by: str = ""


def _fingerprint(live: Iterable[bytes | str]) -> str:
    """``membership_fingerprint`` of the live client ids ``live``."""
    return json.dumps(sorted(text(c) for c in live))


class ClientRegistry:
    """The live clients and their heartbeats in the meta Redis.

    ``heartbeat_timeout_ms`` has no default on purpose: a registry that heartbeats with another
    timeout than ``MQORDER_HEARTBEAT_TIMEOUT_MS`` makes its client look dead (or alive) for the
    wrong time; pass ``settings.heartbeat_timeout_ms``.
    """

    def __init__(self, meta: redis.Redis, heartbeat_timeout_ms: int) -> None:
        self.meta = meta
        self.heartbeat_timeout_ms = heartbeat_timeout_ms

    def register(
        self, client_id: str, subscriptions: list[Subscription], details: ClientDetails | None = None
    ) -> None:
        details = details or ClientDetails()
        t0 = time.time()
        redis_ms = redis_now_ms(self.meta)
        # This host's clock against Redis's, for `mqorder doctor` (leases use Redis's clock only).
        skew_ms = int((t0 + time.time()) / 2 * 1000) - redis_ms
        self.meta.hset(
            keys.client_info(client_id),
            mapping={
                "subs": encode_subscriptions(subscriptions), "pid": os.getpid(), "host": socket.gethostname(),
                "pool": details.pool, "concurrency": details.concurrency,
                "hb_timeout_ms": self.heartbeat_timeout_ms, "started_ms": redis_ms, "skew_ms": skew_ms,
                "version": client_version(),
            },
        )
        self.heartbeat(client_id)

    def heartbeat(self, client_id: str) -> None:
        """Push the client's deadline forward; one script-free round trip (TIME then ZADD)."""
        now = redis_now_ms(self.meta)
        self.meta.zadd(keys.clients(), {client_id: now + self.heartbeat_timeout_ms})

    def heartbeat_and_watch(self, client_id: str, watched: Sequence[str] = ()) -> Heartbeat:
        """``heartbeat``, with what a client watches at each heartbeat read in the same round trip:
        the live clients (``membership_fingerprint``) and the values of the ``watched`` keys.

        Two round trips (Redis's clock, then the deadline's ``ZADD``, the live clients and the
        ``GET``s in one pipeline), where a heartbeat and its checks took one each: seven a second
        per idle worker (issue 27's idle cost). A pipeline, not a script: the keys may sit in
        several slots of a Redis Cluster."""
        now = redis_now_ms(self.meta)
        pipe = self.meta.pipeline(transaction=False)
        pipe.zadd(keys.clients(), {client_id: now + self.heartbeat_timeout_ms})
        pipe.zrangebyscore(keys.clients(), now + 1, "+inf")
        pipe.hmget(keys.client_info(client_id), "pid", "host")
        for k in watched:
            pipe.get(k)
        try:
            res = pipe.execute()
        except RedisClusterException as exc:
            # A cluster pipeline's "no node answers" is not a RedisError; the duty loop backs off
            # on a ConnectionError, as for any other unreachable Redis.
            raise redis.ConnectionError(f"Redis Cluster unreachable: {exc}") from exc
        pid, host = (text(v) if v is not None else None for v in res[2])
        taken_by = ""
        if pid is not None and (pid, host) != (str(os.getpid()), socket.gethostname()):
            taken_by = f"{pid}@{host}"
        return Heartbeat(now, _fingerprint(res[1]), list(res[3:]), pid is not None, taken_by)

    def unregister(self, client_id: str) -> None:
        pipe = self.meta.pipeline(transaction=False)
        pipe.zrem(keys.clients(), client_id)
        pipe.delete(keys.client_info(client_id))
        pipe.execute()

    def clients(self) -> tuple[list[ClientInfo], list[str], int]:
        """(live clients with their subscriptions, dead client ids, Redis now in ms)."""
        now = redis_now_ms(self.meta)
        entries = cast(list[tuple[bytes, float]], self.meta.zrange(keys.clients(), 0, -1, withscores=True))
        live_ids = [(text(c), int(s)) for c, s in entries if s > now]
        dead = [text(c) for c, s in entries if s <= now]
        pipe = self.meta.pipeline(transaction=False)
        for cid, _ in live_ids:
            pipe.hgetall(keys.client_info(cid))
        infos = []
        raw: dict[bytes, Any]
        for (cid, deadline), raw in zip(live_ids, pipe.execute(), strict=True):
            try:
                infos.append(client_info(cid, raw, deadline))
            except ValueError as exc:
                # Written by another version of mqorder: one such client must not stop every
                # rebalance. It consumes nothing until it registers again in this format.
                log.warning("client %s has an unreadable registration (%s); it gets no queues", cid, exc)
                infos.append(client_info(cid, {**raw, b"subs": b"[]"}, deadline))
        return infos, dead, now

    def membership_fingerprint(self) -> str:
        """Sorted live client ids: a change means somebody joined or lapsed; rebalance then.

        A JSON array, not a comma-joined string: client ids may hold commas, and ``a,b`` + ``c``
        must not look like ``a`` + ``b,c``.
        """
        now = redis_now_ms(self.meta)
        return _fingerprint(cast(list[bytes], self.meta.zrangebyscore(keys.clients(), now + 1, "+inf")))

    def forget_dead(self, dead: list[str], older_than_ms: int) -> None:
        """Drop heartbeats that lapsed long ago (after rebalance has taken their queues)."""
        if dead:
            self.meta.zremrangebyscore(keys.clients(), "-inf", older_than_ms)

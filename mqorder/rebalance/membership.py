"""Consumer clients and their heartbeats (RocketMQ's client registration with the broker).

A client is one Celery worker node (client id = its hostname). Its heartbeat is a deadline in a
sorted set, computed from Redis's clock, so "is it alive" never depends on a worker's clock. A
client whose deadline has passed is *dead* for rebalance, which may then take its queues at once:
safe, because every commit is fenced by the lock epoch.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

import redis

from mqorder import keys
from mqorder.model import MessageModel


@dataclass(frozen=True)
class Subscription:
    group: str
    topic: str
    model: MessageModel

    @property
    def key(self) -> str:
        return f"{self.group}|{self.topic}|{self.model.value}"

    @classmethod
    def parse(cls, s: str) -> Subscription:
        g, t, m = s.split("|")
        return cls(g, t, MessageModel(m))


@dataclass(frozen=True)
class ClientInfo:
    client_id: str
    subscriptions: tuple[Subscription, ...]
    pid: int = 0
    host: str = ""
    deadline_ms: int = 0


def redis_now_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return sec * 1000 + usec // 1000


class ClientRegistry:
    def __init__(self, meta: redis.Redis, heartbeat_timeout_ms: int = 5000) -> None:
        self.meta = meta
        self.heartbeat_timeout_ms = heartbeat_timeout_ms

    def register(self, client_id: str, subscriptions: list[Subscription]) -> None:
        info = {
            "subs": json.dumps(sorted(s.key for s in subscriptions)),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self.meta.hset(keys.client_info(client_id), mapping=info)
        self.heartbeat(client_id)

    def heartbeat(self, client_id: str) -> None:
        """Push the client's deadline forward; one script-free round trip (TIME then ZADD)."""
        now = redis_now_ms(self.meta)
        self.meta.zadd(keys.clients(), {client_id: now + self.heartbeat_timeout_ms})

    def unregister(self, client_id: str) -> None:
        pipe = self.meta.pipeline(transaction=False)
        pipe.zrem(keys.clients(), client_id)
        pipe.delete(keys.client_info(client_id))
        pipe.execute()

    def clients(self) -> tuple[list[ClientInfo], list[str], int]:
        """(live clients with their subscriptions, dead client ids, Redis now in ms)."""
        now = redis_now_ms(self.meta)
        entries = self.meta.zrange(keys.clients(), 0, -1, withscores=True)
        live_ids = [(c.decode(), int(s)) for c, s in entries if s > now]
        dead = [c.decode() for c, s in entries if s <= now]
        pipe = self.meta.pipeline(transaction=False)
        for cid, _ in live_ids:
            pipe.hgetall(keys.client_info(cid))
        infos = []
        for (cid, deadline), raw in zip(live_ids, pipe.execute(), strict=True):
            subs = tuple(Subscription.parse(s) for s in json.loads(raw.get(b"subs", b"[]")))
            infos.append(ClientInfo(cid, subs, int(raw.get(b"pid", 0)), raw.get(b"host", b"").decode(), deadline))
        return infos, dead, now

    def membership_fingerprint(self) -> str:
        """Sorted live client ids: a change means somebody joined or lapsed; rebalance then."""
        now = redis_now_ms(self.meta)
        return ",".join(sorted(c.decode() for c in self.meta.zrangebyscore(keys.clients(), now + 1, "+inf")))

    def forget_dead(self, dead: list[str], older_than_ms: int) -> None:
        """Drop heartbeats that lapsed long ago (after rebalance has taken their queues)."""
        if dead:
            self.meta.zremrangebyscore(keys.clients(), "-inf", older_than_ms)

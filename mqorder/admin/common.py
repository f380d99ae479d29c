"""What every admin command shares: the connection to the brokers, group and lane lookups, errors.

The exit codes of ``mqorder`` follow the errors raised here: ``RefusedError`` (a safety check
refused a change; ``status --check`` finding a stuck queue exits 1 too) is 1; any other
``MQOrderError`` (a bad argument, an unknown topic or group, an unreachable Redis) is 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from mqorder import keys
from mqorder.errors import BrokerUnavailableError, MQOrderError
from mqorder.model import MessageExt, MessageModel, MessageQueue
from mqorder.rebalance.membership import ClientInfo, ClientRegistry
from mqorder.settings import Settings, get_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager, TopicRoute


class GroupNotFoundError(MQOrderError, LookupError):
    """No consumer group of that name ever subscribed (no workers with its listener ever ran)."""


class BadArgumentError(MQOrderError, ValueError):
    """An argument the command line could not check by type alone (an offset, a time, a key)."""


class RefusedError(MQOrderError):
    """A safety check refused a change (delete a subscribed topic, reset under live consumers):
    nothing was changed. The message says which option overrides it, when one does."""


@dataclass
class Admin:
    """The brokers of one cluster and the lookups every command needs."""

    settings: Settings
    brokers: BrokerRegistry

    @classmethod
    def open(cls, settings: Settings | None = None) -> Admin:
        """Connect and ping the default broker, so an unreachable Redis fails here, clearly."""
        settings = settings or get_settings()
        brokers = BrokerRegistry(settings.redis_url, settings.brokers)
        try:
            brokers.default.ping()
        except BrokerUnavailableError:
            brokers.close()
            raise
        return cls(settings, brokers)

    def close(self) -> None:
        self.brokers.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- lookups ---------------------------------------------------------------------------------

    @property
    def topics(self) -> TopicManager:
        return TopicManager(self.brokers, self.settings.retention_defaults)

    @property
    def registry(self) -> ClientRegistry:
        return ClientRegistry(self.brokers.meta, self.settings.heartbeat_timeout_ms)

    def client(self, mq: MessageQueue) -> redis.Redis:
        return self.brokers.get(mq.broker_name).client

    def route(self, topic: str) -> TopicRoute:
        """The topic's route; ``TopicNotFoundError`` (with how to create it) if there is none."""
        return self.topics.describe_topic(topic)

    def group_topics(self, group: str) -> dict[str, MessageModel]:
        """The topics ``group`` subscribes to, with their message model."""
        groups = self.topics.groups()
        if group not in groups:
            known = ", ".join(sorted(g for g in groups)) or "none yet"
            raise GroupNotFoundError(
                f"consumer group {group!r} does not exist in {self.brokers.default.safe_url} (known groups: "
                f"{known}); a group exists once a worker with one of its listeners (@orderly_listener, "
                "@concurrent_listener) has started, or a PullConsumer of it has subscribed. Is this the Redis "
                "the workers use (MQORDER_REDIS_URL, --redis-url)?"
            )
        return groups[group]

    def topics_of(self, group: str, topic: str | None) -> dict[str, MessageModel]:
        """``group``'s subscriptions, or only ``topic`` (which it must subscribe to)."""
        subs = self.group_topics(group)
        if topic is None:
            return subs
        if topic not in subs:
            self.route(topic)  # an unknown topic says so first
            raise BadArgumentError(
                f"group {group!r} does not subscribe to topic {topic!r}; it subscribes to: {', '.join(sorted(subs))}"
            )
        return {topic: subs[topic]}

    def lanes(self, group: str, topic: str, model: MessageModel) -> list[str]:
        """The subscription ids (``keys.sub_state``'s ``sub``) of ``group`` on ``topic``: the group
        itself when clustering, one ``<group>%BC%<client>`` per registered broadcast client."""
        if model is MessageModel.CLUSTERING:
            return [group]
        return [
            s for s in self.topics.subs_of_topic(topic) if keys.BROADCAST_SEP in s and keys.group_of_sub(s) == group
        ]

    def consumers_of(self, group: str) -> tuple[list[ClientInfo], list[str], int]:
        """(live clients subscribed to ``group``, lapsed client ids, Redis now in ms)."""
        live, dead, now = self.registry.clients()
        return [c for c in live if any(s.group == group for s in c.subscriptions)], dead, now

    def now_ms(self, broker: str | None = None) -> int:
        """Redis's clock (leases and heartbeats are judged by it, never by this machine's)."""
        client = self.brokers.get(broker).client if broker else self.brokers.meta
        sec, usec = client.time()
        return int(sec) * 1000 + int(usec) // 1000


def message_at(admin: Admin, mq: MessageQueue, offset: int, where: str, hint: str = "") -> MessageExt:
    """The message stored at ``offset`` of ``mq``, or a ``BadArgumentError`` saying which offsets the
    queue holds (``where`` names it in the message; ``hint`` is added after the range)."""
    log = MessageLog(admin.brokers)
    msgs = log.read(mq, offset, 1)
    if not msgs or msgs[0].queue_offset != offset:
        raise BadArgumentError(
            f"{where} has no message at offset {offset}; it holds offsets "
            f"[{log.min_offset(mq)}, {log.max_offset(mq)}){hint}"
        )
    return msgs[0]

"""``ShardWakeListener``: a client's wake-ups on a Redis Cluster, over sharded pub/sub.

On a plain Redis a client listens on one channel, ``mqorder:wake:<client>``, and the append
scripts ``PUBLISH`` there. On a cluster a classic ``PUBLISH`` is forwarded over the cluster bus
to *every* node, so each wake-up would cost every shard. Instead the scripts ``SPUBLISH`` on a
shard channel in the queue's own slot, ``mqorder:wake:{t:b:q}:<client>``
(``mqorder.keys.wake_prefix``), which stays on the shard that holds the queue, and the owner
subscribes (``SSUBSCRIBE``) to the channel of each queue assigned to it, on the primary serving
that queue's slot.

This listener keeps those subscriptions in step with the assignment: every ``REFRESH_S`` (and at
once when ``poke``\\d, after a rebalance) it reads the queues assigned to the client
(``mqorder:assign:<sub>``, the rebalance's read hint) and which primary serves each, and hands each
node's thread its set of channels. Each node has its own thread and pub/sub connection (a
``redis.client.PubSub`` belongs to one thread), so a slow or dead node delays no other.

What a lag costs is bounded, never a lost message: a wake-up published while nobody subscribes
(``SPUBLISH`` answers 0) leaves the queue unclaimed (``wake_owners`` in ``_append.lua``), and the
owner's sweep dispatches it within a sweep interval. A slot that migrates or fails over unsubscribes
its channels on the old node (Redis sends ``sunsubscribe``); the next refresh subscribes them on
the new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.crc import key_slot

from mqorder import keys
from mqorder.backoff import Backoff
from mqorder.model import MessageQueue
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.cluster_route import ClusterClient
from mqorder.store.wake import WakeUp

log = logging.getLogger(__name__)

#: How often the subscriptions are reconciled with the assignment (and a dead node's channels
#: moved to the node now serving their slots).
REFRESH_S = 1.0
#: How long a node thread blocks on its connection between two looks at its channel set.
POLL_S = 0.2


class _ShardPubSub(redis.client.PubSub):
    """redis-py's ``PubSub``, re-subscribing after a reconnect one shard channel per ``SSUBSCRIBE``:
    all at once (redis-py's way) is ``CROSSSLOT`` when they are in different slots."""

    def _resubscribe_shard_channels(self) -> None:
        for name, handler in list(self.shard_channels.items()):
            self._resubscribe({name: handler}, self.ssubscribe)


class _NodeSubscriber:
    """One node's sharded subscriptions, held by one thread."""

    def __init__(self, name: str, client: redis.Redis, on_wake: Callable[[WakeUp], object],
                 on_trouble: Callable[[Exception | None], None], stop: threading.Event) -> None:
        self.name = name
        self.client = client
        self.on_wake = on_wake
        #: Told when this node's channels may be homed elsewhere now (a MOVED, a server-side
        #: unsubscribe after a migration, a lost connection): the listener re-reads the slot map.
        self.on_trouble = on_trouble
        self._stop = stop
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._wanted: set[str] = set()
        #: Channels this node said it no longer serves: not subscribed here again until the next
        #: reconcile hands this node its channels anew (from the corrected slot map).
        self._moved: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name=f"mqorder-swake-{name}", daemon=True)
        self.thread.start()

    def want(self, channels: set[str]) -> None:
        with self._lock:
            self._wanted = set(channels)
            self._moved.clear()

    def close(self) -> None:
        self._done.set()

    def _stopped(self) -> bool:
        return self._stop.is_set() or self._done.is_set()

    def _loop(self) -> None:
        backoff = Backoff()
        while not self._stopped():
            pubsub: Any = _ShardPubSub(self.client.connection_pool)
            try:
                self._serve(pubsub, backoff)
            except redis.RedisError as exc:
                _close(pubsub)  # before waiting: nothing is received (and dropped) meanwhile
                self.on_trouble(exc)
                delay = backoff.next()
                log.warning("mqorder: sharded wake-ups on %s lost (%s); again in %.1fs", self.name, exc, delay)
                self._done.wait(delay)
            except Exception:
                _close(pubsub)
                log.exception("mqorder: sharded wake-up loop on %s failed", self.name)
                self._done.wait(1.0)
            else:
                _close(pubsub)

    def _serve(self, pubsub: Any, backoff: Backoff) -> None:
        """Subscribe what is wanted here, dispatch what arrives, until stopped or an error."""
        have: set[str] = set()
        leaving: set[str] = set()
        while not self._stopped():
            with self._lock:
                wanted = self._wanted - self._moved
            # One channel per command: the channels of one SSUBSCRIBE must share a slot.
            for chan in sorted(wanted - have):
                pubsub.ssubscribe(chan)
            for chan in sorted(have - wanted):
                pubsub.sunsubscribe(chan)
                leaving.add(chan)
            have = set(wanted)
            if not have and not leaving:
                self._done.wait(POLL_S)
                continue
            try:
                msg = pubsub.get_sharded_message(timeout=POLL_S)
            except (redis.exceptions.MovedError, redis.exceptions.AskError) as exc:
                # An SSUBSCRIBE for a slot this node no longer serves: that channel goes elsewhere.
                gone = {c for c in have if key_slot(c.encode()) == exc.slot_id}
                with self._lock:
                    self._moved |= gone
                have -= gone
                self.on_trouble(exc)
                continue
            if msg is None:
                continue
            backoff.reset()  # the node answers
            self._handle(msg, have, leaving)

    def _handle(self, msg: dict[str, Any], have: set[str], leaving: set[str]) -> None:
        kind = msg.get("type")
        chan = msg.get("channel")
        name = chan.decode() if isinstance(chan, bytes) else str(chan)
        if kind == "sunsubscribe":
            if name in leaving:
                leaving.discard(name)  # our own
            else:
                # The server's: the slot moved away (a migration, a failover). Re-homed by the
                # listener once the slot map says where; not subscribed here again meanwhile.
                with self._lock:
                    self._moved.add(name)
                have.discard(name)
                self.on_trouble(None)
        elif kind == "smessage":
            try:
                wake = WakeUp.decode(msg["data"])
            except ValueError as exc:
                log.warning("mqorder: ignoring a message on %s: %s", name, exc)
                return
            self.on_wake(wake)


def _close(pubsub: Any) -> None:
    try:
        pubsub.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


class ShardWakeListener:
    """A client's sharded wake-up subscriptions on every Redis Cluster broker."""

    def __init__(self, brokers: BrokerRegistry, client_id: str, owned: Callable[[], list[MessageQueue]],
                 on_wake: Callable[[WakeUp], object], stop: threading.Event) -> None:
        self.brokers = brokers
        self.client_id = client_id
        self._owned = owned
        self.on_wake = on_wake
        self._stop = stop
        self._poke = threading.Event()
        self._nodes: dict[tuple[str, str], _NodeSubscriber] = {}

    def poke(self) -> None:
        """Reconcile now (the assignment just changed), not at the next refresh."""
        self._poke.set()

    def channels_by_node(self) -> dict[tuple[str, str], tuple[ClusterClient, Any, set[str]]]:
        """(broker, node name) -> (cluster client, node, shard channels wanted there)."""
        out: dict[tuple[str, str], tuple[ClusterClient, Any, set[str]]] = {}
        for mq in self._owned():
            broker = self.brokers.get(mq.broker_name)
            client = broker.client
            if not isinstance(client, ClusterClient):
                continue
            node = client.primary_for(mq.tag)
            entry = out.setdefault((broker.name, node.name), (client, node, set()))
            entry[2].add(keys.shard_wake_channel(mq.tag, self.client_id))
        return out

    def reconcile(self) -> None:
        wanted = self.channels_by_node()
        for key, (client, node, channels) in wanted.items():
            sub = self._nodes.get(key)
            if sub is None:
                sub = self._nodes[key] = _NodeSubscriber(key[1], client.node_client(node), self.on_wake,
                                                         self._trouble_on(client), self._stop)
            sub.want(channels)
        for key in [k for k in self._nodes if k not in wanted]:
            self._nodes.pop(key).close()

    def _trouble_on(self, client: ClusterClient) -> Callable[[Exception | None], None]:
        """What a node's thread calls when its channels may belong elsewhere now: patch the slot
        map from a MOVED, or re-read it (rate-limited), then reconcile at once."""
        def trouble(exc: Exception | None) -> None:
            try:
                if isinstance(exc, redis.exceptions.MovedError):
                    client.nodes_manager.move_slot(exc)
                else:
                    client.refresh_slots()
            except Exception:
                log.debug("mqorder: slot map update after %r failed", exc, exc_info=True)
            self.poke()
        return trouble

    def run(self) -> None:
        """Reconcile until stopped (the client's wake thread)."""
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                self._poke.clear()  # before reading: a poke during the reconcile is not lost
                self.reconcile()
                backoff.reset()
                self._poke.wait(REFRESH_S)
            except redis.RedisError as exc:
                delay = backoff.next()
                log.warning("mqorder: cannot read the assignment for sharded wake-ups (%s); again in %.1fs",
                            exc, delay)
                self._stop.wait(delay)
            except Exception:
                log.exception("mqorder: sharded wake-up refresh failed")
                self._stop.wait(1.0)
        for sub in self._nodes.values():
            sub.close()

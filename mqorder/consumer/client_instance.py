"""``ClientInstance``: the consumer client of one worker process (RocketMQ's ``MQClientInstance``).

It registers the client (a Celery worker uses its hostname as client id) with a heartbeat,
subscribes its listeners, and runs the background duties a RocketMQ client runs in its scheduled
executors:

* heartbeat every ``heartbeat_interval_ms``; a change in the set of live clients (a join, a leave, a
  heartbeat lapsing) or in the topology (a new topic, a new subscription) triggers a rebalance
  right here, not 20 s later on beat;
* ``lock_all`` of its own queues every ``lock_interval_ms`` (so leases never depend on beat);
* the sweep every ``sweep_interval_ms``: owned queues with a backlog and no live ConsumeRequest get
  one (a task deleted from the Celery broker costs one sweep, never a stall);
* a retention trim pass every ``retention_interval_ms`` (``mqorder.retention.trimmer``; one worker
  per interval does it);
* the delay mover every ``delay_move_interval_ms``: due delayed messages become visible
  (``mqorder.store.delay``; every worker runs it, each message is moved exactly once);
* wake-ups: producers publish on ``mqorder:wake:<client>`` when an idle queue gets a message, and
  this client turns that into a ConsumeRequest for itself.

All of it runs in two daemon threads, not in the worker's event loop, so a slow Redis call never
stalls the host's own message handling. It imports nothing from Celery: sending a ConsumeRequest
to a client is the ``dispatch`` callback the integration gives it (``mqorder.celery.dispatch``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable

import redis

from mqorder import keys
from mqorder.backoff import Backoff
from mqorder.consumer.listener import registered_listeners
from mqorder.consumer.shard_wake import ShardWakeListener
from mqorder.errors import ConfigError, EvictionPolicyError
from mqorder.metrics import worker as worker_metrics
from mqorder.model import ConsumeFromWhere, MessageModel, MessageQueue
from mqorder.names import check_client_id
from mqorder.rebalance.membership import ClientDetails, Subscription
from mqorder.rebalance.service import REBALANCE_MUTEX_WAIT_S, Dispatch, RebalanceService
from mqorder.rebalance.start_position import start_new_lane_at_end
from mqorder.retention.trimmer import RetentionTrimmer
from mqorder.settings import Settings
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.capacity import check_eviction_policy
from mqorder.store.delay import DelayMover
from mqorder.store.replies import text
from mqorder.store.wake import WakeUp

log = logging.getLogger(__name__)

#: If no rebalance ran for this many rebalance intervals (beat down), a worker runs one itself.
REBALANCE_STALE_FACTOR = 2.0
#: How long a rebalance started by the duty loop waits for the mutex before it is skipped and owed
#: (the same loop heartbeats: a long wait would make this client look dead).
REBALANCE_WAIT_S = 0.5
#: How long start() waits for the wake-up subscription before registering anyway.
WAKE_SUBSCRIBE_WAIT_S = 3.0
#: How long the marker of a membership change keeps the other workers from rebalancing for it
#: too: one worker per change does the work.
REBALANCE_SEEN_HOLD_MS = 2000
#: How long the wake loop blocks on its channel between two looks at the stop flag.
WAKE_POLL_S = 0.5
#: How long the wake loop waits for Redis to confirm its subscription before it counts as listening.
WAKE_CONFIRM_WAIT_S = 1.0
#: Shortest sleep of the duty loop, so a duty that is already due never spins the CPU.
DUTY_MIN_WAIT_S = 0.01
#: How often a worker whose client id another process registered too says so again.
TAKEN_LOG_EVERY_S = 60.0
#: How often a running worker reads its brokers' eviction policy again (``_recheck_eviction``).
POLICY_CHECK_S = 60.0
#: Pause after an unexpected (non-Redis) error of the wake loop, so a bug cannot spin it.
ERROR_PAUSE_S = 1.0
#: How long stop() waits for each duty thread (each checks the stop flag within a second).
THREAD_JOIN_S = 5.0

#: Sends ``consume_request(sub, mq_key, token)`` to a client: ``(sub, mq_key, token, client_id)``;
#: returns False if it could not be sent (the sweep recovers).
Dispatcher = Callable[[str, str, str, str], bool]


def _fingerprint(membership: str, topology: bytes | str | None) -> str:
    """What a change of means rebalance now: who is live (``membership_fingerprint``) and the
    topology version (topics and subscriptions)."""
    return f"{membership}\ntopology {text(topology)}"


class ClientInstance:
    def __init__(
        self, client_id: str, settings: Settings, dispatch: Dispatcher, details: ClientDetails | None = None
    ) -> None:
        self.dispatch = dispatch
        #: How this client consumes (pool, concurrency), registered for ``mqorder consumers``.
        self.details = details
        self.client_id = check_client_id(client_id)
        self.settings = settings
        self.brokers = BrokerRegistry(settings.redis_url, settings.brokers)
        self.service = RebalanceService(self.brokers, settings)
        self.trimmer = RetentionTrimmer(self.brokers, settings)
        self._policy_checked = False
        #: RocketMQ's ScheduleMessageService, as a client duty: due delayed messages become visible.
        self.delay_mover = DelayMover(self.brokers, QueueAppender(
            self.brokers, pending_ttl_ms=settings.pending_ttl_ms, timeout=settings.send_msg_timeout_ms / 1000))
        self.subscriptions = [
            Subscription(spec.group, spec.topic, spec.message_model) for spec in registered_listeners()
        ]
        self.lanes = sorted(
            {
                keys.broadcast_sub(s.group, client_id) if s.model is MessageModel.BROADCASTING else s.group
                for s in self.subscriptions
            }
        )
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fingerprint = ""
        #: The topology version of the last ``_restore_subscriptions``.
        self._topology_seen: object = None
        #: A rebalance this client took on was skipped (mutex held): try again at the next heartbeat.
        self._rebalance_owed = False
        self._registered = False
        #: When ``_registration_taken`` last logged (monotonic).
        self._taken_logged = -TAKEN_LOG_EVERY_S
        #: Wake-ups on Redis Cluster brokers arrive over sharded pub/sub, per queue
        #: (``mqorder.consumer.shard_wake``); None when no broker is a cluster.
        self.shard_wake: ShardWakeListener | None = None
        if any(self.brokers.get(n).is_cluster for n in self.brokers.names):
            self.shard_wake = ShardWakeListener(
                self.brokers, client_id, self._owned_queues,
                lambda w: self.dispatch(w.sub, w.mq_key, w.token, self.client_id), self._stop)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the client's threads; ``EvictionPolicyError`` if a broker may evict keys."""
        try:
            self._check_brokers()
        except redis.RedisError as exc:
            log.warning("mqorder: cannot check Redis's maxmemory-policy yet (%s); checking before joining", exc)
        # Listen for wake-ups before taking any queue: a message sent the moment a queue is
        # assigned must find somebody subscribed.
        if self.shard_wake is not None:
            swake = threading.Thread(target=self.shard_wake.run, name=f"mqorder-swake-{self.client_id}", daemon=True)
            swake.start()
            self._threads.append(swake)
        if self.brokers.default.is_cluster:
            self._subscribed.set()  # every wake-up of a cluster store is sharded (above)
        else:
            wake = threading.Thread(target=self._wake_loop, name=f"mqorder-wake-{self.client_id}", daemon=True)
            wake.start()
            self._threads.append(wake)
        self._subscribed.wait(WAKE_SUBSCRIBE_WAIT_S)
        try:
            self._register()
        except redis.RedisError as exc:
            log.error(
                "mqorder: cannot reach Redis at %s (%s); the worker keeps retrying and starts "
                "consuming when it answers", self.brokers.default.safe_url, exc,
            )
        duties = threading.Thread(target=self._duty_loop, name=f"mqorder-duties-{self.client_id}", daemon=True)
        duties.start()
        self._threads.append(duties)

    def stop(self) -> None:
        """Leave the group: unregister, rebalance the queues away, unlock what is idle."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=THREAD_JOIN_S)
        if not self._registered:
            return
        try:
            self.service.registry.unregister(self.client_id)
            self._rebalance_now()
            for sub in self.lanes:
                mqs = self.service.assigned_queues(sub, self.client_id)
                if mqs:
                    self.service.locks.unlock_batch(sub, mqs, self.client_id)
            # A broadcasting lane stays in its topic's subscribers: its offsets are this client's,
            # and what it has not consumed stays (the consumed retention policy) until it has been
            # gone retention_ms, as after a crash. Taking it out here let the next retention pass
            # trim what the client missed while stopped (a broadcast walk-through: 300 of 300 lost
            # across a restart, where a kill -9 lost none); `mqorder group delete` removes it.
            log.info("mqorder: client %s left; queues rebalanced", self.client_id)
        except redis.RedisError as exc:
            log.warning("mqorder: clean leave of %s failed (%s); its leases will lapse", self.client_id, exc)

    # -- registration ----------------------------------------------------------------------------

    def _check_brokers(self) -> None:
        """An evicting Redis is silent data loss: refuse it (``mqorder.store.capacity``). A plain URL
        naming one node of a Redis Cluster is refused too (``Broker.check_mode``)."""
        for name in self.brokers.names:
            broker = self.brokers.get(name)
            broker.check_mode()
            check_eviction_policy(broker, allow=self.settings.allow_eviction)
        self._policy_checked = True

    def _register(self) -> None:
        if not self._policy_checked:
            try:
                self._check_brokers()
            except ConfigError as exc:
                # Found only now (Redis was down at start): stop here, consuming nothing.
                log.critical("mqorder: client %s will not consume: %s", self.client_id, exc)
                self._stop.set()
                return
        for s in self.subscriptions:
            if s.topic == keys.retry_topic(s.group):
                self.service.topics.ensure_retry_topic(s.group, self.settings.retry_queue_nums)
            self.service.topics.subscribe(s.group, s.topic, s.model)
            if s.model is MessageModel.BROADCASTING:
                self.service.topics.add_sub(s.topic, keys.broadcast_sub(s.group, self.client_id))
        for spec in registered_listeners():
            if spec.consume_from_where is ConsumeFromWhere.LAST_OFFSET:
                # Before the rebalance below, so no run of the new lane starts at its first message.
                lane = (keys.broadcast_sub(spec.group, self.client_id)
                        if spec.message_model is MessageModel.BROADCASTING else spec.group)
                start_new_lane_at_end(self.brokers, self.service.topics, lane, spec.topic)
        # A new incarnation under the same name must not inherit the old one's run marks: force
        # its locks free so the rebalance below re-takes them with a new epoch (which also fences
        # any straggler of the old incarnation).
        for sub in self.lanes:
            mqs = self.service.assigned_queues(sub, self.client_id)
            if mqs:
                self.service.locks.unlock_batch(sub, mqs, self.client_id, force=True)
        self.service.registry.register(self.client_id, self.subscriptions, self.details)
        self._registered = True
        # What this rebalance sees, read before it: a topic or member that appears while it runs
        # is then a change at the next heartbeat. Read after it, such a topic was in the
        # fingerprint but not in the rebalance, and waited for the stale fallback (40 s).
        fingerprint = self._fingerprint_now()
        self._rebalance_now()
        self._fingerprint = fingerprint
        # The store's URL (redacted) too: a store left on its default while Celery's broker was set
        # elsewhere (MQORDER_REDIS_URL put in Django's settings.py, which mqorder does not read)
        # showed nowhere, since the worker's banner names Celery's broker only.
        log.info("mqorder: client %s joined lanes %s on %s", self.client_id, ", ".join(self.lanes) or "-",
                 self.brokers.default.safe_url)

    # -- duties ----------------------------------------------------------------------------------

    def _owned_queues(self) -> list[MessageQueue]:
        """Every queue the last rebalance assigned to this client, over all its lanes."""
        return [mq for mqs in self.service.assigned_queues_of(self.lanes, self.client_id) for mq in mqs]

    def _rebalance_now(self, wait_s: float = REBALANCE_MUTEX_WAIT_S) -> bool:
        """Rebalance now; False when it was skipped (the mutex stayed held for ``wait_s``)."""
        report = self.service.rebalance(wait_s)
        if report.skipped:
            return False
        worker_metrics.rebalanced(report)
        if self.shard_wake is not None:
            self.shard_wake.poke()
        self._dispatch_all(report.dispatches)
        log.info(
            "mqorder: rebalance by %s: %d clients, %d dead, %d queues assigned, %d moved, %d busy, %.1f ms",
            self.client_id, len(report.clients), len(report.dead), report.assigned, report.moved,
            report.busy, report.took_ms,
        )
        return True

    def abandon_runs(self, execution: str) -> list[MessageQueue]:
        """End the runs a dead ConsumeRequest execution left (its pool process was killed: the OOM
        killer, ``kill -9``, ``celery control terminate``), then sweep: its queues move on in a
        moment, where they waited out the 60 s run lease (a Celery operator's walk-through: 60 s
        of stall per killed child, invisible to ``mqorder status``). Matched by the execution's
        runner prefix on every queue this client owns, since a lingering run may have switched
        to another queue than the task's own (``abandon.lua``: a run begun meanwhile by another
        execution is left alone; the queue gets a new epoch, which fences what the dead one left
        in flight). The queues it ended."""
        if not execution or not self._registered:
            return []
        owned = [(sub, mq) for sub, mqs in zip(self.lanes, self.service.assigned_queues_of(self.lanes, self.client_id),
                                              strict=True) for mq in mqs]
        by_broker: dict[str, list[tuple[str, MessageQueue]]] = {}
        for sub, mq in owned:
            by_broker.setdefault(mq.broker_name, []).append((sub, mq))
        ended: list[MessageQueue] = []
        for name, items in by_broker.items():
            calls = [([keys.sub_state(mq.tag, sub)], [f"{execution}/"]) for sub, mq in items]
            replies = self.brokers.get(name).scripts.run_pipelined("abandon", calls)
            ended += [mq for (_, mq), n in zip(items, replies, strict=True) if int(n)]
        if ended:
            log.warning("mqorder: ConsumeRequest %s died mid-run (its pool process was lost); ended its run on %s "
                        "with a new epoch, the queue goes on now", execution, ", ".join(mq.key for mq in ended))
            self._dispatch_all(self.service.sweep(self.lanes, self.client_id))
        return ended

    def _dispatch_all(self, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            self.dispatch(d.sub, d.mq.key, d.token, d.client)

    def _duty_loop(self) -> None:
        s = self.settings
        next_hb = next_lock = next_sweep = next_delay = 0.0
        next_trim = time.monotonic() + s.retention_interval_ms / 1000
        next_policy = time.monotonic() + POLICY_CHECK_S
        backoff = Backoff()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if not self._registered:
                    self._register()
                if now >= next_hb:
                    next_hb = now + s.heartbeat_interval_ms / 1000
                    self._watch_membership()  # heartbeats too
                if now >= next_lock:
                    next_lock = now + s.lock_interval_ms / 1000
                    worker_metrics.locks_held(self.service.lock_all(self.client_id, self.lanes))
                if now >= next_sweep:
                    next_sweep = now + s.sweep_interval_ms / 1000
                    self._dispatch_all(self.service.sweep(self.lanes, self.client_id))
                if now >= next_trim and self._registered:
                    next_trim = now + s.retention_interval_ms / 1000
                    self.trimmer.run_if_due(self.client_id)
                if now >= next_delay:
                    next_delay = now + s.delay_move_interval_ms / 1000
                    self.delay_mover.move_once()
                if now >= next_policy:
                    next_policy = now + POLICY_CHECK_S
                    self._recheck_eviction()
                backoff.reset()
            except redis.RedisError as exc:
                delay = backoff.next()
                log.warning("mqorder: Redis error in client duties (%s); retrying in %.1fs", exc, delay)
                self._stop.wait(delay)
                continue
            except Exception:
                log.exception("mqorder: client duty failed")
            wait = min(next_hb, next_lock, next_sweep, next_trim, next_delay, next_policy) - time.monotonic()
            self._stop.wait(max(wait, DUTY_MIN_WAIT_S))

    def _recheck_eviction(self) -> None:
        """An eviction policy set after the start (a managed Redis's parameter change, a restart
        from a redis.conf that never got ``noeviction``) was never seen: the start's check was the
        only one. Logged at ERROR every ``POLICY_CHECK_S`` while it lasts; producers refuse to send
        into it (``CapacityGuard``), and consuming goes on (it loses nothing by itself)."""
        for name in self.brokers.names:
            try:
                check_eviction_policy(self.brokers.get(name), allow=self.settings.allow_eviction)
            except EvictionPolicyError as exc:
                log.error("mqorder: client %s: %s", self.client_id, exc)

    def _fingerprint_now(self) -> str:
        """Who is live and which topics and subscriptions exist: a change means rebalance now."""
        return _fingerprint(self.service.registry.membership_fingerprint(), self.brokers.meta.get(keys.topology_version()))

    def _watch_membership(self) -> None:
        """Heartbeat, and rebalance if who is live, the topology or the last rebalance's age says
        so; what it reads comes back with the heartbeat (``heartbeat_and_watch``)."""
        beat = self.service.registry.heartbeat_and_watch(self.client_id, (keys.topology_version(), keys.rebalance_last()))
        if self._registered and not beat.registered and not self._stop.is_set():  # not our own leave
            self._register_again()
        elif beat.taken_by and self._registered:
            self._registration_taken(beat.taken_by)
        else:
            self._taken_logged = -TAKEN_LOG_EVERY_S
        topology, last = beat.watched
        fp = _fingerprint(beat.fingerprint, topology)
        stale = False
        now = beat.now_ms  # Redis's clock on both sides: no skew between hosts
        if last is None or now - int(last) > REBALANCE_STALE_FACTOR * self.settings.rebalance_interval_ms:
            stale = True
        if fp != self._fingerprint and self._registered and topology != self._topology_seen:
            self._restore_subscriptions()
            self._topology_seen = topology  # after: a restore that raised is tried at the next heartbeat
        if fp != self._fingerprint or stale or self._rebalance_owed:
            # One worker per change (a join, a leave, a new topic or subscription) does the work;
            # the others see the key and skip. A rebalance skipped on a held mutex (its holder may
            # have been killed mid-rebalance: the mutex then lapses with its heartbeat) is owed, and
            # tried again at the next heartbeat, waiting only briefly: this loop also heartbeats.
            marker = keys.rebalance_seen(zlib.crc32(fp.encode()))
            if stale or self._rebalance_owed or self.brokers.meta.set(marker, self.client_id, nx=True, px=REBALANCE_SEEN_HOLD_MS):
                # Owed until it ran: one that raised is tried again at the next heartbeat (the
                # others skipped on this marker, and it would hold off this worker too).
                self._rebalance_owed = True
                self._rebalance_owed = not self._rebalance_now(wait_s=REBALANCE_WAIT_S)
            self._fingerprint = fp

    def _registration_taken(self, other: str) -> None:
        """Another process registered under this client id while this one runs: its subscriptions
        replaced this worker's, so rebalances give this worker's groups' queues to nobody here,
        and both read one Celery direct queue (``<name>.dq2``). Two applications whose workers
        share a node name on one Redis did this without a word (a configuration walk-through: one
        app stopped at 250 of 500 messages, and its log blamed a missing listener module). Not
        fought over (two processes re-registering in turn would rebalance at every heartbeat): an
        ERROR every ``TAKEN_LOG_EVERY_S`` until one of them is renamed or stops."""
        now = time.monotonic()
        if now - self._taken_logged < TAKEN_LOG_EVERY_S:
            return
        # A WARNING first: a deploy that starts the new process before the old one's warm shutdown
        # ended does this for seconds; an ERROR once it has lasted.
        level = logging.WARNING if self._taken_logged < 0 else logging.ERROR
        self._taken_logged = now
        log.log(level, "mqorder: client id %s is registered by another process (pid@host %s) too, which replaced this "
                  "worker's subscriptions (pid %d): two workers run under one Celery node name on this Redis, "
                  "perhaps of two applications. Give every worker its own name (celery worker -n NAME@%%h); "
                  "until then this worker's groups may get no queues", self.client_id, other, os.getpid())

    def _register_again(self) -> None:
        """This client's registration vanished while it runs: a second worker started under the
        same node name (a deploy that starts the new process before the old one's warm shutdown
        ended) unregistered it on its way out. The survivor heartbeated on with no subscriptions,
        so every rebalance gave its group's queues to nobody, for good (a Celery operator's
        walk-through: 0 of 240 messages in minutes). Register again and rebalance at once."""
        log.warning("mqorder: client %s found its registration gone, registering again: another process under the "
                    "same client id (the same Celery node name) stopped and unregistered it (give each worker its "
                    "own name: celery worker -n NAME@%%h), or Redis lost its data (restarted without persistence, "
                    "flushed)", self.client_id)
        self.service.registry.register(self.client_id, self.subscriptions, self.details)
        self._rebalance_owed = True

    def _restore_subscriptions(self) -> None:
        """Record again this client's subscriptions that are missing while their topic exists: an
        operator's ``topic delete --force`` removes a topic's subscriptions, and a topic created
        again under the same name was consumed by the running workers while ``status`` and
        ``consumers`` said the group did not exist (RocketMQ's clients send their subscriptions
        with every heartbeat, so a broker never loses them for long). Runs when the topology
        changes; a deleted topic stays unsubscribed until it exists again."""
        recorded = self.service.topics.groups()
        for s in self.subscriptions:
            if s.topic in recorded.get(s.group, {}):
                # Recorded, maybe with another model (a rolling deploy changing the listener's):
                # not missing, so left as the last registration wrote it. Rewriting it here made
                # two such workers overwrite each other at every heartbeat, each a topology change.
                continue
            if not self.brokers.meta.exists(keys.topic_route(s.topic)):
                continue
            log.info("mqorder: client %s subscribes %s to %s again (its subscription was removed)",
                     self.client_id, s.group, s.topic)
            self.service.topics.subscribe(s.group, s.topic, s.model)
            if s.model is MessageModel.BROADCASTING:
                self.service.topics.add_sub(s.topic, keys.broadcast_sub(s.group, self.client_id))

    def _wake_loop(self) -> None:
        backoff = Backoff()
        channel = keys.wake_channel(self.client_id)
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.brokers.meta.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(channel)
                pubsub.get_message(timeout=WAKE_CONFIRM_WAIT_S)  # the subscribe confirmation: now listening
                self._subscribed.set()
                backoff.reset()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=WAKE_POLL_S)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        wake = WakeUp.decode(msg["data"])
                    except ValueError as exc:
                        log.warning("mqorder: ignoring a message on %s: %s", channel, exc)
                        continue
                    self.dispatch(wake.sub, wake.mq_key, wake.token, self.client_id)
            except redis.RedisError as exc:
                delay = backoff.next()
                log.warning("mqorder: wake channel lost (%s); resubscribing in %.1fs", exc, delay)
                self._stop.wait(delay)
            except Exception:
                log.exception("mqorder: wake loop failed")
                self._stop.wait(ERROR_PAUSE_S)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001
                        pass

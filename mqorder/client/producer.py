"""``Producer``: RocketMQ's ``DefaultMQProducer`` on Redis.

It validates, selects the queue and encodes; storing is the one append path
(``mqorder.store.append.QueueAppender``: one Lua call per queue chunk that assigns offsets, appends
and wakes idle owners atomically), shared with the DLQ writer and the Spark writer.

A send acknowledged by the primary can still be lost when a replica that lacks it is promoted
(replication is asynchronous). ``wait_replicas=n`` (default ``MQORDER_SEND_WAIT_REPLICAS``) makes
the send wait, in its own round trip, until ``n`` replicas have it (``mqorder.store.durable``);
short of them it raises ``ReplicasBehindError``: stored, not yet safe from a failover.

``send_orderly_async`` is the batching path (Kafka's ``linger.ms``): it returns a future at once
and a background sender writes the sends of every thread together (``mqorder.client.batching``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from mqorder.client.batching import MAX_WAIT_MS, BatchingConfig, ProducerRecord, Sender, number_arg
from mqorder.client.dedup import DedupDerive, dedup_key_of, first_send_result
from mqorder.client.selector import Selector, key_bytes, key_hash, resolve, select_by_hash
from mqorder.codec import MsgIdGenerator, check_body, encode_header
from mqorder.errors import (
    BrokerUnavailableError,
    ConfigError,
    MessageError,
    ProducerClosedError,
    ReplicasBehindError,
    TopicNotWritableError,
)
from mqorder.keys import delay_seq, topology_version
from mqorder.model import MessageQueue, SendResult, SendStatus
from mqorder.names import check_topic
from mqorder.retention.policy import TopicRetention
from mqorder.settings import Settings, get_settings, load_settings
from mqorder.store.append import AppendReply, AppendRequest, QueueAppender
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.capacity import CapacityGuard
from mqorder.store.delay import DelayStore
from mqorder.store.durable import SendWait, parse_wait_replicas, wait_after
from mqorder.store.failures import REDIS_ERRORS, translation
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager, TopicRoute

#: How long a topic route is cached (RocketMQ polls the NameServer every 30 s).
ROUTE_TTL = 30.0
#: At most this many messages per append call in a batch.
BATCH_CHUNK = 256
#: Pause before the n-th retry of a keyed send on its queue (seconds): a blip costs little, and a
#: broker that refuses connections outright is not hammered.
KEYED_RETRY_PAUSE = (0.05, 0.2, 0.5, 1.0)

#: Guards the replacement of a producer's ``_sender_lock`` in a forked child; itself new in each
#: child (a thread of the parent may have held it at the fork).
_FORK_LOCK = threading.Lock()


def _new_fork_lock() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_fork_lock)


class Producer:
    """Sends messages to topics; ``send_orderly`` keeps all messages of one sharding key in order.

    Ordering holds for one producer sending sequentially (RocketMQ's own rule: a single producer,
    synchronous sends). The producer is thread safe, but sends from several threads interleave.

    ``linger_ms``, ``batch_size``, ``buffer_memory`` and ``max_block_ms`` (Kafka's names and
    meanings; defaults in ``mqorder.client.batching``) shape ``send_orderly_async`` only.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        brokers: BrokerRegistry | None = None,
        producer_group: str = "DEFAULT_PRODUCER",
        max_message_size: int | None = None,
        send_msg_timeout_ms: int | None = None,
        retry_times_when_send_failed: int | None = None,
        dedup_window_ms: int | None = None,
        dedup_derive: DedupDerive | str | None = None,
        send_wait_replicas: int | None = None,
        send_wait_timeout_ms: int | None = None,
        linger_ms: float | None = None,
        batch_size: int | None = None,
        buffer_memory: int | None = None,
        max_block_ms: float | None = None,
    ) -> None:
        #: ``send_orderly_async``'s batching, checked now; its sender thread starts on first use.
        self.batching = BatchingConfig.of(linger_ms=linger_ms, batch_size=batch_size, buffer_memory=buffer_memory,
                                          max_block_ms=max_block_ms)
        self._sender: Sender | None = None
        self._sender_lock = threading.Lock()
        self._sender_lock_pid = os.getpid()
        self._closed = False
        overrides: dict[str, Any] = {}
        if send_wait_replicas is not None:
            overrides["send_wait_replicas"] = send_wait_replicas
        if send_wait_timeout_ms is not None:
            overrides["send_wait_timeout_ms"] = send_wait_timeout_ms
        if dedup_window_ms is not None:
            overrides["dedup_window_ms"] = dedup_window_ms
        if dedup_derive is not None:
            overrides["dedup_derive"] = dedup_derive
        if redis_url is not None:
            overrides["redis_url"] = redis_url
        if max_message_size is not None:
            overrides["max_message_size"] = max_message_size
        if send_msg_timeout_ms is not None:
            overrides["send_msg_timeout_ms"] = send_msg_timeout_ms
        if retry_times_when_send_failed is not None:
            overrides["retry_times_when_send_failed"] = retry_times_when_send_failed
        if settings is None:
            settings = load_settings(**overrides) if overrides else get_settings()
        elif overrides:
            # Validated, so an override is held as the settings hold it (``"Content"`` -> DedupDerive.CONTENT).
            settings = settings.with_overrides(**overrides)
        self.settings = settings
        self.producer_group = producer_group
        self._own_brokers = brokers is None
        self.brokers = brokers or BrokerRegistry(
            settings.redis_url, settings.brokers, socket_timeout=settings.send_msg_timeout_ms / 1000
        )
        self.topics = TopicManager(self.brokers, settings.retention_defaults)
        self._ids = MsgIdGenerator()
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[float, TopicRoute, list[MessageQueue]]] = {}
        self.appender = QueueAppender(
            self.brokers, pending_ttl_ms=settings.pending_ttl_ms, timeout=settings.send_msg_timeout_ms / 1000,
            topics=self.topics,
            guard=CapacityGuard(allow_eviction=settings.allow_eviction, max_memory_ratio=settings.max_memory_ratio),
        )
        self._log = MessageLog(self.brokers)
        self.delays = DelayStore(self.brokers, self.appender, timeout=settings.send_msg_timeout_ms / 1000)

    # -- admin -----------------------------------------------------------------------------------

    def create_topic(
        self, topic: str, queues: int = 8, *, brokers: list[str] | None = None, perm: str | None = None,
        retention_policy: str | None = None, retention_ms: int | None = None, retention_min_ms: int | None = None,
        retention_max_messages: int | None = None,
    ) -> TopicRoute:
        """Create ``topic`` with ``queues`` queues on each broker (idempotent for the same layout).

        ``perm`` (``rw``, ``r``, ``w``; for a new topic) is RocketMQ's topic permission: a
        write-only topic fills without being consumed until ``TopicManager.update_perm`` opens it.
        ``retention_*`` override the ``MQORDER_RETENTION_*`` defaults for this topic (for a new
        topic; ``TopicManager.update_retention`` changes them later): ``retention_policy`` ``time``
        or ``consumed``, ``retention_ms``, ``retention_min_ms`` (``consumed``: kept for replay) and
        ``retention_max_messages`` per queue (``mqorder.retention.policy``).
        """
        retention = TopicRetention.of(
            policy=retention_policy, retention_ms=retention_ms, retention_min_ms=retention_min_ms,
            retention_max_messages=retention_max_messages,
        )
        try:
            route = self.topics.create_topic(topic, queues, brokers=brokers, perm=perm, retention=retention)
        except REDIS_ERRORS as exc:
            raise self._failed(exc, "create topic", "The topic may or may not be created (creating it again with "
                                                    "the same queues is safe)") from exc
        with self._lock:
            self._routes.pop(topic, None)
        return route

    def describe_topic(self, topic: str) -> TopicRoute:
        return self._route(topic, for_send=False)[0]

    # -- sending ---------------------------------------------------------------------------------

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        keys: str | list[str] | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        dedup_key: str | None = None,
        delay_time_level: int = 0,
        wait_replicas: int | None = None,
    ) -> SendResult:
        """Send to the next queue round-robin; on a broker failure retry elsewhere.

        Like RocketMQ's ``sendDefaultImpl``: up to ``retry_times_when_send_failed`` more attempts,
        each on a queue of a different broker than the one that just failed, when there is one.

        A send with a dedup key (``dedup_key=`` or ``MQORDER_DEDUP_DERIVE``) is retried on the
        *same* queue instead, since the key is remembered per queue: a given or content key picks
        its queue by hash (so a resend meets the first copy), a msg-id key the next one round-robin.

        ``delay_time_level`` (1 to 18 with RocketMQ's levels: 1s 5s 10s 30s 1m ... 2h,
        ``MQORDER_MESSAGE_DELAY_LEVEL``) holds the message beside its queue until it is due; the
        mover (``mqorder.store.delay``) then appends it, so ``queue_offset`` is -1 here. A delayed
        send is tried once (its schedule is not deduplicated) and takes no dedup key.

        ``wait_replicas`` (default ``MQORDER_SEND_WAIT_REPLICAS``): see ``send_orderly``. A send
        whose replicas fell short (``ReplicasBehindError``) is not retried elsewhere: it IS stored,
        and a copy on another broker would be a duplicate. A delayed send waits for its schedule
        entry, in a round trip of its own.
        """
        if self._closed:
            raise closed_error("send")
        route, queues = self._route(topic)
        delay_ms = self._delay_ms(delay_time_level)
        wait = self._wait(wait_replicas)
        header, msg_id, body = self._prepare(body, keys, tags, properties)
        if delay_ms:
            if dedup_key is not None:
                raise MessageError("a delayed send cannot take a dedup_key (the delay schedule does not deduplicate); "
                                   "drop one of the two")
            mq = self._select_round_robin(queues, None)
            self.delays.schedule(mq, header, body, delay_ms)
            if wait is not None:
                self._wait_delayed(mq, wait)
            return SendResult(SendStatus.SEND_OK, msg_id, mq, -1, 0)
        key = dedup_key_of(dedup_key, self.settings.dedup_derive, msg_id, body)
        if key is not None:
            by_hash = dedup_key is not None or self.settings.dedup_derive == DedupDerive.CONTENT
            mq = select_by_hash(queues, key, body) if by_hash else self._select_round_robin(queues, None)
            return self._send_keyed(mq, header, body, msg_id, key, wait)
        attempts = 1 + self.settings.retry_times_when_send_failed
        last_broker: str | None = None
        last_exc: Exception | None = None
        for _ in range(attempts):
            mq = self._select_round_robin(queues, avoid=last_broker)
            try:
                return self._append_single(mq, header, body, msg_id, wait)
            except ReplicasBehindError:
                raise
            except BrokerUnavailableError as exc:
                last_broker, last_exc = mq.broker_name, exc
                self._forget_routes()
        assert last_exc is not None
        raise last_exc

    def send_orderly(
        self,
        topic: str,
        body: bytes,
        *,
        sharding_key: object,
        selector: Selector | None = None,
        keys: str | list[str] | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        dedup_key: str | None = None,
        delay_time_level: int = 0,
        wait_replicas: int | None = None,
    ) -> SendResult:
        """Send to the queue the selector picks for ``sharding_key`` (default: crc32 mod n).

        No retry on another queue: that would break the order of the key (RocketMQ's
        ``sendSelectImpl`` does not retry either). Without a dedup key a failure raises and the
        caller decides. With one (``dedup_key=``, or derived by ``MQORDER_DEDUP_DERIVE``) the send
        is idempotent within ``MQORDER_DEDUP_WINDOW_MS``: a resend of the key returns the first send's
        result and stores nothing, and a timed-out attempt is retried on the same queue up to
        ``retry_times_when_send_failed`` times, which can neither duplicate nor reorder it.

        ``delay_time_level`` is refused: a delayed message cannot keep its place among its key's
        messages (RocketMQ's orderly send has no delay either).

        ``wait_replicas=n`` (default ``MQORDER_SEND_WAIT_REPLICAS``; 0: do not wait) returns only
        once ``n`` replicas have the message (Redis ``WAIT``, in the send's own round trip), so it
        survives a failover to one of them. Short of them within ``MQORDER_SEND_WAIT_TIMEOUT_MS``:
        ``ReplicasBehindError``, the message stored on the primary; with a dedup key the send is
        retried like a timeout (a dedup hit that waits again). More than the primary has connected:
        ``NotEnoughReplicasError`` before anything is stored.
        """
        if delay_time_level:
            raise MessageError(
                f"send_orderly cannot delay a message (delay_time_level={delay_time_level!r}): it would be "
                "overtaken by the later messages of its sharding key, breaking their order. Send it with "
                "send(..., delay_time_level=...) to a topic nobody consumes in order, or delay it in your "
                "application before sending; nothing was sent"
            )
        if self._closed:
            raise closed_error("send_orderly")
        wait = self._wait(wait_replicas)
        _, queues = self._route(topic)
        hash_ = key_hash(sharding_key)
        header, msg_id, body = self._prepare(body, keys, tags, properties, hash_)
        # The default selector is crc32(key) mod n: the hash just stored, not computed twice.
        mq = (queues[hash_ % len(queues)] if selector is None and hash_ is not None
              else self._select(queues, sharding_key, body, selector))
        key = dedup_key_of(dedup_key, self.settings.dedup_derive, msg_id, body)
        if self._sender is not None:
            self._after_async_sends()
        if key is not None:
            return self._send_keyed(mq, header, body, msg_id, key, wait)
        return self._append_single(mq, header, body, msg_id, wait)

    def send_orderly_batch(
        self,
        topic: str,
        items: Iterable[tuple[object, bytes]],
        *,
        selector: Selector | None = None,
        tags: str | None = None,
        dedup_keys: Sequence[str | None] | None = None,
        wait_replicas: int | None = None,
    ) -> list[SendResult]:
        """Send many ``(sharding_key, body)`` pairs; per-key order is the order of ``items``.

        All pairs are validated before anything is written, so a bad item refuses the whole batch
        and nothing is half-sent. Messages are grouped per queue and written with one script call
        per queue chunk, pipelined per broker.

        With dedup keys (``dedup_keys``, one per item, or derived by ``MQORDER_DEDUP_DERIVE``) each
        message is stored at most once per queue within the dedup window, and a batch that timed
        out is sent again whole (up to ``retry_times_when_send_failed`` times): what was stored
        already is a duplicate, whose result is the first send's.

        ``wait_replicas`` (see ``send_orderly``): one ``WAIT`` per broker, behind that broker's
        scripts in its round trip. If some broker's replicas fall short, every broker is still
        written, then ``ReplicasBehindError`` names each that fell short.
        """
        if self._closed:
            raise closed_error("send_orderly_batch")
        wait = self._wait(wait_replicas)
        _, queues = self._route(topic)
        items = list(items)
        if dedup_keys is not None and (isinstance(dedup_keys, str) or len(dedup_keys) != len(items)):
            raise MessageError(f"dedup_keys must be a list with one key per item ({len(items)}); nothing was sent")
        prepared: list[tuple[MessageQueue, bytes, bytes, str, str | None]] = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise MessageError(f"item {i} must be a (sharding_key, body) tuple, got {item!r}"[:200])
            key, body = item
            try:
                header, msg_id, body = self._prepare(body, _key_text(key), tags, None, key_hash(key))
                mq = self._select(queues, key, body, selector)
                given = None if dedup_keys is None else dedup_keys[i]
                dkey = dedup_key_of(given, self.settings.dedup_derive, msg_id, body)
            except MessageError as exc:
                raise MessageError(f"item {i}: {exc}; nothing of this batch was sent") from None
            prepared.append((mq, header, body, msg_id, dkey))
        by_queue: dict[MessageQueue, list[int]] = defaultdict(list)
        for i, p in enumerate(prepared):
            by_queue[p[0]].append(i)
        # Each queue's items in call order, one script call per BATCH_CHUNK of them. Items with and
        # without a dedup key share a call: an item without one goes with the empty id, which the
        # dedup window does not remember (send.lua). Calls of one queue go one round trip after the
        # other (queue_rounds), so runs cut by kind once cost a round trip per alternation.
        chunks = [idxs[s:s + BATCH_CHUNK] for idxs in by_queue.values() for s in range(0, len(idxs), BATCH_CHUNK)]
        window_ms = self.settings.dedup_window_ms
        requests = []
        for idxs in chunks:
            keyed = any(prepared[i][4] is not None for i in idxs)
            requests.append(AppendRequest(prepared[idxs[0]][0], [(prepared[i][1], prepared[i][2]) for i in idxs],
                                          [prepared[i][4] or "" for i in idxs] if keyed else None,
                                          window_ms if keyed else None))
        # Sent again after an unknown outcome only if every item is deduplicated (nothing twice).
        every_keyed = bool(prepared) and all(p[4] is not None for p in prepared)
        attempts = 1 + self.settings.retry_times_when_send_failed if every_keyed else 1
        if self._sender is not None:
            self._after_async_sends()
        for attempt in range(attempts):
            try:
                replies = self.appender.append_many(requests, wait=wait)
                break
            except BrokerUnavailableError:
                self._forget_routes()
                if attempt + 1 >= attempts:
                    raise
                time.sleep(KEYED_RETRY_PAUSE[min(attempt, len(KEYED_RETRY_PAUSE) - 1)])
        results: list[SendResult | None] = [None] * len(prepared)
        for idxs, reply in zip(chunks, replies, strict=True):
            by_offset: dict[int, SendResult] = {}
            for i, off in zip(idxs, reply.offsets, strict=True):
                mq, _, _, msg_id, _ = prepared[i]
                if off in by_offset:  # the same key twice in this batch: one message, one result
                    results[i] = by_offset[off]
                elif off < reply.first_offset:  # stored by an earlier send (or attempt) of its key
                    results[i] = by_offset[off] = first_send_result(self._log, mq, off)
                else:
                    results[i] = by_offset[off] = SendResult(SendStatus.SEND_OK, msg_id, mq, off, reply.store_ms)
        return [r for r in results if r is not None]

    def send_orderly_async(
        self,
        topic: str,
        body: bytes,
        *,
        sharding_key: object,
        keys: str | list[str] | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        dedup_key: str | None = None,
    ) -> Future[SendResult]:
        """``send_orderly`` through the batching sender: a ``Future`` of its ``SendResult``.

        The sends of every thread within ``linger_ms`` (or until ``batch_size`` are pending) go
        to Redis together, one round trip per broker and one script call per queue chunk; each
        key's messages are stored in the order of the calls (``mqorder.client.batching``).

        Raised at once, in the caller's thread: what needs no Redis to check (a bad body, sharding
        key, keys, tags, properties, dedup key or topic name, a message over ``max_message_size``),
        ``BufferExhaustedError`` after ``max_block_ms`` with the buffer full, and
        ``ProducerClosedError`` after ``close()``. The future fails with what Redis or the route
        says, for its own chunk only: ``TopicNotFoundError``, ``TopicNotWritableError``,
        ``BrokerRefusedError`` (nothing of the chunk stored), ``BrokerUnavailableError`` (not
        known; a chunk whose sends all have dedup keys is retried first)... The default selector
        only; replicas are waited for as ``MQORDER_SEND_WAIT_REPLICAS`` says. ``future.cancel()``
        before the batch goes means the message is not sent.
        """
        if sharding_key is None:
            raise MessageError("send_orderly_async needs a sharding_key (e.g. the order id)")
        # A routed topic's name was checked when it was routed; anything else (a list, unhashable,
        # included) is checked before it is looked up.
        if not isinstance(topic, str) or topic not in self._routes:
            check_topic(topic, allow_dlq=True, allow_retry=True)
        hash_ = zlib.crc32(key_bytes(sharding_key))  # the default selector's: queues[hash_ % n]
        header, msg_id, body_b = self._prepare(body, keys, tags, properties, hash_)
        key = dedup_key_of(dedup_key, self.settings.dedup_derive, msg_id, body_b)
        return self._batching_sender().submit(ProducerRecord(topic, hash_, header, body_b, msg_id, key))

    def _after_async_sends(self) -> None:
        """A plain send after ``send_orderly_async`` calls still pending in this process waits until
        they are resolved: it went straight to Redis and overtook them, so a key sent async then
        sync was stored out of call order (a producer's walk-through: A, B, C stored as B, C, A).
        Not in the sender's own thread (a done-callback), which would wait for itself."""
        sender = self._sender
        if (sender is not None and sender.pid == os.getpid() and sender.accumulator.holds_any()
                and not sender.in_sender_thread()):
            sender.flush()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every ``send_orderly_async`` made before this call is resolved (what is
        pending goes at once, without lingering); ``TimeoutError`` after ``timeout`` seconds."""
        sender = self._sender
        if sender is not None and sender.pid == os.getpid():
            sender.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what ``send_orderly_async`` still holds and stop its sender, then give back the
        connections.

        ``timeout`` (seconds; None: as long as it takes): how long to wait for those sends. What
        is still unsent then fails with ``ProducerClosedError`` (nothing of it was stored) and the
        batch being written is left to the sender's thread, which resolves its futures and ends
        (Kafka's ``close(timeout)``). With Redis away the sender retries each batch, so a close
        without a timeout can take that long for every batch still held."""
        if timeout is not None:
            timeout = number_arg("timeout", timeout, 0.0, minimum=0, maximum=MAX_WAIT_MS / 1000,
                                 hint="seconds to wait for pending sends; None waits as long as it takes")
        # Under the sender lock: a first send_orderly_async either starts its sender before this
        # (and it is closed here) or finds the producer closed, never installs one after. The lock
        # is not held while the sender finishes: its callbacks may send (and are refused).
        with self._process_sender_lock():
            self._closed = True
            sender, self._sender = self._sender, None
        if sender is not None and sender.pid == os.getpid():
            # The connections go back once the sender's thread ended (at once, or after the
            # batch it still writes when the timeout ran out).
            sender.close(timeout, then=self._release)
        else:
            self._release()

    def _release(self) -> None:
        """Each sending thread's kept connection back to its pool; our own brokers closed."""
        self.appender.leases.close()
        if self._own_brokers:
            self.brokers.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _batching_sender(self) -> Sender:
        """This process's sender, started on first use; in a forked child (Celery's prefork pool)
        a new one: the parent's thread did not come along, and its pending sends stay its own."""
        sender, pid = self._sender, os.getpid()
        if sender is not None and sender.pid == pid:
            return sender
        with self._process_sender_lock():
            if self._closed:
                raise ProducerClosedError("this producer is closed: send_orderly_async refused; build a new Producer")
            sender = self._sender
            if sender is None or sender.pid != pid:
                sender = self._sender = Sender(
                    self.batching, route=lambda topic: self._route(topic)[1], appender=self.appender,
                    log_reader=self._log, dedup_window_ms=self.settings.dedup_window_ms,
                    attempts=1 + self.settings.retry_times_when_send_failed, wait=self._wait(None),
                )
        return sender

    def _process_sender_lock(self) -> threading.Lock:
        """``_sender_lock``, new in a forked child: the parent's may have been held at the fork."""
        pid = os.getpid()
        if self._sender_lock_pid != pid:
            with _FORK_LOCK:  # two threads of a child replace it once, not each its own
                if self._sender_lock_pid != pid:
                    self._sender_lock, self._sender_lock_pid = threading.Lock(), pid
        return self._sender_lock

    def _delay_ms(self, level: object) -> int:
        levels = self.settings.delay_levels_ms
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= len(levels):
            raise MessageError(
                f"delay_time_level must be an int from 0 (no delay) to {len(levels)}, got {level!r}; the levels are "
                f"{self.settings.message_delay_level!r} (MQORDER_MESSAGE_DELAY_LEVEL)"
            )
        return levels[level - 1] if level else 0

    def _send_keyed(self, mq: MessageQueue, header: bytes, body: bytes, msg_id: str, key: str,
                    wait: SendWait | None = None) -> SendResult:
        """Store once per ``key`` within the window, retrying on ``mq`` after a broker failure.

        Every attempt sends the same header (same msg id) under the same key, so whichever attempt
        Redis runs first stores the message and every other one (a retry, or a timed-out attempt
        Redis runs late, even after a later message) is a duplicate that stores nothing. So is a
        retry after too few replicas acknowledged: it stores nothing and waits for them again.
        """
        window_ms = self.settings.dedup_window_ms
        attempts = 1 + self.settings.retry_times_when_send_failed
        for attempt in range(attempts):
            try:
                reply = self.appender.append(mq, [(header, body)], ids=[key], dedup_window_ms=window_ms, wait=wait)
            except BrokerUnavailableError:
                self._forget_routes()
                if attempt + 1 >= attempts:
                    raise
                time.sleep(KEYED_RETRY_PAUSE[min(attempt, len(KEYED_RETRY_PAUSE) - 1)])
                continue
            if reply.stored:
                return _result(mq, msg_id, reply)
            return first_send_result(self._log, mq, reply.offsets[0])
        raise AssertionError("unreachable")  # pragma: no cover

    def _wait(self, wait_replicas: object) -> SendWait | None:
        """What a send waits for: ``wait_replicas`` if given, else ``MQORDER_SEND_WAIT_REPLICAS``;
        ``None`` for 0. Checked before anything is sent."""
        if wait_replicas is None:
            n = self.settings.send_wait_replicas
        else:
            try:
                n = parse_wait_replicas(wait_replicas)
            except ValueError as exc:
                raise ConfigError(f"wait_replicas={wait_replicas!r} {exc}; nothing was sent") from None
        if not n:
            return None
        timeout_ms = self.settings.send_wait_timeout_ms
        if timeout_ms >= self.settings.send_msg_timeout_ms:
            raise ConfigError(
                f"wait_replicas={n} waits up to MQORDER_SEND_WAIT_TIMEOUT_MS={timeout_ms} ms, which must be shorter "
                f"than MQORDER_SEND_MSG_TIMEOUT_MS={self.settings.send_msg_timeout_ms} ms (the socket's read would "
                "end first and a stored message be reported as not answered); lower the one or raise the other. "
                "Nothing was sent"
            )
        return SendWait(n, timeout_ms)

    def _append_single(self, mq: MessageQueue, header: bytes, body: bytes, msg_id: str,
                       wait: SendWait | None) -> SendResult:
        """One message without a dedup key: ``append_one`` (no request or reply objects: a
        trickle's path), or with a durable ``wait`` the full ``append``."""
        try:
            if wait is None:
                offset, store_ms = self.appender.append_one(mq, header, body)
                return SendResult(SendStatus.SEND_OK, msg_id, mq, offset, store_ms)
            return _result(mq, msg_id, self.appender.append(mq, [(header, body)], wait=wait))
        except BrokerUnavailableError:
            self._forget_routes()
            raise

    def _forget_routes(self) -> None:
        """After a broker did not answer: read every route again at the next send. A Redis that
        comes back without its data (restarted with no persistence, a new empty replica) has no
        topics, and the cached routes had sends acknowledged into queues of topics that no longer
        existed for up to ``ROUTE_TTL`` (an adversarial walk-through: 12 s of them)."""
        self._routes.clear()

    def _wait_delayed(self, mq: MessageQueue, wait: SendWait) -> None:
        """A delayed message waits beside its queue (``delay_schedule.lua``), not through the
        append path: ``WAIT`` in a round trip of its own, behind the fence write that makes it
        cover the schedule entry whichever connection wrote it (``mqorder.store.durable``)."""
        broker = self.brokers.get(mq.broker_name)
        targets = [(broker, delay_seq(mq.tag), 1)]
        index = self.brokers.default
        if index is not broker:
            # The mover finds delayed messages through its index on the default broker
            # (mqorder.store.indexed): a failover there that lost the entry would leave this one
            # undelivered for good. Waited for behind a fence on the topology counter, as a
            # transaction's prepare waits for its check-back index (mqorder.store.transactions).
            targets.insert(0, (index, topology_version(), 1))
        wait_after(self.appender.replicas, wait, targets, timeout=self.settings.send_msg_timeout_ms / 1000,
                   action="delayed send",
                   what={index.name: f"the delay mover's index entry of queue {mq.key} IS stored"} if index is not broker
                   else None)

    def _prepare(
        self, body: object, keys_: object, tags: object, properties: object, hash_: int | None = None
    ) -> tuple[bytes, str, bytes]:
        """Check and encode one message; ``hash_`` is its sharding key's hash (``key_hash``), stored
        for key-ordered listeners."""
        body_b = check_body(body, self.settings.max_message_size)
        msg_id = self._ids.next()
        if keys_ is not None and not isinstance(keys_, (str, list, tuple)):
            if not isinstance(keys_, int) or isinstance(keys_, bool):
                # str() of anything was stored: keys={"order": 1} as "{'order': 1}", b"k" as "b'k'".
                raise MessageError(f"keys must be a str or a list of str, got {type(keys_).__name__} {keys_!r}"[:200])
            # An int key as the number it hashes as (``selector.key_bytes``): str() of an IntEnum
            # member is its name, and the audit named the key 7 'Shop.BERLIN'.
            keys_ = int.__repr__(keys_)
        header = encode_header(msg_id, keys_, tags, properties, key_hash=hash_)
        return header, msg_id, body_b

    def _select(
        self, queues: Sequence[MessageQueue], key: object, body: bytes, selector: Selector | None
    ) -> MessageQueue:
        if key is None:
            raise MessageError("send_orderly needs a sharding_key (e.g. the order id)")
        if selector is None:
            return select_by_hash(queues, key, body)
        if not callable(selector):
            raise MessageError(f"selector must be callable, got {type(selector).__name__}")
        return resolve(selector(queues, key, body), queues)

    def _select_round_robin(self, queues: Sequence[MessageQueue], avoid: str | None) -> MessageQueue:
        n = len(queues)
        for _ in range(n):
            mq = queues[next(self._rr) % n]
            if mq.broker_name != avoid:
                return mq
        return queues[next(self._rr) % n]

    def _route(self, topic: str, for_send: bool = True) -> tuple[TopicRoute, list[MessageQueue]]:
        now = time.monotonic()
        # Only checked names are cached: a hit needs no check (a trickle of sends asks every time).
        cached = self._routes.get(topic) if isinstance(topic, str) else None
        if cached and now - cached[0] < ROUTE_TTL:
            route, queues = cached[1], cached[2]
        else:
            check_topic(topic, allow_dlq=True, allow_retry=True)
            try:
                route = self.topics.describe_topic(topic)
            except REDIS_ERRORS as exc:
                # The route is read before anything is sent: nothing was stored.
                raise self._failed(exc, "send", "Nothing was stored") from exc
            queues = route.message_queues
            with self._lock:
                self._routes[topic] = (now, route, queues)
        if for_send and not route.writable:
            raise TopicNotWritableError(
                f"topic {topic!r} is read-only (permission {route.perm!r}); nothing was sent. Allow writes "
                f"with `mqorder topic perm {topic} rw` (producers see it within {ROUTE_TTL:.0f} s)"
            )
        return route, queues

    def _failed(self, exc: Exception, action: str, outcome: str) -> Exception:
        """A failed call to the default broker (routes), as the caller's error (``translation``)."""
        b = self.brokers.default
        return translation(exc, b.name, b.safe_url, self.settings.send_msg_timeout_ms / 1000, action,
                           outcome=outcome) or exc


def closed_error(call: str) -> ProducerClosedError:
    """A send after ``close()``: refused, as Kafka's producer refuses it (it reconnected and sent,
    where ``send_orderly_async`` already refused: a use after close went unnoticed)."""
    return ProducerClosedError(f"this producer is closed: {call} refused, nothing was sent; build a new Producer")


def _key_text(sharding_key: object) -> str | None:
    """A batch item's sharding key as the message's key text: checked as a sharding key first (a
    list or a bad str was reported as ``keys``, an argument the caller never gave), a bytes key
    as its text (it was stored as "b'...'"), or no key text for bytes that are not UTF-8 (the
    key's hash, stored either way, orders it)."""
    raw = key_bytes(sharding_key)
    if isinstance(sharding_key, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return raw.decode("ascii") if isinstance(sharding_key, int) else sharding_key  # type: ignore[return-value]


def _result(mq: MessageQueue, msg_id: str, reply: AppendReply) -> SendResult:
    return SendResult(SendStatus.SEND_OK, msg_id, mq, reply.offsets[0], reply.store_ms)

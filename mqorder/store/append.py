"""``QueueAppender``: the one way messages enter a queue (producer, DLQ writer, Spark writer).

One Lua call (``send.lua``, built on the ``_append.lua`` prelude) assigns contiguous offsets,
appends to the queue's log and, in the same atomic step, wakes the owner of every subscription
whose queue has no ConsumeRequest pending. So a message is never left behind by a ConsumeRequest
that was just finishing, and a busy queue costs no extra wake-ups.

With ``ids`` the append is *idempotent*: an id already stored in that queue is skipped (and its
offset reported), atomically with the append, so a retried or duplicated writer adds nothing twice
and never reorders (DESIGN invariant 8).

With a ``SendWait`` the append is *durable*: ``WAIT`` for that many replicas follows the scripts
in the same round trip, on their connection (``mqorder.store.durable``), and a shortfall raises
``ReplicasBehindError`` once every broker of the call was written (DESIGN invariant 9).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.brokers import Broker, BrokerRegistry, group_by_broker
from mqorder.store.capacity import CapacityGuard
from mqorder.store.durable import ReplicaGate, SendWait, behind_error
from mqorder.store.failures import partly_refused, translated, translation
from mqorder.store.raw_pipe import ThreadLeases
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager
from mqorder.store.wake import WakeUp
from mqorder.tokens import new_token

#: How long the list of subscriptions of a topic is cached; a group that subscribes later is woken
#: by the sweep until then.
SUBS_TTL = 1.0
#: At most this many messages per script call (``append_entries`` unpacks the ids of one call).
MAX_PER_CALL = 1000

#: One message as stored: (header JSON bytes, body bytes).
Entry = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class AppendReply:
    """What one append stored: offsets of every given message (a duplicate's is its earlier copy's)."""

    first_offset: int
    stored: int
    store_ms: int
    offsets: list[int]
    woken: list[str]

    @property
    def duplicates(self) -> int:
        return len(self.offsets) - self.stored


@dataclass(frozen=True, slots=True)
class AppendRequest:
    """Messages for one queue; ``ids`` (one per message) makes the append idempotent.

    With ``dedup_window_ms`` the ids are producer dedup keys, remembered only that long (in the
    queue's dedup window, ``keys.queue_dedup``), not for good like the Spark writer's ids.
    """

    mq: MessageQueue
    entries: Sequence[Entry]
    ids: Sequence[str] | None = None
    dedup_window_ms: int | None = None


class QueueAppender:
    def __init__(
        self,
        brokers: BrokerRegistry,
        *,
        pending_ttl_ms: int,
        timeout: float,
        topics: TopicManager | None = None,
        action: str = "send",
        guard: CapacityGuard | None = None,
    ) -> None:
        self.brokers = brokers
        self.topics = topics or TopicManager(brokers)
        self.pending_ttl_ms = pending_ttl_ms
        #: Quoted in the error when a broker does not answer.
        self.timeout = timeout
        self.action = action
        #: Producers and the Spark writer refuse a full or evicting broker before writing
        #: (``mqorder.store.capacity``); the DLQ writer has none: moving a poison message on is
        #: part of draining a full broker.
        self.guard = guard
        #: Connected replicas per broker, checked before a durable append (``mqorder.store.durable``).
        self.replicas = ReplicaGate()
        #: Each sending thread's connection per broker, kept across sends (``ThreadLeases``).
        self.leases = ThreadLeases()
        self._subs: dict[str, tuple[float, list[str]]] = {}
        #: Each queue's keys, formatted once (a send asks for them every time).
        self._queue_keys: dict[MessageQueue, QueueSendKeys] = {}

    def append(
        self, mq: MessageQueue, entries: Sequence[Entry], *, ids: Sequence[str] | None = None,
        dedup_window_ms: int | None = None, wait: SendWait | None = None,
    ) -> AppendReply:
        """Append to one queue in one script call (``len(entries) <= MAX_PER_CALL``).

        Without a durable ``wait`` this is ``append_many`` of one request, lean: one script call
        on the thread's lease, without ``append_many``'s grouping by broker and per-request
        bookkeeping (a single plain message has ``append_one``, leaner still)."""
        req = AppendRequest(mq, entries, ids, dedup_window_ms)
        if wait is not None and wait.replicas > 0:
            return self.append_many([req], wait=wait)[0]
        _check_request(req)
        broker = self.brokers.get(mq.broker_name)
        return parse_reply(self._send(broker, req.mq, req.entries, req.ids, req.dedup_window_ms), len(entries))

    def append_one(self, mq: MessageQueue, header: bytes, body: bytes) -> tuple[int, int]:
        """One message, appended plainly (no id, no durable wait): (its offset, its store ms).

        ``append`` of one entry without its request and reply objects: a single ``send_orderly``
        comes through here, and building an ``AppendRequest`` and an ``AppendReply`` (offsets
        list, woken owners decoded) cost about 3.5 µs of a send's Python (a busy producer's CPU
        per send 0.92x without them)."""
        broker = self.brokers.get(mq.broker_name)
        reply = self._send(broker, mq, ((header, body),), None, None)
        return int(reply[0]), int(reply[1])

    def _send(self, broker: Broker, mq: MessageQueue, entries: Sequence[Entry], ids: Sequence[str] | None,
              dedup_window_ms: int | None) -> Any:
        """``send.lua`` on the calling thread's lease of ``broker``: its raw reply. Failures are
        translated (``mqorder.store.failures``) without a context manager's cost per send."""
        try:
            kl, args = self._send_args(mq, entries, ids, dedup_window_ms)  # reads the subscriptions: inside
            if self.guard is not None:
                self.guard.before_send(broker, self.action)
            return broker.scripts.call("send", kl, args, self.leases.get(broker.client))
        except Exception as exc:
            err = translation(exc, mq.broker_name, broker.safe_url, self.timeout, self.action)
            if err is None:
                raise
            raise err from exc

    def append_many(self, requests: Sequence[AppendRequest], *, wait: SendWait | None = None) -> list[AppendReply]:
        """One script call per request, pipelined per broker: one round trip per broker.

        Raises ``BrokerUnavailableError`` / ``BrokerRefusedError`` (``mqorder.store.failures``), and
        with a guard ``BrokerFullError`` / ``EvictionPolicyError`` before anything is written.

        ``wait`` (``replicas`` > 0) makes it durable: ``NotEnoughReplicasError`` before anything is
        written to any broker if one has fewer replicas connected than asked, and ``WAIT`` behind
        the scripts of each broker's round trip; if any broker's replicas fall short, every broker
        is still written, then one ``ReplicasBehindError`` names each that fell short (all of it IS
        stored on the primaries).
        """
        if wait is not None and wait.replicas <= 0:
            wait = None
        behind: list[str] = []
        replies: list[AppendReply | None] = [None] * len(requests)
        for req in requests:
            _check_request(req)
        by_broker = group_by_broker(range(len(requests)), lambda i: requests[i].mq)
        if wait is not None:
            for broker_name in by_broker:
                broker = self.brokers.get(broker_name)
                with translated(broker_name, broker.safe_url, self.timeout, self.action):
                    self.replicas.before_write(broker, wait, self.action)
        for broker_name, idxs in by_broker.items():
            broker = self.brokers.get(broker_name)
            with translated(broker_name, broker.safe_url, self.timeout, self.action):
                # Inside: the call reads the topic's subscriptions (cached a moment), a Redis read
                # that fails like the write would during a failover (it leaked redis.ConnectionError
                # to send_orderly's callers in the chaos sentinel-async run).
                call_of = {i: ("send", *self.send_call(requests[i])) for i in idxs}
                self.check_capacity(broker)
                lease = self.leases.get(broker.client)
                rounds = queue_rounds(idxs, lambda i: requests[i].mq)
                for n, rnd in enumerate(rounds):
                    calls = [call_of[i] for i in rnd]
                    try:
                        raw = self._round(broker, requests, idxs, rnd, calls, lease, wait if n + 1 == len(rounds) else None,
                                          behind)
                    except redis.ResponseError as exc:
                        stored = sum(r.stored for r in replies if r is not None)
                        ran: dict[int, Any] | None = getattr(exc, "mqorder_ran", None)
                        unknown = 0
                        if ran is not None:  # each call's reply: what ran is known
                            stored += sum(parse_reply(r, len(requests[rnd[j]].entries)).stored for j, r in ran.items())
                        else:  # per shard (a durable send on a cluster): the others may have run
                            unknown = len(calls) - 1
                        err = (partly_refused(broker_name, broker.safe_url, exc, stored, unknown, self.action)
                               if stored or unknown else None)
                        if err is None:
                            raise  # nothing of the batch stored: the refusal says so
                        raise err from exc
                    for i, reply in zip(rnd, raw, strict=True):
                        replies[i] = parse_reply(reply, len(requests[i].entries))
        if behind:
            raise behind_error(behind)
        return [r for r in replies if r is not None]

    def _round(self, broker: Broker, requests: Sequence[AppendRequest], idxs: list[int], rnd: list[int],
               calls: list[tuple[Any, ...]], lease: Any, wait: SendWait | None, behind: list[str]) -> list[Any]:
        """One round of ``append_many`` on ``broker``: ``calls`` (one per queue of ``rnd``) in one
        round trip; the last round of a durable send ends with the fence and ``WAIT``."""
        if wait is None:
            # Lean EVALSHAs (Scripts.run_many: no redis-py Pipeline, whose registered scripts cost
            # a SCRIPT EXISTS round trip first); a NOSCRIPT call stored nothing and is sent again
            # once the script is loaded.
            return broker.scripts.run_many(calls, lease)
        # An idempotent append may store nothing (every id a duplicate), and a WAIT after no write
        # waits for nothing: the fence write (mqorder.store.durable). The last round holds every
        # queue's last call, so on a Redis Cluster each shard written gets its fence and WAIT after
        # its last append (Scripts.run_many_then): each shard replicates on its own.
        fence = next((keys.queue_next(requests[i].mq.tag) for i in idxs if requests[i].ids is not None), None)
        shard_fence = _shard_fence(wait, [requests[i].mq.tag for i in rnd])
        raw, tail = broker.scripts.run_many_then(calls, wait.commands(fence), lease, then_for=shard_fence)
        acked = int(tail[-1])
        if acked < wait.replicas:
            messages = sum(len(requests[i].entries) for i in idxs)
            behind.append(self.replicas.behind(broker, wait, acked, messages, self.action))
        return raw

    def check_capacity(self, broker: Broker, action: str | None = None) -> None:
        """The guard's ``EvictionPolicyError`` / ``BrokerFullError`` before anything is written
        (what else holds messages for a queue, delayed and half messages, asks it too)."""
        if self.guard is not None:
            self.guard.before_send(broker, action or self.action)

    def subscriptions(self, topic: str) -> list[str]:
        now = time.monotonic()
        cached = self._subs.get(topic)
        if cached and now - cached[0] < SUBS_TTL:
            return cached[1]
        # Read from the default broker, often outside any caller's ``translated`` (a transaction's
        # end, the delay mover): a lost reply here once left the check-back pass as a raw TimeoutError.
        meta = self.brokers.default
        with translated(meta.name, meta.safe_url, self.timeout, self.action):
            subs = self.topics.subs_of_topic(topic)
        self._subs[topic] = (now, subs)
        return subs

    def queue_keys(self, mq: MessageQueue) -> QueueSendKeys:
        """``mq``'s keys for its append scripts, formatted once per queue: every send asks for
        them, and formatting them each time (the tag, four keys, the wake prefix, a state key and
        a wake-up payload per subscription) was most of the 10-15 µs this cache took off a
        send's 25-34 µs of Python here."""
        qk = self._queue_keys.get(mq)
        if qk is None:
            broker = self.brokers.get(mq.broker_name)
            qk = self._queue_keys[mq] = QueueSendKeys(mq, broker.is_cluster)
        return qk

    def wake_tail(self, mq: MessageQueue) -> tuple[list[str], list[Any]]:
        """The wake-up part of any script that appends to ``mq`` (``wake_owners`` in Lua): the
        state key of every subscription of the topic, and per key a fresh (token, payload) pair."""
        subs = self.subscriptions(mq.topic)
        if not subs:
            return [], []
        return self.queue_keys(mq).wake_tail(subs, new_token())

    def wake_prefix(self, mq: MessageQueue) -> str:
        """The wake channel prefix for ``mq``'s append scripts: a shard channel of the queue's slot
        on a Redis Cluster, the per-client channel elsewhere (``mqorder.keys.wake_prefix``)."""
        return self.queue_keys(mq).wake_prefix

    def send_call(self, req: AppendRequest) -> tuple[list[str], list[Any]]:
        """Keys and arguments of ``send.lua`` for one request."""
        return self._send_args(req.mq, req.entries, req.ids, req.dedup_window_ms)

    def _send_args(self, mq: MessageQueue, entries: Sequence[Entry], ids: Sequence[str] | None,
                   dedup_window_ms: int | None) -> tuple[list[str], list[Any]]:
        """``send_call`` of a request's parts (``append_one`` has no request object)."""
        qk = self.queue_keys(mq)
        state_keys, wake_args = self.wake_tail(mq)
        if ids is not None and dedup_window_ms is not None:
            kl = [qk.log, qk.next, qk.dedup, qk.dedup_expiry, *state_keys]
            args: list[Any] = [len(entries), "2", dedup_window_ms]
        else:
            kl = [qk.log, qk.next, qk.ids, *state_keys]
            args = [len(entries), "0" if ids is None else "1"]
        if ids is None:
            for h, b in entries:
                args.append(h)
                args.append(b)
        else:
            for mid, (h, b) in zip(ids, entries, strict=True):
                args.append(mid)
                args.append(h)
                args.append(b)
        args.append(self.pending_ttl_ms)
        args.append(qk.wake_prefix)
        args.extend(wake_args)
        return kl, args


class QueueSendKeys:
    """One queue's keys and wake-up payload prefixes for its append scripts, formatted once.

    The wake-up payload of a subscription is ``WakeUp(sub, mq_key, token).encode()``; only the
    token changes from send to send, so the JSON before it is encoded once per subscription list
    (a topic's subscriptions are re-read every ``SUBS_TTL``) and the token appended: a token is
    hex digits and a dot, which JSON never escapes, so the bytes are ``encode()``'s own.
    """

    __slots__ = ("tag", "mq_key", "log", "next", "ids", "dedup", "dedup_expiry", "wake_prefix", "_wake")

    def __init__(self, mq: MessageQueue, on_cluster: bool) -> None:
        tag = self.tag = mq.tag
        self.mq_key = mq.key
        self.log = keys.queue_log(tag)
        self.next = keys.queue_next(tag)
        self.ids = keys.queue_ids(tag)
        self.dedup = keys.queue_dedup(tag)
        self.dedup_expiry = keys.queue_dedup_expiry(tag)
        self.wake_prefix = keys.wake_prefix(tag if on_cluster else None)
        #: (subscriptions, their state keys, their payloads up to the token): swapped whole, so a
        #: thread never pairs one list's keys with another's payloads.
        self._wake: tuple[list[str], list[str], list[bytes]] = ([], [], [])

    def wake_tail(self, subs: list[str], token: str) -> tuple[list[str], list[Any]]:
        """The state key of each of ``subs`` and per key a (token, payload) pair: token
        ``<token>.<i>``, payload ``WakeUp(sub, mq_key, that token).encode()``. The state key list
        is shared from send to send: callers copy it into their key lists, never change it."""
        wake = self._wake
        if wake[0] is not subs and wake[0] != subs:
            # ``encode()`` with an empty token ends in ``""]``: keep up to its opening quote.
            wake = self._wake = (subs, [keys.sub_state(self.tag, s) for s in subs],
                                 [WakeUp(s, self.mq_key, "").encode()[:-2] for s in subs])
        args: list[Any] = []
        for i, head in enumerate(wake[2]):
            t = f"{token}.{i}"
            args.append(t)
            args.append(head + t.encode() + b'"]')
        return wake[1], args


def _check_request(req: AppendRequest) -> None:
    if len(req.entries) > MAX_PER_CALL:
        raise ValueError(f"at most {MAX_PER_CALL} messages per append call, got {len(req.entries)}")
    if req.ids is not None and len(req.ids) != len(req.entries):
        raise ValueError(f"{len(req.ids)} ids for {len(req.entries)} messages")


def queue_rounds(idxs: Sequence[int], queue_of: Callable[[int], Any]) -> list[list[int]]:
    """``idxs`` (calls in send order) in rounds that hold at most one call of each queue, each
    round one round trip after the other; the last round holds every queue's last call.

    Why: the calls of one round trip are not atomic together. If two calls of one queue went in
    the same round trip, Redis could refuse the first and store the second: ``NOSCRIPT`` when its
    script cache was lost (a restart, a failover to a replica) and another client loads the
    script while Redis is still reading this round trip, or ``OOM`` when memory is freed in
    between. The first would then be sent again behind the second, or fail: the queue's order
    broken. One call per queue per round trip leaves only calls of *other* queues beside a
    refused one, and the next call of its queue is not sent before it is stored. Most batches
    hold one call per queue: one round, as before.
    """
    if len(idxs) < 2:
        return [list(idxs)]
    after: dict[Any, int] = {}  # per queue, its calls met so far scanning from the last
    rank: dict[int, int] = {}
    for i in reversed(idxs):
        q = queue_of(i)
        rank[i] = after.get(q, 0)
        after[q] = rank[i] + 1
    depth = max(after.values())
    if depth == 1:
        return [list(idxs)]
    rounds: list[list[int]] = [[] for _ in range(depth)]
    for i in idxs:
        rounds[depth - 1 - rank[i]].append(i)
    return rounds


def _shard_fence(wait: SendWait, tags: list[str]) -> Callable[[int], list[tuple[Any, ...]]]:
    """For a Redis Cluster: the fence write and ``WAIT`` after a shard's last append, that append
    being the ``i``-th call (its queue's ``next`` key is on the same shard)."""
    return lambda i: wait.commands(keys.queue_next(tags[i]))


def parse_reply(reply: list[Any], n: int) -> AppendReply:
    first, store_ms, stored, dups = int(reply[0]), int(reply[1]), int(reply[2]), reply[3]
    woken = [text(w) for w in reply[4:]] if len(reply) > 4 else []
    if not dups:
        return AppendReply(first, stored, store_ms, [first] if n == 1 else list(range(first, first + n)), woken)
    dup_at = {int(dups[i]): int(dups[i + 1]) for i in range(0, len(dups), 2)}
    offsets, nxt = [], first
    for i in range(n):
        if i in dup_at:
            offsets.append(dup_at[i])
        else:
            offsets.append(nxt)
            nxt += 1
    return AppendReply(first, stored, store_ms, offsets, woken)

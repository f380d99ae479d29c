"""``append_each``: one round trip per broker, like ``QueueAppender.append_many``, with an
outcome for *each* queue request.

``append_many`` raises the first error of its round trip, as a pipeline does, and the replies of
the round trip's other calls go with it. ``send_orderly_batch`` can live with that: its caller
sent the whole batch and gets one answer for it. The batching producer cannot: a round trip
carries the sends of many callers, and each must learn what became of *its* message.

What Redis guarantees, and what this module keeps:

* each request is one ``send.lua`` call, which is atomic: stored whole or not at all. Its first
  command is a write, and a refusal (``OOM``, ``READONLY``, ``MISCONF``...) comes before anything
  is stored (``mqorder.store.failures``);
* the calls of one round trip are *not* atomic together. Redis judges each command on arrival:
  near ``maxmemory`` the first calls of a round trip can be stored and a later one refused with
  ``OOM``. One error for all of them would fail futures whose messages are stored (and a resend
  would store them twice). So each reply is read in its place: an ``AppendReply`` for a stored
  request, the producer's error (``BrokerRefusedError``...) for a refused one;
* what stops the whole round trip before anything is written (the capacity guard's
  ``BrokerFullError`` / ``EvictionPolicyError``, ``NotEnoughReplicasError``), and a broker that
  does not answer (``BrokerUnavailableError``: each request stored or not, unknown), is the same
  outcome for every request.

With a ``SendWait`` the round trip ends with the fence write and ``WAIT`` (per shard on a Redis
Cluster, behind that shard's last call: ``mqorder.store.durable``); if too few replicas
acknowledge, each request stored there becomes ``ReplicasBehindError`` (stored, not yet safe).

It builds each call with the appender's own ``send_call`` and reads each reply with
``parse_reply``, so it cannot drift from ``send.lua``'s arguments and reply
(``mqorder.store.append``). Its one user is the batching producer (``mqorder.client.batching``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from mqorder import keys
from mqorder.errors import MQOrderError
from mqorder.model import MessageQueue
from mqorder.store.append import AppendReply, AppendRequest, QueueAppender, parse_reply, queue_rounds
from mqorder.store.brokers import Broker
from mqorder.store.cluster_route import shard_groups
from mqorder.store.durable import SendWait, behind_error
from mqorder.store.failures import refused, translated, translation
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline

#: What became of one request: stored (its reply), or the error that says why not / not known.
Outcome = AppendReply | Exception


def append_each(appender: QueueAppender, broker_name: str, requests: Sequence[AppendRequest], *,
                wait: SendWait | None = None, via: ConnectionLease | None = None) -> list[Outcome]:
    """Every request (all of broker ``broker_name``) in one round trip; one outcome per request,
    in order. ``via``: the connection to use, by default the calling thread's kept one
    (``QueueAppender.leases``)."""
    if wait is not None and wait.replicas <= 0:
        wait = None
    broker = appender.brokers.get(broker_name)
    try:
        with translated(broker.name, broker.safe_url, appender.timeout, appender.action):
            if wait is not None:
                appender.replicas.before_write(broker, wait, appender.action)
            # Inside: the calls read the topic's subscriptions (cached a moment), a read that
            # fails like the write would during a failover (as in append_many).
            calls = [appender.send_call(r) for r in requests]
            appender.check_capacity(broker)
            return _round_trip(appender, broker, requests, calls, wait, via or appender.leases.get(broker.client))
    except MQOrderError as exc:
        return [exc] * len(requests)


def _round_trip(appender: QueueAppender, broker: Broker, requests: Sequence[AppendRequest],
                calls: list[tuple[list[str], list[Any]]], wait: SendWait | None,
                via: ConnectionLease) -> list[Outcome]:
    """Every request in one write, with each shard's ``WAIT`` behind its last call; or, when a
    queue has several requests here, in rounds of one call per queue (``queue_rounds``: two calls
    of one queue in one round trip could be stored out of order), then the ``WAIT``\\s in a round
    trip of their own. A request whose queue had an earlier request refused in this batch is not
    sent: it fails as that one did (nothing of it stored), so its queue keeps its order. A broker
    that stops answering fails the requests not known stored with ``BrokerUnavailableError``;
    those stored in earlier rounds stay stored, short of their ``WAIT`` if one was asked."""
    out: list[Outcome | None] = [None] * len(requests)
    rounds = queue_rounds(range(len(requests)), lambda i: requests[i].mq)
    if len(rounds) == 1:
        _one_round(appender, broker, requests, calls, wait, via, rounds[0], out)
        return [o if o is not None else RuntimeError("no reply") for o in out]
    failed: dict[MessageQueue, Exception] = {}  # per queue, the error of its request refused
    try:
        for rnd in rounds:
            todo = []
            for i in rnd:
                err = failed.get(requests[i].mq)
                if err is None:
                    todo.append(i)
                else:
                    out[i] = err
            _one_round(appender, broker, requests, calls, None, via, todo, out)
            for i in todo:
                o = out[i]
                if isinstance(o, Exception):
                    failed.setdefault(requests[i].mq, o)
        stored = [i for i, o in enumerate(out) if isinstance(o, AppendReply)]
        if wait is not None and stored:
            _wait_round(appender, broker, wait, requests, stored, via, out)
    except Exception as exc:
        err = translation(exc, broker.name, broker.safe_url, appender.timeout, appender.action)
        if err is None:
            raise
        _unknown(appender, broker, wait, requests, out, err)
    return [o if o is not None else RuntimeError("no reply") for o in out]


def _wait_round(appender: QueueAppender, broker: Broker, wait: SendWait, requests: Sequence[AppendRequest],
                stored: list[int], via: ConnectionLease, out: list[Outcome | None]) -> None:
    """After rounds: each shard's fence write and ``WAIT`` in one round trip, judged for the
    requests stored on that shard (``WAIT`` counts every write of this connection before it)."""
    pipe = RawPipeline(via)
    layout: list[tuple[list[int], int]] = []
    for idxs in shard_groups(broker.client, stored, lambda i: keys.queue_log(requests[i].mq.tag)):
        tail = wait.commands(keys.queue_next(requests[idxs[-1]].mq.tag))
        for cmd in tail:
            pipe.execute_command(*cmd)
        layout.append((idxs, len(tail)))
    replies = pipe.execute(raise_on_error=False)
    pos = 0
    for idxs, n_tail in layout:
        _judge_wait(appender, broker, wait, requests, idxs, replies[pos:pos + n_tail], out)
        pos += n_tail


def _unknown(appender: QueueAppender, broker: Broker, wait: SendWait | None, requests: Sequence[AppendRequest],
             out: list[Outcome | None], err: Exception) -> None:
    """The broker stopped answering after some rounds: what is not known stored fails with
    ``err``; what is stored, if a ``WAIT`` was asked, is stored and not known replicated."""
    stored = [i for i, o in enumerate(out) if isinstance(o, AppendReply)]
    if wait is not None and stored:
        _judge_wait(appender, broker, wait, requests, stored, [], out)
    for i, o in enumerate(out):
        if o is None:
            out[i] = err


def _one_round(appender: QueueAppender, broker: Broker, requests: Sequence[AppendRequest],
               calls: list[tuple[list[str], list[Any]]], wait: SendWait | None,
               via: ConnectionLease, todo: Sequence[int], out: list[Outcome | None]) -> None:
    """The ``EVALSHA``\\s of ``todo`` (and each shard's ``WAIT``) in one write; after ``NOSCRIPT``
    (a restarted Redis: the call ran nothing) the script is loaded and only those calls sent
    again (at most one per queue in a round: none of their queues had a later call stored)."""
    for attempt in (0, 1):
        sha = broker.scripts.send.sha
        pipe = RawPipeline(via)
        layout: list[tuple[list[int], int]] = []
        for idxs in shard_groups(broker.client, todo, lambda i: calls[i][0][0]):
            for i in idxs:
                kl, args = calls[i]
                pipe.execute_command("EVALSHA", sha, len(kl), *kl, *args)
            # The fence is the next-offset key of the group's last queue: on a cluster it routes
            # the WAIT to that shard, and it makes WAIT cover a request that stored only duplicates.
            tail = wait.commands(keys.queue_next(requests[idxs[-1]].mq.tag)) if wait is not None else []
            for cmd in tail:
                pipe.execute_command(*cmd)
            layout.append((idxs, len(tail)))
        if not layout:
            return
        replies = pipe.execute(raise_on_error=False)
        missing: list[int] = []
        pos = 0
        for idxs, n_tail in layout:
            stored: list[int] = []
            for i in idxs:
                reply = replies[pos]
                pos += 1
                if isinstance(reply, redis.exceptions.NoScriptError) and not attempt:
                    missing.append(i)
                elif isinstance(reply, redis.ResponseError):
                    out[i] = (refused(broker.name, broker.safe_url, reply, appender.action)
                              or translation(reply, broker.name, broker.safe_url, appender.timeout, appender.action)
                              or reply)
                else:
                    out[i] = parse_reply(reply, len(requests[i].entries))
                    stored.append(i)
            tail_replies = replies[pos:pos + n_tail]
            pos += n_tail
            if wait is not None and stored:
                _judge_wait(appender, broker, wait, requests, stored, tail_replies, out)
        if not missing:
            return
        broker.scripts.load("send")
        todo = missing


def _judge_wait(appender: QueueAppender, broker: Broker, wait: SendWait, requests: Sequence[AppendRequest],
                stored: list[int], tail: list[Any], out: list[Outcome | None]) -> None:
    """Too few replicas acknowledged the shard's writes: its stored requests become
    ``ReplicasBehindError`` (stored on the primary, not yet safe from a failover)."""
    acked = tail[-1] if tail else 0
    if isinstance(acked, Exception):
        acked = 0  # WAIT refused (a replica's READONLY...): nothing acknowledged
    if int(acked) >= wait.replicas:
        return
    messages = sum(len(requests[i].entries) for i in stored)
    err = behind_error([appender.replicas.behind(broker, wait, int(acked), messages, appender.action)])
    for i in stored:
        out[i] = err

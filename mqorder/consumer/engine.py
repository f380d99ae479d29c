"""``ConsumerEngine``: runs ConsumeRequests in one process, through Redis outages and queue switches.

Which request class runs a listener is a fixed table (``REQUEST_CLASSES``, by ``Ordering``): queue
order is RocketMQ's ``ConsumeRequest``; key order and concurrent listeners are its subclasses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import redis

from mqorder import keys
from mqorder.backoff import Backoff
from mqorder.consumer.concurrent_request import ConcurrentConsumeRequest
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.consumer_state import ConsumerState
from mqorder.consumer.idle_watch import ADOPT_TTL_MS, FollowUp, IdleQueueWatch
from mqorder.consumer.key_request import KeyConsumeRequest
from mqorder.consumer.listener import ListenerSpec, Ordering, get_listener
from mqorder.consumer.run_types import Outcome, Verb
from mqorder.errors import BrokerUnavailableError
from mqorder.model import MessageQueue
from mqorder.store.cluster_route import SlotMovedError
from mqorder.store.raw_pipe import ConnectionLease
from mqorder.tokens import new_token

log = logging.getLogger(__name__)

#: How long a ConsumeRequest keeps retrying through a Redis outage before leaving it to the sweep.
REDIS_RETRY_BUDGET_S = 120.0
#: First and longest pause between two of those retries (doubling in between).
REDIS_RETRY_FIRST_S = 0.25
REDIS_RETRY_CAP_S = 5.0

#: The kind of run each listener ordering gets.
REQUEST_CLASSES: dict[Ordering, type[ConsumeRequest]] = {
    Ordering.QUEUE: ConsumeRequest,
    Ordering.KEY: KeyConsumeRequest,
    Ordering.CONCURRENT: ConcurrentConsumeRequest,
}


def request_class(spec: ListenerSpec) -> type[ConsumeRequest]:
    """``ConsumeRequest`` for RocketMQ's queue order (the default), ``KeyConsumeRequest`` for a
    listener with ``ordering="key"``, ``ConcurrentConsumeRequest`` for ``@concurrent_listener``."""
    return REQUEST_CLASSES[spec.ordering]


class ConsumerEngine(ConsumerState):
    """The per-process consumer state (``ConsumerState``) and the loop that runs a request."""

    def run(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str, execution: str = "") -> Outcome | None:
        """Run one ConsumeRequest; through a Redis outage, retry in process with backoff.

        Nothing past the last fenced commit was persisted, so re-running from the committed offset
        is safe. The same ``runner`` id lets this execution re-enter its own run mark after Redis
        comes back (a duplicate delivery of the task, with another runner id, cannot). The Celery
        broker is usually the same Redis, so a re-publish would fail too. Returns None when Redis
        stayed unreachable for ``REDIS_RETRY_BUDGET_S``: the sweep re-dispatches once it is back.

        A drained run that lingers watches the client's other idle queues too (``IdleQueueWatch``);
        when one gets messages first, the run ends and that queue runs next here, in the same task
        and pool slot. The outcome is then about the last queue run (``Outcome.queue``), and
        ``follow_ups`` lists the requests to send for the others.

        ``execution`` (the Celery task id) starts this execution's runner id (``<execution>/...``):
        if the process dies mid-run, the worker's main process ends the run it left by that
        prefix (``ClientInstance.abandon_runs``) instead of waiting out the run lease.
        """
        # One connection for every round trip of this execution (its chain of switches stays on
        # one broker: an IdleQueueWatch watches one broker's queues); each run pins its queue on
        # it (on a cluster its slot stays on one node, a failover is a Redis error).
        lease = ConnectionLease(self.brokers.get(mq.broker_name).client)
        try:
            return self._run_chain(spec, sub, mq, token, lease, execution)
        finally:
            lease.release()
            self.note_lingering(False)

    def _run_chain(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str,
                   lease: ConnectionLease, execution: str = "") -> Outcome | None:
        runner = f"{execution}/{new_token()}" if execution else new_token()
        first, first_sub, first_spec = mq, sub, spec
        watch: IdleQueueWatch | None = None
        follow_ups: list[FollowUp] = []
        consumed = 0
        prior: ConsumeRequest | None = None
        while True:
            req, outcome = self._run_one(spec, sub, mq, token, runner, watch, prior, lease)
            if outcome is None:
                return None  # Redis stayed down: adoptions lapse, the sweep re-dispatches
            consumed += outcome.consumed
            watch = req.watch
            if req.prior_follow_up is not None:
                # The queue the switch left needs a request (it was reassigned meanwhile): this
                # run did not linger, so the chain stops here and the caller sends it.
                follow_ups.append(req.prior_follow_up)
                break
            prior = None
            if outcome.verb is Verb.SWITCHED:
                # The switch the usual way: the next run ends this one (req.prior) and registers
                # the queue left with the watch.
                assert req.switch_to is not None and watch is not None
                prior = req
                if req.switch_sub != sub or req.switch_to.topic != spec.topic:
                    spec = self._listener_of(req.switch_sub, req.switch_to, spec, first_spec)
                # (else: the same group and topic, so the same listener: the trickle's usual switch)
                sub, mq, token = req.switch_sub, req.switch_to, watch.token
                continue
            if req.switch_to is None or watch is None or outcome.needs_dispatch:
                # No switch; or the queue just left got messages between the read and the end of
                # its run and needs a request now, which only the caller can send: stop chaining
                # (the queue switched to is released below and gets its own request).
                break
            # The lingering read found messages on an adopted idle queue: this run ended (its own
            # queue drained, and adopted by the watch when finish.lua could), that queue runs next
            # in this same task, with the adoption token.
            watch.switched(sub, mq, req.switch_sub, req.switch_to,
                           req.adopted_at if outcome.verb is Verb.ADOPTED else None, req.adopted_backlog)
            sub, mq, token = req.switch_sub, req.switch_to, watch.token
            spec = self._listener_of(sub, mq, spec, first_spec)
        if watch is not None:
            try:
                follow_ups.extend(watch.release(lease))
            except (redis.RedisError, BrokerUnavailableError) as exc:
                # Not ended, or ended with their replies lost: an adoption lapses within
                # ADOPT_TTL_MS, a request the lost reply asked for within pending_ttl_ms; then the
                # sweep dispatches whatever has a backlog.
                log.warning("could not end the adoptions of %s (%s); their queues wait for the sweep "
                            "(within %d ms of lapsing)", sub, exc,
                            max(ADOPT_TTL_MS, watch.pending_ttl_ms))
        if watch is None or (mq is first and sub == first_sub and not follow_ups and consumed == outcome.consumed):
            return outcome  # nothing to add: the run stayed on the task's own queue
        # The outcome is about the last queue run (a REQUEUE's token is that queue's): it always
        # names it once the run switched, even if nothing was consumed before (once a bug: the
        # caller sent a suspended queue's token to the task's own queue, where it was stale).
        return replace(outcome, consumed=consumed, follow_ups=tuple(follow_ups), queue=mq, sub=sub)

    def _run_one(self, spec: ListenerSpec, sub: str, mq: MessageQueue, token: str, runner: str,
                 watch: IdleQueueWatch | None, prior: ConsumeRequest | None = None,
                 lease: ConnectionLease | None = None) -> tuple[ConsumeRequest, Outcome | None]:
        """Run one request on ``mq``, and again after a Redis error (the same ``runner``), with
        backoff, for up to ``REDIS_RETRY_BUDGET_S``; (the last request made, its outcome or None).

        ``prior``: the run this chain switched from, which the request ends in its first round
        trip (``ConsumeRequest._check``). Once an attempt has ended it (``req.prior`` is None: its
        ``finish.lua`` ran, with the attempt's ``begin.lua`` or in ``switch.lua`` behind the
        lingering read), a retry must not end it again: the finish would answer STALE, and the
        request the queue left needs (``prior_follow_up``: reassigned meanwhile, HANDOVER or
        DISPATCH) would be lost with the failed attempt, so the queue would wait out
        ``pending_ttl_ms`` and a sweep. Retries then run without the prior and carry the follow-up
        (``_carry_prior_follow_up``), which ``_run_chain`` sends as the first attempt would have.
        A watch the failed attempt made (``watch`` None) is kept for the retries too. An attempt
        that failed in its ``finish.lua`` is retried by sending that call again
        (``ConsumeRequest.finish_again``), not by beginning a new run.
        """
        backoff = Backoff(first=REDIS_RETRY_FIRST_S, cap=REDIS_RETRY_CAP_S)
        waited = 0.0
        cls = request_class(spec)
        carried: FollowUp | None = None
        ending: ConsumeRequest | None = None
        moves = 0
        while True:
            if ending is None:
                req = cls(self, spec, sub, mq, token, runner=runner, watch=watch, prior=prior, lease=lease)
                if carried is not None:
                    self._carry_prior_follow_up(req, carried)
            try:
                if ending is not None:
                    return ending, ending.finish_again()
                return req, req.run()
            except (redis.RedisError, BrokerUnavailableError) as exc:
                if ending is None and req.finishing is not None:
                    # Its finish.lua may have run: only the same call again learns what it decided.
                    ending = req
                if prior is not None and req.prior is None:
                    # This attempt ended the prior run (and registered the switch with the watch):
                    # the next one begins its own queue only, and keeps what the end asked for.
                    prior, carried = None, req.prior_follow_up
                if watch is None and req.watch is not None:
                    # The attempt made the chain's watch, whose adoptions are in Redis: the retry
                    # keeps it, so the chain's end releases them (finish.lua with its token). Once
                    # a bug: a lingering read's switch.lua ran (this queue handed to the watch, an
                    # adopted one begun) and its reply was lost; the retry of this queue was STALE,
                    # the watch was dropped, and the queue begun kept its run mark, unconsumed and
                    # out of the sweep's reach, for the whole run lease (60 s).
                    watch = req.watch
                if waited >= REDIS_RETRY_BUDGET_S:
                    log.error("ConsumeRequest %s %s: Redis unreachable for %.0fs (%s); the sweep will "
                              "re-dispatch when it is back", sub, mq.key, waited, exc)
                    return req, None
                # A slot that moved is served already (a failover done): start over at once, a
                # few times (a map that keeps moving backs off like any other error).
                moved = isinstance(exc, SlotMovedError)
                moves += moved
                delay = 0.0 if moved and moves <= 3 else backoff.next()
                log.warning("ConsumeRequest %s %s: Redis error (%s); retrying in %.2fs", sub, mq.key, exc, delay)
                time.sleep(delay)
                waited += delay

    @staticmethod
    def _carry_prior_follow_up(req: ConsumeRequest, follow_up: FollowUp) -> None:
        """A retry of a request whose failed attempt ended the prior run: the request that run's
        queue needs is this one's to return, as ``ConsumeRequest._after_prior`` set it on the
        attempt, and, as there, the request does not linger (the caller sends the follow-up
        once the run returns, so it must not wait for a linger to end)."""
        req.prior_follow_up = follow_up
        req.linger_s = 0.0

    @staticmethod
    def _listener_of(sub: str, mq: MessageQueue, *known: ListenerSpec) -> ListenerSpec:
        """The listener of a queue (of subscription ``sub``) a lingering run switched to. The watch
        spans every group of the process, and a subscription may span several topics (a group with
        listeners for two topics, or a concurrent group's retry topic): each queue runs with its
        own group's and topic's listener and kind of run (a bug once: the queue switched to ran
        with the lingering run's listener). The watch adopts only queues with a listener here
        (``idle_watch``). ``known``: the listeners of the chain's last run and of its task, looked
        at first."""
        group = keys.group_of_sub(sub)
        for spec in known:
            if mq.topic == spec.topic and group == spec.group:
                return spec
        other = get_listener(group, mq.topic)
        if other is None:  # pragma: no cover - unregistered since the watch adopted it
            raise RuntimeError(f"no listener of group {group!r} for topic {mq.topic!r} in this process")
        return other

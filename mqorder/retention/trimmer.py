"""``RetentionTrimmer``: enforces every topic's retention rule, in bounded chunks.

A pass walks every topic, resolves its rule (``mqorder.retention.policy``), and runs ``trim.lua``
on each queue, pipelined per broker: each call removes at most ``MQORDER_RETENTION_TRIM_CHUNK``
entries (a few ms of Redis time), and queues that still have more due get another call in the
next round. Workers run a pass from their housekeeping every ``MQORDER_RETENTION_INTERVAL_MS``
(``ClientInstance``); a short Redis mutex lets one worker per interval do it. The mutex is only an
economy: the script decides atomically from what it reads, so any number of trimmers at once is
safe (``mqorder retention run`` ignores it).

Under the ``consumed`` policy, who holds a queue's data back is decided here and read in the
script: every subscription of the topic (clustering groups and broadcast clients) that a live
client consumes, or that one consumed less than ``retention_ms`` ago (``keys.retention_seen``).
The script reads their committed offsets itself, in the same atomic step as the trim, so an
offset cannot move between the read and the trim.

The consumption ledger (``mqorder:ledger:<group>``) is trimmed too: its entry ids are times, so
records older than the default ``retention_ms`` go with ``XTRIM MINID`` (on top of its length cap).

A topic with queues on a broker this process does not know (not in ``MQORDER_BROKERS``: another
application's broker, or a worker started without it) is left out of the pass, with one WARNING
per topic, and the rest is trimmed: it once failed the whole pass, every pass, so nothing was
trimmed anywhere and each worker logged a traceback every ``MQORDER_RETENTION_INTERVAL_MS``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mqorder import keys
from mqorder.errors import ConfigError
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.membership import ClientRegistry, redis_now_ms
from mqorder.retention.policy import RetentionPolicy, RetentionRule
from mqorder.settings import Settings
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager, TopicRoute

log = logging.getLogger(__name__)

#: Most trim rounds in one pass: with the default chunk, 50,000 entries per queue per pass; the
#: next pass goes on where this one stopped.
MAX_ROUNDS = 100
#: A worker's pass stops starting rounds after this long: it runs in the client's duty thread,
#: beside the heartbeat, and a huge first backlog is worked off over several passes.
HOUSEKEEPING_BUDGET_S = 0.5


@dataclass
class QueueTrim:
    """What a pass did to one queue."""

    trimmed: int = 0
    first: int = 0
    next: int = 0


@dataclass
class TrimReport:
    """One pass: entries removed per queue, holders per topic, how long it took."""

    queues: dict[str, QueueTrim] = field(default_factory=dict)
    rules: dict[str, RetentionRule] = field(default_factory=dict)
    holders: dict[str, list[str]] = field(default_factory=dict)
    ledger_trimmed: int = 0
    calls: int = 0
    took_ms: float = 0.0
    skipped: bool = False  # another worker holds this interval's pass
    #: Queues not called this pass: an earlier call showed nothing could go before now.
    quiet_skipped: int = 0
    #: Topics left out of this pass: topic -> the brokers of its route this process does not know.
    unknown_brokers: dict[str, list[str]] = field(default_factory=dict)
    #: Broadcasting lanes taken out of their topics' subscribers: their workers gone too long.
    forgotten_lanes: int = 0

    @property
    def trimmed(self) -> int:
        return sum(q.trimmed for q in self.queues.values())

    def by_topic(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for key, q in self.queues.items():
            out[keys.parse_queue_key(key)[0]] += q.trimmed
        return dict(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "trimmed": self.trimmed, "by_topic": self.by_topic(), "ledger_trimmed": self.ledger_trimmed,
            "calls": self.calls, "quiet_skipped": self.quiet_skipped, "took_ms": round(self.took_ms, 1),
            "skipped": self.skipped, "unknown_brokers": self.unknown_brokers,
            "rules": {t: r.to_json() for t, r in self.rules.items()},
            "holders": self.holders,
            "queues": {k: {"trimmed": q.trimmed, "first": q.first, "next": q.next} for k, q in self.queues.items()},
        }


class RetentionTrimmer:
    def __init__(self, brokers: BrokerRegistry, settings: Settings) -> None:
        self.brokers = brokers
        self.settings = settings
        self.topics = TopicManager(brokers, settings.retention_defaults)
        self.registry = ClientRegistry(brokers.meta, settings.heartbeat_timeout_ms)
        #: Queues a call showed nothing can be trimmed from for a while: queue key -> (the call's
        #: keys and arguments, monotonic time until which the same call trims nothing). A worker's
        #: passes skip them: an idle deployment's queues otherwise cost one ``trim.lua`` call each
        #: every ``MQORDER_RETENTION_INTERVAL_MS``, for nothing (issue 27's idle cost).
        self._quiet: dict[str, tuple[tuple[Any, ...], float]] = {}
        #: Topics already warned about for an unknown broker: once per topic, not every pass.
        self._warned_unknown: set[str] = set()

    def run_if_due(self, client_id: str) -> TrimReport:
        """A pass, unless another worker runs this interval's (housekeeping calls this)."""
        hold_ms = max(1, int(self.settings.retention_interval_ms * 0.9))
        if not self.brokers.meta.set(keys.retention_pass(), client_id, nx=True, px=hold_ms):
            return TrimReport(skipped=True)
        return self.run(budget_s=HOUSEKEEPING_BUDGET_S)

    def run(self, topics: list[str] | None = None, *, budget_s: float | None = None) -> TrimReport:
        """One pass over ``topics`` (default: every topic); with ``budget_s``, no new round of
        calls starts after that long (each call is bounded by the chunk anyway)."""
        t0 = time.perf_counter()
        deadline = t0 + budget_s if budget_s is not None else None
        report = TrimReport()
        meta = self.brokers.meta
        now = redis_now_ms(meta)
        live = self._live_subs(now)
        names = topics if topics is not None else self.topics.list_topics()
        work: list[tuple[MessageQueue, RetentionRule, list[str]]] = []
        # Every topic's route, subscriptions and last-seen times in a few round trips, not a few
        # per topic (64 topics: ~190 round trips per pass before, issue 27's idle cost).
        routes = self.topics.describe_topics(names)  # a topic deleted since it was listed is left out
        routes = self._known_brokers_only(routes, report)
        rules: dict[str, RetentionRule] = {}
        for topic, route in routes.items():
            try:
                rules[topic] = route.retention.resolve(self.settings.retention_defaults)
            except ConfigError as exc:
                log.warning("topic %s: stored retention is not usable (%s); using the defaults", topic, exc)
                rules[topic] = self.settings.retention_defaults
        holders_of = self._holders({t: r for t, r in rules.items() if r.policy is RetentionPolicy.CONSUMED}, live, now)
        report.forgotten_lanes = self._forget_lapsed_broadcast_lanes(rules, live, now)
        for topic, route in routes.items():
            rule, holders = rules[topic], holders_of.get(topic, [])
            report.rules[topic] = rule
            report.holders[topic] = holders
            work.extend((mq, rule, holders) for mq in route.message_queues)
        if topics is None:  # forget queues that are gone (a deleted topic)
            live_keys = {mq.key for mq, _, _ in work}
            self._quiet = {k: v for k, v in self._quiet.items() if k in live_keys}
        self._trim_queues(work, report, deadline)
        report.ledger_trimmed = self._trim_ledgers(now)
        report.took_ms = (time.perf_counter() - t0) * 1000
        if report.trimmed:
            log.info("retention: trimmed %d messages (%s) in %d calls, %.1f ms", report.trimmed,
                     ", ".join(f"{t} {n}" for t, n in report.by_topic().items() if n), report.calls, report.took_ms)
        return report

    def _known_brokers_only(self, routes: dict[str, TopicRoute], report: TrimReport) -> dict[str, TopicRoute]:
        """``routes`` without the topics that have a queue on a broker this process does not know
        (listed in ``report.unknown_brokers``, and warned about once per topic)."""
        known = set(self.brokers.names)
        out = {}
        for topic, route in routes.items():
            unknown = sorted({mq.broker_name for mq in route.message_queues} - known)
            if not unknown:
                out[topic] = route
                continue
            report.unknown_brokers[topic] = unknown
            if topic not in self._warned_unknown:
                self._warned_unknown.add(topic)
                log.warning(
                    "retention: topic %s is not trimmed here: its queues are on broker(s) %s, which this process "
                    "does not know (known: %s). Name %s in MQORDER_BROKERS ('{\"%s\": \"redis://host:6379/0\"}') "
                    "on the workers that should trim it; the other topics are trimmed",
                    topic, ", ".join(unknown), ", ".join(sorted(known)), "them" if len(unknown) > 1 else "it",
                    unknown[0])
        return out

    # -- who holds data back (consumed policy) -------------------------------------------------

    def _live_subs(self, now: int) -> set[str]:
        """Subscription ids some live client consumes now; their last-seen time is brought up to date."""
        clients, _, _ = self.registry.clients()
        live: set[str] = set()
        for c in clients:
            for s in c.subscriptions:
                live.add(keys.broadcast_sub(s.group, c.client_id) if s.model is MessageModel.BROADCASTING else s.group)
        if live:
            seen: dict[Any, Any] = dict.fromkeys(live, now)
            self.brokers.meta.hset(keys.retention_seen(), mapping=seen)
        return live

    def _holders(self, rules: dict[str, RetentionRule], live: set[str], now: int) -> dict[str, list[str]]:
        """Per topic of ``rules`` (its rule), the subscriptions whose unconsumed messages must stay:
        live ones, and those last seen less than ``retention_ms`` ago. One never seen yet counts
        from now (a group that subscribed while no worker ran holds for a whole retention before
        it lapses)."""
        subs_of = self.topics.subs_of_topics(list(rules))
        every = sorted({s for subs in subs_of.values() for s in subs})
        if not every:
            return {t: [] for t in rules}
        meta = self.brokers.meta
        seen_raw = dict(zip(every, meta.hmget(keys.retention_seen(), every), strict=True))
        out: dict[str, list[str]] = {}
        first_seen: dict[Any, Any] = {}
        for topic, rule in rules.items():
            holders = out[topic] = []
            for sub in subs_of[topic]:
                if sub in live:
                    holders.append(sub)
                    continue
                raw = seen_raw[sub]
                seen = int(raw) if raw is not None else now
                if raw is None:
                    first_seen[sub] = now
                if now - seen < rule.retention_ms:
                    holders.append(sub)
        if first_seen:
            meta.hset(keys.retention_seen(), mapping=first_seen)
        return out

    def _forget_lapsed_broadcast_lanes(self, rules: dict[str, RetentionRule], live: set[str], now: int) -> int:
        """Take out of its topic's subscribers a broadcasting lane whose worker has been gone
        longer than the topic's ``retention_ms``: it holds nothing back any more, and lanes of
        worker names never seen again (pods of a Deployment, autoscaled workers) piled up in every
        pass, ``status`` and replay check. Its offsets stay, so a worker that comes back under the
        name resumes (past what retention trimmed, counted as skipped)."""
        subs_of = self.topics.subs_of_topics(list(rules))
        lanes = sorted({s for subs in subs_of.values() for s in subs if keys.BROADCAST_SEP in s and s not in live})
        if not lanes:
            return 0
        seen = dict(zip(lanes, self.brokers.meta.hmget(keys.retention_seen(), lanes), strict=True))
        gone = 0
        for topic, subs in subs_of.items():
            for sub in subs:
                raw = seen.get(sub)
                if raw is not None and now - int(raw) >= rules[topic].retention_ms:
                    self.topics.remove_sub(topic, sub)
                    gone += 1
                    log.info("retention: broadcasting lane %s of topic %s forgotten: its worker has been gone longer "
                             "than retention_ms", sub, topic)
        return gone

    # -- the trimming ----------------------------------------------------------------------------

    def _trim_queues(self, work: list[tuple[MessageQueue, RetentionRule, list[str]]], report: TrimReport,
                     deadline: float | None) -> None:
        chunk = self.settings.retention_trim_chunk
        for broker_name, items in group_by_broker(work, lambda w: w[0]).items():
            scripts = self.brokers.get(broker_name).scripts
            pending = items
            for _ in range(MAX_ROUNDS):
                if not pending or (deadline is not None and time.perf_counter() > deadline):
                    break
                # A quiet queue is skipped before its call is built: an idle pass then costs a dict
                # lookup per queue, not its keys, arguments and signature (issue 27's idle cost).
                now = time.monotonic()
                todo: list[tuple[tuple[MessageQueue, RetentionRule, list[str]], str, tuple[Any, ...]]] = []
                sigs: dict[tuple[int, int], tuple[Any, ...]] = {}  # a topic's queues share rule and holders
                for item in pending:
                    shared = (id(item[1]), id(item[2]))
                    sig = sigs.get(shared)
                    if sig is None:
                        sig = sigs[shared] = _signature(item[1], item[2], chunk)
                    key = item[0].key
                    if not self._skips(key, sig, now):
                        todo.append((item, key, sig))
                calls = [_call(mq, rule, holders, chunk) for (mq, rule, holders), _, _ in todo]
                replies = scripts.run_pipelined("trim", calls) if calls else []
                report.calls += len(todo)
                report.quiet_skipped += len(pending) - len(todo)
                more = []
                now = time.monotonic()
                for (item, key, sig), reply in zip(todo, replies, strict=True):
                    trimmed, first, nxt, again, quiet_ms = (int(x) for x in reply)
                    q = report.queues.setdefault(key, QueueTrim())
                    q.trimmed += trimmed
                    q.first, q.next = first, nxt
                    if quiet_ms > 0:
                        self._quiet[key] = (sig, now + quiet_ms / 1000)
                    else:
                        self._quiet.pop(key, None)
                    if again:
                        more.append(item)
                pending = more

    def _skips(self, queue_key: str, sig: tuple[Any, ...], now: float) -> bool:
        """Whether the last call showed that a call of signature ``sig`` (``_signature``) cannot
        trim ``queue_key`` before a time still ahead: same holders and rule only; any change is
        checked now."""
        seen = self._quiet.get(queue_key)
        return seen is not None and seen[1] > now and seen[0] == sig

    def _trim_ledgers(self, now: int) -> int:
        """Ledger records older than the default retention (their ids are ``<ms>-<seq>``)."""
        groups = list(self.topics.groups())
        if not groups:
            return 0
        cutoff = now - self.settings.retention_ms
        total = 0
        for name in self.brokers.names:
            pipe = self.brokers.get(name).client.pipeline(transaction=False)
            for g in groups:
                pipe.xtrim(keys.ledger(g), minid=cutoff, approximate=True, limit=self.settings.retention_trim_chunk * 10)
            total += sum(int(n or 0) for n in pipe.execute())
        return total


def _call(mq: MessageQueue, rule: RetentionRule, holders: list[str], chunk: int) -> tuple[list[str], list[Any]]:
    tag = mq.tag
    state_keys = [keys.sub_state(tag, s) for s in holders]
    # 'consumed' with nobody holding the topic follows 'time' (policy module docstring).
    policy = RetentionPolicy.CONSUMED if rule.policy is RetentionPolicy.CONSUMED and holders else RetentionPolicy.TIME
    return (
        [keys.queue_log(tag), keys.queue_next(tag), keys.queue_ids(tag), *state_keys],
        [policy.value, rule.retention_ms, rule.retention_min_ms, rule.retention_max_messages, chunk],
    )


def _signature(rule: RetentionRule, holders: list[str], chunk: int) -> tuple[Any, ...]:
    """What a queue's ``trim.lua`` call (``_call``: its keys and arguments) depends on besides the
    queue's own data and the clock: the rule (policy and limits), the holders (their state keys)
    and the chunk. Built without the call, so a skipped queue costs no keys."""
    return (rule, tuple(holders), chunk)


def first_offsets(brokers: BrokerRegistry, mqs: list[MessageQueue]) -> dict[MessageQueue, int]:
    """The first stored offset of each queue (its next offset when it holds nothing)."""
    out: dict[MessageQueue, int] = {}
    for broker, group in group_by_broker(mqs).items():
        pipe = brokers.get(broker).client.pipeline(transaction=False)
        for mq in group:
            pipe.xrange(keys.queue_log(mq.tag), count=1)
            pipe.get(keys.queue_next(mq.tag))
        replies = pipe.execute()
        for i, mq in enumerate(group):
            head, nxt = replies[2 * i], replies[2 * i + 1]
            out[mq] = int(text(head[0][0]).split("-", 1)[0]) if head else int(nxt or 0)
    return out

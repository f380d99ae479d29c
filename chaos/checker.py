"""The checker: reads the structured records of one scenario (``chaos.records``: the listener's
ledger, the refused commits, the beats' publishes) with the producer's acks, the fault log, the
lock-table samples and the DLQ, and reports order violations, losses, duplicates, overlaps and
failover times. It parses no log line and no delimited text: every proof rests on named fields
written by the listener and by the engine's ``consume_refused`` hook. It only reads; nothing here
is tuned to make a run pass.

Definitions (all per the chaos issue):

* **order violation**: for a key, a successful handling of seq n+1 before seq n was ever handled
  (which covers a gap: n+2 handled while n+1 never was); or, inside one ConsumeRequest run, an
  offset handed out that is not above the previous one;
* **lost**: an acknowledged send never handled successfully (poison: never reaching the DLQ);
  with ``appendfsync everysec`` a loss within the last second of acknowledged sends before a
  Redis kill is reported apart (``lost_fsync``), and so is the gap it leaves in its key;
* **duplicate**: a successful handling of a (key, seq) already handled. A second stored copy of a
  send that raised (``unknown``) is a *copy*; a redelivery of the same offset must start within
  ``DUP_WINDOW`` s after the end of a fault and number at most one pull batch per queue per fault;
* **overlap**: two listener calls on one queue from different processes at the same time. Allowed
  only when the stale call (the lower epoch; at one epoch, the older run) had its commit refused
  (a ``FENCED`` refusal record for its queue and epoch, or, for a run replaced at the same epoch, a
  ``SUPERSEDED`` record on its queue at or after its start) and ``ctx.still_owner()`` returned
  False in it — or True to a question asked before the queue was known to have a newer owner
  (``Replaced``: Redis answers at some moment between the question and its return, and a process
  paused in between reads a True that was right when it was given). Two *clients* calling one
  queue at one epoch are never allowed: that epoch was granted twice;
* **stale call**: a call that started after a newer epoch of its queue had already been used;
  ``ctx.still_owner()`` must have said False in it, and its commit must have been refused;
* **call after a refusal**: a listener call of a ConsumeRequest run that started after that run's
  commit (or lease touch) was refused: a refused run must stop, the new owner redelivers;
* **key order** (scenarios whose listener has ``ordering="key"``): read "key" for "queue" in the
  run and overlap rules: inside one run, the offsets of each key go up (keys interleave); an
  overlap is two calls of one *key* at the same time, from any processes or threads (calls of
  different keys of a queue may overlap); redeliveries per queue per fault are bounded by what a
  key-ordered run may finish between two commits (``dup_bound``) instead of one pull batch;
* **concurrent** (the ``concurrent`` scenario, ``@concurrent_listener``): no order rule at all;
  an overlap is two calls of one *message* at the same time; redeliveries per queue per fault
  are bounded like key order's; "nothing skipped" is the loss rule (every acknowledged send
  handled successfully, whatever the committed offsets said);
* **failover**: for each queue a killed worker owned, the time from the kill to the start of the
  first listener call on that queue by another process (another client, or the killed worker's
  restarted incarnation if it got the queue back first);
* **failover of the Redis primary** (the ``sentinel-*`` scenarios: ``chaos.failover_checks``):
  loss windows around each failover, consumption resumed per queue per failover, the epoch fence
  across it (no epoch used by two clients, epochs after a promotion above those before it, lost
  grants never back), redeliveries of commits the promoted replica lacked. A *same-epoch overlap*
  (two clients, or two runs not superseded, calling one queue at one epoch) is a violation
  whatever happened; *two epochs overlapping after a failover* is the documented lapse of
  invariant 2, allowed under the overlap rule above (the stale call refused and told so);
* **several groups** (``groups-kill``: other consumer groups in the same workers, one sharing the
  chaos topic): every rule above holds for each group on its own records (its calls, its
  refusals, its lock-table samples, the acks of its topic, its owned queues of each kill:
  ``group_events``), and the run fails if any group's check does (``merge_groups``). Besides, a
  group's listener must never have handled a message that was not sent to its topic (a
  *stranger*: another topic's queue run with this group's listener).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from chaos import failover_checks as fo
from chaos.evidence import Event, Sample
from chaos.records import FENCED, SUPERSEDED, Entry, Published, Refusal
from chaos.traffic import Ack, Poison

#: A redelivery must start within this many seconds after the end of a fault to be "after" it.
DUP_WINDOW = 30.0
#: Everysec may lose the acknowledged sends of this last second before a Redis kill.
FSYNC_WINDOW = 1.0
#: Extra time allowed, beyond retries x suspend, for a poison message to stop blocking its queue.
POISON_SLACK = 3.0
#: Pauses of a queue longer than this are listed with the event that preceded them.
LONG_STALL = 5.0
#: Slack over pending TTL + two sweep intervals for a queue to resume after its task was lost.
STALL_SLACK = 3.0
#: A queue must not go this long without a listener call while beat is down.
BEAT_OUTAGE_MAX_GAP = 5.0

#: The beat task whose publishes the beat checks count.
REBALANCE_TASK = "mqorder.rebalance"


@dataclass
class RunData:
    scenario: str
    fsync: str
    entries: list[Entry]
    acks: list[Ack]
    unknown: list[tuple[str, int, float, str]]
    poison: list[Poison]
    dlq: list[dict[str, str]]
    events: list[Event]
    samples: list[Sample]
    #: Refused commits and touches, as the engine reported them to the listener's hook.
    refusals: list[Refusal]
    #: Tasks published by the beats, and the beats' roles in the order they were started.
    published: list[Published]
    beats: list[str]
    drained: bool
    batch: int
    max_reconsume: int
    suspend_s: float
    #: Scenario-specific checks to enforce: "failover_target", "poison_bound", "beat", "stall_bound",
    #: "child_kill_bound".
    enforce: set[str] = field(default_factory=set)
    #: The run's MQORDER_PENDING_TTL_MS and MQORDER_SWEEP_INTERVAL_MS, in seconds like every time here.
    pending_ttl_s: float = 10.0
    sweep_interval_s: float = 2.0
    failover_target: float = 5.0
    #: The listener's ordering: "queue" (RocketMQ's), "key" (``key_request``) or "concurrent"
    #: (``@concurrent_listener``); see the module docstring for what changes in the checks.
    ordering: str = "queue"
    #: Key order: most redeliveries allowed per queue per fault (0: one pull batch, ``batch``).
    dup_bound: int = 0
    #: ``wait_replicas`` of the traffic's sends (Sentinel scenarios): 0 means a failover may lose
    #: what was acknowledged within ``failover_checks.REPLICATION_WINDOW`` before it.
    send_wait: int = 0
    #: ``redis_failover`` check: p99 of "consumption resumed" after a primary failover, seconds.
    redis_failover_target: float = fo.REDIS_FAILOVER_TARGET
    #: The consumer group these records are of, in a run with several (``groups-kill``); "" in a
    #: run of the chaos group alone. Set, it adds the stranger check (``_strangers``).
    group: str = ""


@dataclass
class Result:
    scenario: str
    fsync: str = ""
    produced: int = 0
    unknown_sends: int = 0
    handled: int = 0
    faults: int = 0
    fault_kinds: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    lost_fsync: list[str] = field(default_factory=list)
    fsync_gaps: int = 0
    #: Acknowledged sends lost in a loss window of a Redis failover (``failover_checks``), and the
    #: key gaps they left.
    lost_replication: list[str] = field(default_factory=list)
    replication_gaps: int = 0
    #: Sends that raised (retried), by what they ran into (``chaos.traffic.why``).
    unknown_by_reason: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    dup_copies: int = 0
    dup_redeliveries: int = 0
    dup_unexplained: list[str] = field(default_factory=list)
    dup_max_per_fault_queue: int = 0
    dup_by_fault: dict[str, int] = field(default_factory=dict)
    #: Redeliveries of messages handled in a failover's loss window (their commits lost with it).
    dup_failover: int = 0
    overlaps: int = 0
    #: Overlapping pairs at one epoch (any two processes), and pairs of two epochs where the newer
    #: call started during or within ``DUP_WINDOW`` after a Redis failover.
    same_epoch_overlaps: int = 0
    failover_overlaps: int = 0
    overlaps_allowed: int = 0
    overlaps_forbidden: list[str] = field(default_factory=list)
    stale_calls: int = 0
    stale_saw_stale_epoch: int = 0
    #: Of the stale calls, how many saw True from a question asked before their queue was known to
    #: have a newer owner (``Replaced``: right when Redis answered, read after a pause).
    stale_asked_before_replaced: int = 0
    stale_commit_refused: int = 0
    #: Of the stale calls, how many were in a run that itself got a refusal record (informative).
    stale_refused_own_run: int = 0
    #: Refusal records by reason (FENCED, SUPERSEDED, BACKWARD).
    refusals: dict[str, int] = field(default_factory=dict)
    calls_after_refusal: list[str] = field(default_factory=list)
    failovers: list[float] = field(default_factory=list)
    takeovers_after_sigstop: list[float] = field(default_factory=list)
    #: Redis primary failovers: per event (``Resumption.to_json``), and "consumption resumed" of
    #: every queue of every kill / of every pause, in seconds.
    redis_failover_events: list[dict[str, Any]] = field(default_factory=list)
    redis_failovers: list[float] = field(default_factory=list)
    redis_pause_takeovers: list[float] = field(default_factory=list)
    fence: dict[str, Any] = field(default_factory=dict)
    no_failover: list[str] = field(default_factory=list)
    epoch_double_owner: list[str] = field(default_factory=list)
    offset_backward: list[str] = field(default_factory=list)
    max_stall: float = 0.0
    #: Per Redis restart: seconds from Redis answering again to the last queue's first call.
    redis_recovery: list[str] = field(default_factory=list)
    tasks_stolen: int = 0
    long_stalls: list[str] = field(default_factory=list)
    #: Per lost ConsumeRequest task (the last one of a queue before it resumed): seconds to resume.
    lost_task_recovery: list[float] = field(default_factory=list)
    #: Per queue owned by a worker whose pool processes were killed: seconds to its next call.
    child_kill_recovery: list[float] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    poison: list[dict[str, Any]] = field(default_factory=list)
    beat: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Handled messages never sent to the group's topic (checked in runs with several groups).
    strangers: list[str] = field(default_factory=list)
    #: In a run with several groups, the results of the groups other than the chaos one (whose
    #: figures this result holds), by group (``merge_groups``).
    groups: dict[str, Result] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.problems

    @staticmethod
    def pct(values: list[float], p: float) -> float | None:
        if not values:
            return None
        v = sorted(values)
        return v[max(0, math.ceil(p / 100 * len(v)) - 1)]

    @property
    def failover_max(self) -> float | None:
        return max(self.failovers) if self.failovers else None

    @property
    def failover_p99(self) -> float | None:
        return self.pct(self.failovers, 99)

    @property
    def redis_failover_p99(self) -> float | None:
        return self.pct(self.redis_failovers, 99)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["failover_max"] = self.failover_max
        d["failover_p99"] = self.failover_p99
        d["passed"] = self.passed
        return d


def group_events(events: list[Event], group: str) -> list[Event]:
    """The fault log as ``group`` saw it: a fault that names the queues its target owned in each
    other group (``info["group_queues"]``, ``Faults.kill_worker`` in a run with several groups)
    names ``group``'s there instead of the chaos group's, so failovers are measured over that
    group's queues (another topic's queue ids are not the chaos topic's, and even on one topic
    two groups' queues are assigned apart). The chaos group's own are ``queues``, as always."""
    out = []
    for e in events:
        by_group = e.info.get("group_queues") or {}
        out.append(replace(e, queues=list(by_group[group])) if group in by_group else e)
    return out


def merge_groups(main: Result, groups: dict[str, Result]) -> Result:
    """The result of a run with several groups: ``main`` (the chaos group's) keeps its figures and
    holds the others' results, and fails with each problem of theirs, named by its group: the run
    passes only if every group's check did."""
    main.groups = dict(groups)
    for g, res in groups.items():
        main.problems += [f"group {g}: {p}" for p in res.problems]
    return main


def _fault_events(events: list[Event]) -> list[Event]:
    return [e for e in events if e.fault]


def check(data: RunData) -> Result:
    r = Result(data.scenario, data.fsync)
    faults = _fault_events(data.events)
    r.faults = len(faults)
    kinds: dict[str, int] = defaultdict(int)
    for e in faults:
        kinds[e.kind] += 1
    r.fault_kinds = dict(kinds)
    r.produced = len(data.acks) + len(data.poison)
    r.unknown_sends = len(data.unknown)
    reasons: dict[str, int] = defaultdict(int)
    for *_, why in data.unknown:
        reasons[why] += 1
    r.unknown_by_reason = dict(sorted(reasons.items()))
    entries = sorted(data.entries, key=lambda e: (e.start, e.end))
    regular = [e for e in entries if e.ok and not e.poison]
    handled = {(e.key, e.seq) for e in regular}
    r.handled = len(handled)

    lost_fsync, lost_repl = _losses(data, handled, r)
    if data.group:
        _strangers(data, regular, r)
    concurrent = data.ordering == "concurrent"
    if not concurrent:  # a concurrent listener promises no order
        _order(data, regular, lost_fsync, r, lost_repl)
        _runs(entries, r, by_key=data.ordering == "key")
    _duplicates(data, regular, faults, r)
    refused = _refused(data.refusals, r)
    _overlaps_and_stale(entries, refused, r, by=data.ordering, samples=data.samples, events=data.events)
    _after_refusal(entries, data.refusals, r)
    # Concurrent: retried poison calls come from the retry topic's queues, whose ids are not the
    # chaos topic's; the failover of a chaos queue is read from regular messages only.
    _failover(data, regular if concurrent else entries, r)
    _redis_failover(data, regular if concurrent else entries, r)
    _samples(data, r)
    _stall(data, entries, r)
    _poison(data, entries, r)
    _beat(data, entries, r)
    for e in data.events:
        if e.kind == "crash":
            why = f": {e.info['last_error']}" if e.info.get("last_error") else ""
            r.crashes.append(f"{e.target} exited by itself (code {e.info.get('returncode')}) at {e.t:.3f}{why}")
    if r.crashes:
        r.problems.append(f"worker(s) died without being killed: {r.crashes}")
    if not data.drained:
        r.problems.append("the queues did not drain to lag 0 before the deadline")
    return r


# -- loss and order -------------------------------------------------------------------------------


def _losses(data: RunData, handled: set[tuple[str, int]],
            r: Result) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Acknowledged sends never handled: lost, or lost within an fsync window of a Redis restart,
    or within a loss window of a Redis failover (``failover_checks.loss_windows``); the two
    windowed kinds per key, for the order check."""
    windows: list[tuple[float, float]] = []
    if data.fsync == "everysec":
        for e in data.events:
            if e.kind == "redis-kill":
                killed = e.info.get("killed_at", e.t)
                before = [a.t for a in data.acks if a.t <= killed]
                if before:
                    windows.append((max(before) - FSYNC_WINDOW, max(before)))
    replication = fo.loss_windows(data)
    lost_fsync: dict[str, set[int]] = defaultdict(set)
    lost_repl: dict[str, set[int]] = defaultdict(set)
    for a in data.acks:
        if (a.key, a.seq) in handled:
            continue
        where = f"{a.key}#{a.seq} (queue {a.queue} offset {a.offset}, acked at {a.t:.3f})"
        if any(lo <= a.t <= hi for lo, hi in windows):
            r.lost_fsync.append(where)
            lost_fsync[a.key].add(a.seq)
        elif any(lo <= a.t <= hi for lo, hi in replication):
            r.lost_replication.append(where)
            lost_repl[a.key].add(a.seq)
        else:
            r.lost.append(where)
    if r.lost:
        r.problems.append(f"{len(r.lost)} acknowledged message(s) lost, e.g. {r.lost[:3]}")
    return lost_fsync, lost_repl


def _strangers(data: RunData, regular: list[Entry], r: Result) -> None:
    """A message handled by this group's listener must have been sent to its topic (acknowledged,
    or a send that raised): each topic's keys are its own (``traffic.ProducerThread``), so a
    message of another topic run with this listener (a lingering run switching to another group's
    queue with the wrong listener) is a stranger here."""
    sent = {(a.key, a.seq) for a in data.acks} | {(k, s) for k, s, _, _ in data.unknown}
    for e in regular:
        if (e.key, e.seq) not in sent:
            r.strangers.append(f"{e.key}#{e.seq} (queue {e.queue} offset {e.offset}) handled by {e.client}/{e.pid} "
                               f"epoch {e.epoch} run {e.run} at {e.start:.3f}")
    if r.strangers:
        r.problems.append(f"{len(r.strangers)} handled message(s) never sent to group {data.group}'s topic, e.g. "
                          f"{r.strangers[:3]}")


def _order(data: RunData, regular: list[Entry], lost_fsync: dict[str, set[int]], r: Result,
           lost_repl: dict[str, set[int]] | None = None) -> None:
    hw: dict[str, int] = defaultdict(int)
    repl = lost_repl or {}
    for e in regular:
        top = hw[e.key]
        if e.seq <= top:
            continue
        if e.seq == top + 1:
            hw[e.key] = e.seq
            continue
        missing = set(range(top + 1, e.seq))
        fsync, lost = lost_fsync.get(e.key, set()), repl.get(e.key, set())
        if missing <= fsync | lost:
            if missing <= fsync:
                r.fsync_gaps += 1
            else:
                r.replication_gaps += 1
            hw[e.key] = e.seq
            continue
        r.violations.append(
            f"key {e.key}: seq {e.seq} handled (queue {e.queue} offset {e.offset} by {e.client}/{e.pid} "
            f"epoch {e.epoch} at {e.start:.3f}) before seq {top + 1}"
        )
        hw[e.key] = e.seq


def _runs(entries: list[Entry], r: Result, by_key: bool = False) -> None:
    """Inside one ConsumeRequest run, offsets go up and the epoch never changes (key order: the
    offsets of each key of the run go up, and a suspended offset may be handed out again in the
    same run, as its key's next call: a key-ordered run retries a key without ending)."""
    by_run: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        if e.run:
            by_run[f"{e.run} key {e.key}" if by_key else e.run].append(e)
    for run, es in by_run.items():
        calls = sorted({(e.start, e.offset, e.epoch, e.queue, e.ok) for e in es})
        for (_, o1, ep1, q1, ok1), (t2, o2, ep2, q2, _) in zip(calls, calls[1:], strict=False):
            retried = by_key and o2 == o1 and not ok1
            if (o2 <= o1 and not retried) or ep2 != ep1 or q2 != q1:
                r.violations.append(
                    f"run {run} on queue {q1}: offset {o2} (epoch {ep2}) handed out after offset {o1} "
                    f"(epoch {ep1}) at {t2:.3f}"
                )
    if r.violations:
        r.problems.append(f"{len(r.violations)} order violation(s), e.g. {r.violations[:3]}")


# -- duplicates -----------------------------------------------------------------------------------


def _duplicates(data: RunData, regular: list[Entry], faults: list[Event], r: Result) -> None:
    unknown = {(k, s) for k, s, _, _ in data.unknown}
    lost_commits = [(ev, w) for ev in faults if (w := fo.lost_commit_window(ev)) is not None]
    first: dict[tuple[str, int], Entry] = {}
    per_fault_queue: dict[tuple[int, int], int] = defaultdict(int)
    for e in regular:
        k = (e.key, e.seq)
        f = first.get(k)
        if f is None:
            first[k] = e
            continue
        r.duplicates += 1
        if e.offset != f.offset:
            if k in unknown:
                r.dup_copies += 1
            else:
                r.dup_unexplained.append(f"{e.key}#{e.seq} stored twice (offsets {f.offset}, {e.offset}) "
                                         "though no send of it raised")
            continue
        if any(lo <= f.start <= hi and ev.t <= e.start for ev, (lo, hi) in lost_commits):
            # First handled in a failover's loss window: its commit went with the primary, and it is
            # handed out again when its queue resumes, however long that takes.
            r.dup_redeliveries += 1
            r.dup_failover += 1
            continue
        cause = None
        for i, ev in enumerate(faults):
            if ev.t <= e.start <= ev.end() + DUP_WINDOW and (cause is None or ev.t >= faults[cause].t):
                cause = i
        if cause is None:
            r.dup_unexplained.append(f"{e.key}#{e.seq} (queue {e.queue} offset {e.offset}) redelivered at "
                                     f"{e.start:.3f} by {e.client}, not after any fault")
            continue
        r.dup_redeliveries += 1
        per_fault_queue[(cause, e.queue)] += 1
    by_fault: dict[str, int] = defaultdict(int)
    for (i, q), n in per_fault_queue.items():
        by_fault[f"{faults[i].kind} #{i}"] += n
        bound = data.dup_bound or data.batch
        if n > bound:
            r.problems.append(f"{n} redeliveries on queue {q} after {faults[i].kind} #{i} (more than "
                              + (f"one batch of {data.batch})" if not data.dup_bound
                                 else f"the {bound} a key-ordered run may finish between two commits)"))
    r.dup_by_fault = dict(by_fault)
    r.dup_max_per_fault_queue = max(per_fault_queue.values(), default=0)
    if r.dup_unexplained:
        r.problems.append(f"{len(r.dup_unexplained)} duplicate(s) not explained by a fault, e.g. "
                          f"{r.dup_unexplained[:3]}")


# -- overlaps, stale calls, fencing ---------------------------------------------------------------


@dataclass
class Refusals:
    """Refused commits, from the engine's records: stale epochs (``FENCED``, per queue and epoch),
    and runs superseded at the same epoch (``SUPERSEDED``, per queue, when). ``BACKWARD`` refusals
    are counted but prove nothing about a stale call."""

    stale_epochs: set[tuple[int, int]] = field(default_factory=set)
    superseded: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    #: Runs that got any refusal record.
    runs: set[str] = field(default_factory=set)

    def refused(self, c: Call, same_epoch: bool) -> bool:
        if (c.queue, c.epoch) in self.stale_epochs:
            return True
        return same_epoch and any(t >= c.start for t in self.superseded.get(c.queue, []))


def _refused(records: list[Refusal], r: Result) -> Refusals:
    out = Refusals()
    counts: dict[str, int] = defaultdict(int)
    for rec in records:
        counts[rec.reason] += 1
        out.runs.add(rec.run)
        if rec.reason == FENCED:
            out.stale_epochs.add((rec.queue, rec.epoch))
        elif rec.reason == SUPERSEDED:
            out.superseded[rec.queue].append(rec.at)
    r.refusals = dict(sorted(counts.items()))
    return out


@dataclass(frozen=True)
class Call:
    queue: int
    start: float
    end: float
    epoch: int
    client: str
    pid: int
    run: str
    still_owner: bool | None
    #: When ``ctx.still_owner()`` was asked (``Entry.asked``; 0: not recorded).
    asked: float = 0.0
    #: Concurrent: read from the group's retry topic (a redelivery), whose queue ids and epochs are
    #: its own, not those of the chaos topic's queue with the same id.
    retried: bool = False


def _calls(entries: list[Entry], by: str = "queue") -> dict[int | str, list[Call]]:
    """Listener calls per queue (key order: per queue and key, ``"<queue>/<key>"``; concurrent:
    per message, ``"<key>#<seq>"``, wherever it was read from, its retry topic included)."""
    calls: dict[int | str, set[Call]] = defaultdict(set)
    for e in entries:
        where: int | str = e.queue
        if by == "key":
            where = f"{e.queue}/{e.key}"
        elif by == "concurrent":
            where = f"{e.key}#{e.seq}"
        retried = by == "concurrent" and e.reconsume > 0
        calls[where].add(Call(e.queue, e.start, e.end, e.epoch, e.client, e.pid, e.run, e.still_owner, e.asked,
                              retried))
    return {q: sorted(c, key=lambda c: (c.start, c.end)) for q, c in calls.items()}


def _epoch_seen(samples: list[Sample]) -> dict[int, list[tuple[int, float]]]:
    """Per queue, (epoch, when it was first seen in the lock table) for each new epoch, in order:
    a sample's time is taken after its read returned, so the epoch existed by then."""
    out: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for t, q, _owner, epoch, *_ in sorted(samples, key=lambda s: s[0]):
        seen = out[q]
        if epoch and (not seen or epoch > seen[-1][0]):
            seen.append((epoch, t))
    return out


class Replaced:
    """When a stale call's queue was first *known* to have a newer owner: the start of the first
    listener call under a newer epoch (or of the newer run, at one epoch), or the first lock-table
    sample showing a newer epoch, whichever came first.

    ``ctx.still_owner()`` is answered by Redis at some moment between the question (``Entry.asked``)
    and its return (``end``), and epochs never go back. So a True answer proves a bug only when the
    question was asked after the queue was known to be replaced: Redis then saw the newer epoch and
    still said True. Asked before that, the answer may have been right when Redis gave it, the
    process being paused before it could read it (the keys-sigstop-lease failure at 2b2e0c2: asked
    1 ms before a SIGSTOP, read 10 s later, the newer epoch first used 2.3 s after the question).
    A call that does not record when it asked (``asked`` 0) is held to its end, as before."""

    def __init__(self, samples: list[Sample]) -> None:
        self.seen = _epoch_seen(samples)
        self.at: dict[Call, float] = {}

    def note(self, old: Call, newer_start: float) -> None:
        self.at[old] = min(self.at.get(old, math.inf), newer_start, self._sampled(old))

    def _sampled(self, c: Call) -> float:
        if c.retried:
            return math.inf  # the samples are of the chaos topic's lock table, not the retry topic's
        return next((t for epoch, t in self.seen.get(c.queue, []) if epoch > c.epoch), math.inf)

    def blind(self, c: Call) -> bool:
        """``ctx.still_owner()`` said True in ``c`` although its queue was known to be replaced
        when it asked."""
        if c.still_owner is not True:
            return False
        return not c.asked or c.asked >= self.at.get(c, self._sampled(c))


def _overlaps_and_stale(entries: list[Entry], ref: Refusals, r: Result, by: str = "queue",
                        samples: list[Sample] | None = None, events: list[Event] | None = None) -> None:
    """An overlap is allowed only if the stale call (lower epoch; at one epoch, the older run) had
    its commit refused *and* could see it was stale: ``ctx.still_owner()`` False in it, unless it
    asked before its queue was known to have a newer owner (``Replaced``).

    Key order: calls of one key, and two of them in one process count too (the lanes of a run are
    threads of one process, so a process running two calls of one key at once would be a bug).
    Concurrent: the same, for calls of one message."""
    by_key = by in ("key", "concurrent")
    stale: dict[Call, bool] = {}  # stale call -> "superseded at the same epoch"
    replaced = Replaced(samples or [])
    for q, calls in _calls(entries, by).items():
        # (read from the retry topic, epoch) -> start of its first call (calls come by start). Epochs
        # compare only within one queue: a concurrent message's redeliveries come from its retry
        # queue, whose epoch is lower or higher than its first queue's for reasons of its own.
        first_at: dict[tuple[bool, int], float] = {}
        active: list[Call] = []
        for c in calls:
            first_at.setdefault((c.retried, c.epoch), c.start)
            newer = [t for (rt, e), t in first_at.items() if rt == c.retried and e > c.epoch]
            if newer:
                stale.setdefault(c, False)
                replaced.note(c, min(newer))
            active = [a for a in active if a.end > c.start]
            for a in active:
                if (a.client, a.pid) == (c.client, c.pid) and not by_key:
                    continue
                r.overlaps += 1
                same = a.epoch == c.epoch
                if same:
                    r.same_epoch_overlaps += 1
                elif any(ev.t <= c.start <= ev.end() + DUP_WINDOW for ev in fo.failovers(events or [])):
                    r.failover_overlaps += 1
                old = a if (same or a.epoch < c.epoch) else c
                stale.setdefault(old, same)
                replaced.note(old, c.start if same else min(
                    (t for (rt, e), t in first_at.items() if rt == old.retried and e > old.epoch), default=c.start))
                # Two clients at one epoch: the fence itself failed (one epoch was granted twice);
                # no refusal record can excuse it, a FENCED one at that epoch least of all.
                two_clients = same and a.client != c.client and a.retried == c.retried
                refused, saw = ref.refused(old, same) and not two_clients, not replaced.blind(old)
                if refused and saw:
                    r.overlaps_allowed += 1
                    continue
                why = [f"both at epoch {c.epoch} (two clients holding one epoch)" if two_clients
                       else f"both at epoch {c.epoch} (a second run of the queue in the same epoch)" if same else "",
                       "" if refused or two_clients else f"no refused commit recorded for the stale call (epoch {old.epoch})",
                       "" if saw else "ctx.still_owner() returned True in the stale call"]
                r.overlaps_forbidden.append(
                    f"queue {q}: call by {c.client}/{c.pid} epoch {c.epoch} at {c.start:.3f} overlaps the call by "
                    f"{a.client}/{a.pid} epoch {a.epoch} [{a.start:.3f}, {a.end:.3f}]: " + "; ".join(w for w in why if w)
                )
            active.append(c)
    r.stale_calls = len(stale)
    r.stale_saw_stale_epoch = sum(1 for c in stale if c.still_owner is False)
    r.stale_asked_before_replaced = sum(1 for c in stale if c.still_owner is True and not replaced.blind(c))
    r.stale_commit_refused = sum(1 for c, same in stale.items() if ref.refused(c, same))
    r.stale_refused_own_run = sum(1 for c in stale if c.run in ref.runs)
    if r.overlaps_forbidden:
        r.problems.append(f"{len(r.overlaps_forbidden)} forbidden overlap(s), e.g. {r.overlaps_forbidden[:2]}")
    unrefused = [c for c, same in stale.items() if not ref.refused(c, same)]
    if unrefused:
        r.problems.append(f"{len(unrefused)} stale call(s) whose commit was not refused, e.g. "
                          f"{[(c.queue, c.epoch, c.client, round(c.start, 3)) for c in unrefused[:3]]}")
    blind = [c for c in stale if replaced.blind(c)]
    if blind:
        r.problems.append(f"{len(blind)} stale call(s) where ctx.still_owner() said True after the queue was known "
                          "to be replaced, e.g. "
                          f"{[(c.queue, c.epoch, c.client, c.pid, round(c.start, 3), round(c.asked, 3), round(c.end, 3), round(replaced.at.get(c, math.inf), 3)) for c in blind[:3]]} "
                          "(queue, epoch, client, pid, start, still_owner() asked, end, replaced)")


def _after_refusal(entries: list[Entry], refusals: list[Refusal], r: Result) -> None:
    """A run whose commit or touch was refused drops its messages and stops: a listener call of
    that run starting after the refusal would be a stale holder consuming on (same process clock)."""
    first: dict[str, Refusal] = {}
    for rec in refusals:
        if rec.run not in first or rec.at < first[rec.run].at:
            first[rec.run] = rec
    seen: set[tuple[str, float]] = set()
    for e in entries:
        refused = first.get(e.run)
        if refused is None or e.start <= refused.at or (e.run, e.start) in seen:
            continue
        seen.add((e.run, e.start))
        r.calls_after_refusal.append(
            f"queue {e.queue}: run {e.run} ({e.client}/{e.pid} epoch {e.epoch}) handed out offset {e.offset} at "
            f"{e.start:.3f}, after its commit was refused ({refused.reason}) at {refused.at:.3f}"
        )
    if r.calls_after_refusal:
        r.problems.append(f"{len(r.calls_after_refusal)} listener call(s) after their run's commit was refused, "
                          f"e.g. {r.calls_after_refusal[:2]}")


# -- failover -------------------------------------------------------------------------------------


def _first_other(entries: list[Entry], q: int, client: str, after: float) -> float | None:
    """Start of the first call on ``q`` after ``after`` by a process other than ``client``'s processes
    at that time (a restarted incarnation under the same name counts as another process)."""
    old = {e.pid for e in entries if e.client == client and e.start <= after}
    for e in entries:  # sorted by start
        if e.queue == q and e.start > after and (e.client != client or e.pid not in old):
            return e.start
    return None


def _failover(data: RunData, entries: list[Entry], r: Result) -> None:
    for ev in data.events:
        if ev.kind not in ("kill", "sigstop"):
            continue
        client = ev.info.get("client", "")
        for q in ev.queues:
            t = _first_other(entries, q, client, ev.t)
            if t is None:
                r.no_failover.append(f"queue {q} never resumed in another process after the {ev.kind} at {ev.t:.3f}")
                continue
            (r.failovers if ev.kind == "kill" else r.takeovers_after_sigstop).append(round(t - ev.t, 3))
    if r.no_failover:
        r.problems.append("; ".join(r.no_failover[:3]))
    if "failover_target" in data.enforce:
        p99 = r.failover_p99
        if p99 is None:
            r.problems.append("no failover measured")
        elif p99 > data.failover_target:
            r.problems.append(f"failover p99 {p99:.2f}s is over the {data.failover_target:.0f}s target")


def _redis_failover(data: RunData, entries: list[Entry], r: Result) -> None:
    """Consumption resumed per Redis failover and queue, and the epoch fence across failovers
    (``chaos.failover_checks``). The fence's "no epoch used by two clients" holds in every run."""
    for res in fo.resumption(data, entries):
        r.redis_failover_events.append(res.to_json())
        (r.redis_failovers if res.kind == "primary-kill" else r.redis_pause_takeovers).extend(res.values())
        never = [q for q, v in res.queues.items() if v is None]
        if never:
            r.problems.append(f"queue(s) {never} had no listener call after the {res.kind} of {res.node}, "
                              "though sent messages after it")
    f = fo.fence(data, entries, data.refusals, data.samples)
    if f.new_epochs or f.lost_grants or f.refusals_after or f.two_clients:
        r.fence = f.to_json()
    r.problems += f.problems()
    if "redis_failover" in data.enforce:
        p99 = r.redis_failover_p99
        if p99 is None:
            r.problems.append("no Redis failover measured")
        elif p99 > data.redis_failover_target:
            r.problems.append(f"consumption resumed {p99:.2f}s after a primary kill (p99), over the "
                              f"{data.redis_failover_target:.0f}s target")
    if "no_same_epoch_overlap" in data.enforce and r.same_epoch_overlaps:
        r.problems.append(f"{r.same_epoch_overlaps} overlapping call pair(s) at one epoch of a queue")


# -- state samples --------------------------------------------------------------------------------


def _samples(data: RunData, r: Result) -> None:
    """No epoch of a queue ever held by two clients; committed offsets never go backward."""
    owners: dict[tuple[int, int], set[str]] = defaultdict(set)
    last_off: dict[int, tuple[float, int]] = {}
    backward_failover = 0
    restarts = [e for e in data.events if e.kind == "redis-kill"]
    for t, q, owner, epoch, _lease, offset, *_ in data.samples:
        if owner:
            owners[(q, epoch)].add(owner)
        prev = last_off.get(q)
        if prev is not None and offset < prev[1]:
            lossy = data.fsync == "everysec" and any(prev[0] <= e.t <= t for e in restarts)
            what = f"queue {q}: committed offset {prev[1]} -> {offset} between {prev[0]:.3f} and {t:.3f}"
            if lossy:
                r.notes.append(what + " (across a Redis restart with appendfsync everysec)")
            elif fo.across_failover(data.events, prev[0], t):
                backward_failover += 1  # read from another node, or the promoted replica lacked the commit
            else:
                r.offset_backward.append(what)
        last_off[q] = (t, offset)
    if backward_failover:
        r.notes.append(f"{backward_failover} lock-table sample(s) showed a committed offset lower than the sample "
                       "before, across a Redis failover (commits the promoted replica lacked, or a read from the "
                       "old primary before its demotion): redelivered, never skipped")
    for (q, epoch), who in sorted(owners.items()):
        if len(who) > 1:
            r.epoch_double_owner.append(f"queue {q} epoch {epoch} owned by {sorted(who)}")
    if r.epoch_double_owner:
        r.problems.append(f"double assignment: {r.epoch_double_owner[:3]}")
    if r.offset_backward:
        r.problems.append(f"committed offset went backward: {r.offset_backward[:3]}")


def _stall(data: RunData, entries: list[Entry], r: Result) -> None:
    """Longest time any queue went without a listener call while traffic was on (informative)."""
    if not entries:
        return
    starts: dict[int, list[float]] = defaultdict(list)
    for e in entries:
        starts[e.queue].append(e.start)
    worst = 0.0
    for q, s in sorted(starts.items()):
        s.sort()
        for a, b in zip(s, s[1:], strict=False):
            worst = max(worst, b - a)
            if b - a > LONG_STALL:
                before = [ev for ev in data.events if ev.t <= a + 0.5]
                cause = f"{before[-1].kind} {before[-1].target} {a - before[-1].t:+.1f}s" if before else "no event"
                r.long_stalls.append(f"queue {q}: {b - a:.1f}s from {a:.3f} (last event before: {cause})")
    r.max_stall = round(worst, 2)
    # Lost tasks: from the last task of a queue taken away to that queue's next listener call.
    taken: dict[int, list[float]] = defaultdict(list)
    for ev in data.events:
        if ev.kind == "delete-tasks":
            r.tasks_stolen += int(ev.info.get("stolen", 0))
            for t, q in ev.info.get("taken", []):
                taken[q].append(t)
    for q, ts in taken.items():
        calls = starts.get(q, [])
        by_next: dict[float | None, float] = {}
        for t in ts:
            nxt = next((c for c in calls if c > t), None)
            by_next[nxt] = max(by_next.get(nxt, t), t)
        for nxt, t in by_next.items():
            if nxt is None:
                r.problems.append(f"queue {q} never had a listener call after its task was taken at {t:.3f}")
            else:
                r.lost_task_recovery.append(round(nxt - t, 2))
    # Pool processes killed: from the kill to each owned queue's next listener call (any worker).
    for ev in data.events:
        if ev.kind != "kill-child":
            continue
        for q in ev.queues:
            nxt = next((c for c in sorted(starts.get(q, [])) if c > ev.t), None)
            if nxt is None:
                r.problems.append(f"queue {q} never had a listener call after its pool process was killed at {ev.t:.3f}")
            else:
                r.child_kill_recovery.append(round(nxt - ev.t, 2))
    child_bound = 2 * data.sweep_interval_s + STALL_SLACK
    worst_child = max(r.child_kill_recovery, default=0.0)
    if "child_kill_bound" in data.enforce and worst_child > child_bound:
        r.problems.append(f"a queue resumed {worst_child}s after its pool process was killed (bound: 2 sweeps + "
                          f"{STALL_SLACK:.0f}s = {child_bound:.0f}s; the run lease is 60 s)")
    bound = data.pending_ttl_s + 2 * data.sweep_interval_s + STALL_SLACK
    worst_rec = max(r.lost_task_recovery, default=0.0)
    if "stall_bound" in data.enforce and worst_rec > bound:
        r.problems.append(f"a queue resumed {worst_rec}s after its ConsumeRequest task was lost (bound: "
                          f"pending TTL + 2 sweeps + {STALL_SLACK:.0f}s = {bound:.0f}s)")
    kills = [ev for ev in data.events if ev.kind == "redis-kill"]
    for i, ev in enumerate(kills):
        until = kills[i + 1].t if i + 1 < len(kills) else math.inf
        firsts = [min((t for t in s if ev.end() < t < until), default=None) for s in starts.values()]
        resumed = [f for f in firsts if f is not None]
        if len(resumed) < len(firsts):
            r.redis_recovery.append(f"> {until - ev.end():.1f} (not every queue resumed before the next kill)")
        elif resumed:
            r.redis_recovery.append(f"{max(resumed) - ev.end():.1f}")


# -- poison and beat ------------------------------------------------------------------------------


def _poison(data: RunData, entries: list[Entry], r: Result) -> None:
    dlq = {(d.get("ORIGIN_QUEUE_ID"), d.get("ORIGIN_QUEUE_OFFSET")): d for d in data.dlq}
    regular_dlq = [d for d in data.dlq if '"poison"' not in d.get("body", "")]
    if regular_dlq:
        r.problems.append(f"{len(regular_dlq)} regular message(s) in the DLQ")
    bound = data.max_reconsume * data.suspend_s + POISON_SLACK
    for p in data.poison:
        pid, q, off = p.id, p.queue, p.offset
        attempts = [e for e in entries if e.key == f"poison-{pid}"]
        # Concurrent: the last failure happens in the retry topic, whose queue and offset the dead
        # letter names; the poison id in its body is unique either way.
        in_dlq = (str(q), str(off)) in dlq or any(_poison_id(d.get("body", "")) == pid for d in data.dlq)
        t0 = min((e.start for e in attempts), default=None)
        nxt = None
        if t0 is not None:
            nxt = next((e.start for e in entries if e.queue == q and e.offset > off and e.start >= t0
                        and e.ok and not e.poison), None)
        blocked = round(nxt - t0, 2) if (nxt is not None and t0 is not None) else None
        r.poison.append({"id": pid, "queue": q, "offset": off, "attempts": len(attempts), "in_dlq": in_dlq,
                         "blocked_s": blocked, "bound_s": bound})
        if not in_dlq:
            r.problems.append(f"poison message {pid} (queue {q} offset {off}) is not in the DLQ")
        if "poison_bound" in data.enforce and blocked is not None and blocked > bound:
            r.problems.append(f"poison message {pid} blocked queue {q} for {blocked}s (bound {bound}s)")
        if "poison_bound" in data.enforce and blocked is None:
            r.problems.append(f"no later message of queue {q} was handled after poison message {pid}")


def _poison_id(body: str) -> int | None:
    try:
        b = json.loads(body)
    except ValueError:
        return None
    return b.get("id") if isinstance(b, dict) and b.get("poison") else None


def _beat(data: RunData, entries: list[Entry], r: Result) -> None:
    kills = [e for e in data.events if e.kind == "beat-kill"]
    starts = [e for e in data.events if e.kind == "beat-start"]
    if not kills:
        return
    k = kills[0]
    back = next((s for s in starts if s.t > k.t), None)
    t1 = back.t if back else max(e.end for e in entries)
    per_q: dict[int, list[float]] = defaultdict(list)
    for e in entries:
        if k.t <= e.start <= t1:
            per_q[e.queue].append(e.start)
    queues = {e.queue for e in entries}
    gaps = {}
    for q in sorted(queues):
        s = [k.t, *sorted(per_q.get(q, [])), t1]
        gaps[q] = round(max(b - a for a, b in zip(s, s[1:], strict=False)), 2)
    changes = 0
    last: dict[int, int] = {}
    for t, q, _o, epoch, *_ in data.samples:
        if q in last and epoch != last[q] and k.t <= t <= t1:
            changes += 1
        last[q] = epoch
    sends = [sum(1 for p in data.published if p.role == role and p.task == REBALANCE_TASK) for role in data.beats]
    r.beat = {
        "outage_s": round(t1 - k.t, 1),
        "handled_during_outage": sum(len(v) for v in per_q.values()),
        "max_gap_during_outage_s": max(gaps.values(), default=None),
        "epoch_changes_during_outage": changes,
        "rebalances_sent_per_beat": sends,
    }
    if "beat" not in data.enforce:
        return
    stalled = {q: g for q, g in gaps.items() if g > BEAT_OUTAGE_MAX_GAP}
    if stalled:
        r.problems.append(f"queues stalled while beat was down: {stalled}")
    if changes:
        r.problems.append(f"{changes} epoch change(s) while beat was down: leases lapsed")
    if back is not None and len(sends) > 1 and not all(n > 0 for n in sends[1:]):
        r.problems.append(f"a beat started after the outage sent no rebalance: {sends}")

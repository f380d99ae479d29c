"""The checker's rules for failovers of the Redis primary (the ``sentinel-*`` scenarios).

``chaos.checker`` calls these beside its own rules; they read the same records (listener calls,
acknowledgements, refusals, lock-table samples) and the fault log's ``primary-kill`` and
``primary-pause`` events (``chaos.faults``), which say when the primary was lost, which replica was
promoted and when, and, for a failover to a replica known to be stale, what it lacked.

Definitions:

* **loss window**: an acknowledged send may be lost in a failover only when nothing promised it
  would survive one. With sends that do not wait for a replica (``send_wait`` 0), that is the
  acknowledgements of the last ``REPLICATION_WINDOW`` s before the primary was lost (replication is
  asynchronous; like the everysec fsync window of a Redis restart). After a failover to a replica
  known to be stale (paused since ``stale_since``), it is every acknowledgement since then,
  whatever the sends waited for: the replicas that acknowledged them were not the one promoted.
  A loss outside a window is a loss; one inside is counted and reported, and so is the gap it
  leaves in its key;
* **consumption resumed**: per failover and per queue, seconds from the loss of the primary to the
  first listener call on that queue after it, either of a message acknowledged after it (which
  exists on the new primary only) or by a run that had made no call before it (a run that
  started after the loss). A call of a message a run had read before the loss proves nothing.
  On a Redis Cluster the event names the queues of the killed master's shard (``Event.queues``):
  only those had to resume elsewhere, so only those are measured (the other shards' queues never
  stopped);
* **fence across a failover**: an epoch first used on a queue after the promotion is above every
  epoch used on that queue before the loss (a promoted replica never hands out again an epoch
  the old primary granted, even one it never saw); a lost grant (a lock the old primary granted
  and the promoted replica never got) never appears in the lock table after the promotion; and
  no epoch of a queue is ever used by two clients;
* **redelivery after a failover**: a message handled in the loss window whose commit the promoted
  replica lacks is handed out again; such redeliveries are counted apart and are not held to the
  one-batch-per-fault bound (invariant 9: lost progress may cause redelivery, never reorder).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chaos.evidence import Event, Sample
from chaos.records import AHEAD, FENCED, Entry, Refusal

if TYPE_CHECKING:
    from chaos.checker import RunData

#: Faults that lose the Redis primary: a kill -9, or a SIGSTOP long enough for a failover.
FAILOVER_KINDS = ("primary-kill", "primary-pause")
#: Sends that did not wait for a replica may be lost if acknowledged this long before a failover.
REPLICATION_WINDOW = 1.0
#: Target of the ``redis_failover`` check: p99 of "consumption resumed" over every queue of every kill.
REDIS_FAILOVER_TARGET = 10.0


def failovers(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.kind in FAILOVER_KINDS]


def lost_at(e: Event) -> float:
    """When the primary was gone: right after its kill -9 or SIGSTOP returned (``e.t`` is taken just
    before, and an acknowledgement in between may still come from the old primary)."""
    return float(e.info.get("lost_at", e.t))


def loss_windows(data: RunData) -> list[tuple[float, float]]:
    """The loss windows of the run's failovers (see the module docstring)."""
    out = []
    for e in failovers(data.events):
        stale = e.info.get("stale_since")
        if stale is not None:
            out.append((float(stale), lost_at(e)))
        if data.send_wait:
            continue
        before = [a.t for a in data.acks if a.t <= lost_at(e)]
        if before:
            out.append((max(before) - REPLICATION_WINDOW, max(before)))
        resumed = e.info.get("resumed_at")
        if resumed is not None:  # a paused old primary may answer (alone) until Sentinel demotes it
            out.append((float(resumed), float(resumed) + float(e.info.get("demoted_s", 0.0))))
    return out


# -- consumption resumed --------------------------------------------------------------------------


@dataclass
class Resumption:
    """Per failover: when sends and each queue's consumption resumed (seconds after the loss)."""

    kind: str
    node: str
    t: float
    promoted_s: float | None
    send_resumed_s: float | None
    #: Queue id -> seconds to its first call after the loss (None: never, to the end of the run).
    queues: dict[int, float | None] = field(default_factory=dict)

    def values(self) -> list[float]:
        return [v for v in self.queues.values() if v is not None]

    def to_json(self) -> dict[str, Any]:
        v = self.values()
        return {"kind": self.kind, "node": self.node, "promoted_s": self.promoted_s,
                "send_resumed_s": self.send_resumed_s, "queues": len(self.queues),
                "resumed_max_s": max(v) if v else None,
                "never": sorted(q for q, x in self.queues.items() if x is None)}


def resumption(data: RunData, entries: list[Entry]) -> list[Resumption]:
    """Consumption resumed, per failover and per queue (``entries`` sorted by start)."""
    acked = {(a.key, a.seq): a.t for a in data.acks}
    fos = sorted(failovers(data.events), key=lambda e: e.t)
    out = []
    for i, e in enumerate(fos):
        until = fos[i + 1].t if i + 1 < len(fos) else math.inf
        gone = lost_at(e)
        runs_before = {x.run for x in entries if x.start <= gone}
        first: dict[int, float] = {}
        for x in entries:  # up to the end of the run: a queue may resume only after the next failover
            if x.start <= gone or x.queue in first:
                continue
            if acked.get((x.key, x.seq), -math.inf) > gone or x.run not in runs_before:
                first[x.queue] = round(x.start - e.t, 3)
        sends = [a for a in data.acks if gone < a.t < until]
        promoted = e.info.get("promoted_s")
        res = Resumption(e.kind, e.target, e.t, float(promoted) if promoted is not None else None,
                         round(min(a.t for a in sends) - e.t, 3) if sends else None)
        # Every queue that was sent something after the loss owes a call; a queue that was sent
        # nothing may have nothing to resume (it counts if it resumed anyway: a redelivery).
        owed = {a.queue for a in sends} | set(first)
        if e.queues:  # a cluster shard's failover: its own queues
            owed &= set(e.queues)
        res.queues = {q: first.get(q) for q in sorted(owed)}
        out.append(res)
    return out


# -- the fence ------------------------------------------------------------------------------------


@dataclass
class Fence:
    """What the records show of the epoch fence across the run's failovers."""

    #: Epochs first used on a queue after a promotion, each compared with the epochs before the loss.
    new_epochs: int = 0
    #: Of those, the ones at or below an epoch used before the loss (a violation).
    below: list[str] = field(default_factory=list)
    #: Lock grants the old primary made and the promoted replica lacked (``fail_over_to_stale``).
    lost_grants: int = 0
    #: Lost grants that reappeared in the lock table after the promotion (a violation).
    reappeared: list[str] = field(default_factory=list)
    #: Lost grants whose holder had a commit refused as FENCED at that epoch after the loss.
    lost_holders_fenced: int = 0
    #: Listener calls under a lost grant's epoch after the promotion (stale calls: the overlap
    #: rules hold them to a refused commit and ``ctx.still_owner()`` False).
    lost_holder_calls: int = 0
    #: Refusals recorded after a failover began, by reason (FENCED, AHEAD, SUPERSEDED...).
    refusals_after: dict[str, int] = field(default_factory=dict)
    lost_commits: int = 0
    lost_appends: int = 0
    #: (queue, epoch) used by two clients (a violation anywhere, failover or not).
    two_clients: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"new_epochs": self.new_epochs, "below": self.below[:3], "below_count": len(self.below),
                "lost_grants": self.lost_grants, "reappeared": self.reappeared[:3],
                "lost_holders_fenced": self.lost_holders_fenced, "lost_holder_calls": self.lost_holder_calls,
                "refusals_after": self.refusals_after, "lost_commits": self.lost_commits,
                "lost_appends": self.lost_appends, "two_clients": self.two_clients[:3]}

    def problems(self) -> list[str]:
        out = []
        if self.below:
            out.append(f"{len(self.below)} epoch(s) first used after a failover at or below one used before it, "
                       f"e.g. {self.below[:2]}")
        if self.reappeared:
            out.append(f"lost lock grant(s) back in the lock table after the promotion: {self.reappeared[:3]}")
        if self.two_clients:
            out.append(f"{len(self.two_clients)} epoch(s) of a queue used by two clients, e.g. {self.two_clients[:3]}")
        return out


def epochs_by_client(entries: list[Entry], ordering: str) -> list[str]:
    """(queue, epoch) pairs whose listener calls came from two clients. A concurrent listener's
    redeliveries come from its retry topic, whose queue ids and epochs are its own."""
    who: dict[tuple[bool, int, int], set[str]] = defaultdict(set)
    for e in entries:
        who[(ordering == "concurrent" and e.reconsume > 0, e.queue, e.epoch)].add(e.client)
    return [f"queue {q}{' (retry topic)' if retried else ''} epoch {ep}: {sorted(c)}"
            for (retried, q, ep), c in sorted(who.items()) if len(c) > 1]


def fence(data: RunData, entries: list[Entry], refusals: list[Refusal], samples: list[Sample]) -> Fence:
    f = Fence(two_clients=epochs_by_client(entries, data.ordering))
    fos = sorted(failovers(data.events), key=lambda e: e.t)
    counts: dict[str, int] = defaultdict(int)
    first_at: dict[tuple[int, int], float] = {}
    for x in entries:
        first_at.setdefault((x.queue, x.epoch), x.start)
    if fos:
        for rec in refusals:
            if rec.at >= fos[0].t:
                counts[rec.reason] += 1
    f.refusals_after = dict(sorted(counts.items()))
    for e in fos:
        promoted = float(e.info.get("promoted_at", e.t))
        before: dict[int, int] = {}
        for (q, ep), t in first_at.items():
            if t <= lost_at(e):
                before[q] = max(before.get(q, 0), ep)
        for (q, ep), t in first_at.items():
            if t > promoted and q in before:
                f.new_epochs += 1
                if ep <= before[q]:
                    f.below.append(f"queue {q}: epoch {ep} first used {t - e.t:.2f}s after the {e.kind} of "
                                   f"{e.target}, epoch {before[q]} used before it")
        grants = e.info.get("lost_grants") or []
        f.lost_grants += len(grants)
        f.lost_commits += int(e.info.get("lost_commits", 0))
        f.lost_appends += int(e.info.get("lost_appends", 0))
        lost = {(int(g["queue"]), int(g["epoch"])) for g in grants}
        for t, q, owner, ep, *_ in samples:
            if t > promoted and (q, ep) in lost:
                f.reappeared.append(f"queue {q} epoch {ep} owned by {owner!r} at {t:.3f}")
                lost.discard((q, ep))
        fenced = {(r.queue, r.epoch) for r in refusals if r.reason == FENCED and r.at >= e.t}
        f.lost_holders_fenced += sum(1 for g in grants if (int(g["queue"]), int(g["epoch"])) in fenced)
        f.lost_holder_calls += sum(1 for x in entries if x.start > promoted
                                   and (x.queue, x.epoch) in {(int(g["queue"]), int(g["epoch"])) for g in grants})
    return f


def ahead_refusals(refusals: list[Refusal]) -> int:
    return sum(1 for r in refusals if r.reason == AHEAD)


# -- redeliveries and offsets -----------------------------------------------------------------------


def lost_commit_window(e: Event) -> tuple[float, float] | None:
    """When a message handled then may have its commit lost in failover ``e`` (so be handed out
    again): since the promoted replica went stale, else the replication window; None for
    another kind of fault."""
    if e.kind not in FAILOVER_KINDS:
        return None
    stale = e.info.get("stale_since")
    return (float(stale) if stale is not None else e.t - REPLICATION_WINDOW, lost_at(e))


def across_failover(events: list[Event], t0: float, t1: float) -> bool:
    """A failover happened (began, or was still going on) between ``t0`` and ``t1``: the lock
    table read before and after may come from two nodes."""
    return any(e.t <= t1 and e.end() >= t0 for e in failovers(events))


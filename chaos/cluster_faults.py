"""Faults on the Redis Cluster under test (``chaos.cluster_topology``), each logged as an :class:`Event`.

* ``kill_master``: ``kill -9`` of the master of one shard (the shards in turn). The event is a
  ``primary-kill`` like Sentinel's (``chaos.faults.Faults.kill_primary``), so the checker's
  failover rules (``chaos.failover_checks``: loss windows, consumption resumed, the epoch fence)
  judge it the same way; its ``queues`` are the queues that shard served, the ones whose
  consumption had to move to the promoted replica. The killed node is started again from its
  data and ``nodes.conf``: it rejoins as the promoted node's replica by itself.
* ``reshard``: the slots of a few live queues (their hash tags) migrated to another master while
  they are consumed, by the steps of ``redis-cli --cluster reshard``
  (``ClusterDeployment.migrate_slot``). Every key of a queue shares its slot, so its messages,
  lock, epoch and committed offset move together; clients follow with ``ASK``/``TRYAGAIN`` during
  the move and ``MOVED`` after it.

Nothing here judges the outcome; the events record what was done and what was seen of it.
"""

from __future__ import annotations

import time
from typing import Any

from chaos.cluster_topology import ClusterRedis, queue_slot
from chaos.evidence import Event, Evidence, log
from chaos.processes import Processes
from mqorder.testing.embedded import RedisServer

#: ``reshard`` moves this many live queues' slots per round.
RESHARD_QUEUES = 3


class ClusterFaults:
    """Kills of masters and slot migrations on the scenario's Redis Cluster."""

    def __init__(self, procs: Processes, evidence: Evidence) -> None:
        if procs.cluster is None:
            raise RuntimeError(f"scenario {procs.name} has no Redis Cluster (Scenario.cluster)")
        self.procs = procs
        self.cluster: ClusterRedis = procs.cluster
        self.evidence = evidence
        #: One slot of each shard at the start: ``kill_master`` takes the shards in this order.
        self.shard_slots = [lo for lo, _hi, _m in sorted(self.cluster.deployment.slot_map(), key=lambda r: r[0])]
        self.kills = 0
        self.rounds = 0
        #: Failovers this class caused, and the masters it expects now (any other change of the
        #: masters is a failover nobody asked for: no event explains what it cost).
        self.planned_failovers = 0
        self.expected_masters = {n.port for n in self.cluster.masters()}

    # -- failover ---------------------------------------------------------------------------------

    def kill_master(self, *, restart_after: float = 2.0) -> Event:
        """``kill -9`` of the next shard's master. Returns once its replica was promoted, the killed
        node started again (``restart_after`` s after the promotion) and became the promoted
        node's in-sync replica, and the cluster says ``ok``: the next kill finds it whole again.
        ``t_end``: that moment."""
        c, d = self.cluster, self.cluster.deployment
        slot = self.shard_slots[self.kills % len(self.shard_slots)]
        self.kills += 1
        node = d.master_of_slot(slot)
        queues = sorted(q for q, m in c.serving(self.evidence.mqs).items() if m is node)
        e = self.evidence.event("primary-kill", c.name(node), queues=queues, info={"slot": slot})
        d.kill(node)
        e.info["lost_at"] = time.time()
        promoted = d.wait_failover(node, slot)
        self._promoted(e, node, promoted)
        time.sleep(restart_after)
        e.info["restarted_s"] = round(time.time() - e.t, 3)
        d.restart(node)
        e.info["rejoined_s"] = round(d.wait_replica_of(node, promoted), 2)
        d.wait_ok()
        e.t_end = time.time()
        log(f"{self.procs.name}: {e.target} killed ({len(queues)} queues); {e.info['promoted']} promoted after "
            f"{e.info['promoted_s']:.1f}s; the old master its in-sync replica {e.info['rejoined_s']:.1f}s after "
            f"its restart; whole again after {e.t_end - e.t:.1f}s")
        return e

    def _promoted(self, e: Event, dead: RedisServer, promoted: RedisServer) -> None:
        self.planned_failovers += 1
        self.expected_masters.discard(dead.port)
        self.expected_masters.add(promoted.port)
        e.info["promoted"] = self.cluster.name(promoted)
        e.info["promoted_at"] = time.time()
        e.info["promoted_s"] = round(e.info["promoted_at"] - e.t, 3)

    def failover_notes(self) -> list[str]:
        """The master kills in one note: when each replica was promoted, and when each shard had a
        replica again (the killed node restarted, back and in sync). With one replica per master
        the promoted master has none in between, so a send or a lock grant that waits for one
        replica cannot be acknowledged on that shard until then."""
        kills = [e for e in self.evidence.events if e.kind == "primary-kill"]
        if not kills:
            return []
        secs = lambda vals: ", ".join(f"{v:.1f}" for v in vals)  # noqa: E731
        return [f"{len(kills)} master kills (shards of {', '.join(str(len(e.queues)) for e in kills)} queues): the "
                f"replica promoted {secs(e.info['promoted_s'] for e in kills)} s after each kill; the killed node "
                f"restarted {secs(e.info['restarted_s'] for e in kills)} s after it, and the promoted node's "
                f"in-sync replica (the shard whole again) {secs(e.end() - e.t for e in kills)} s after it"]

    def unplanned_failovers(self) -> int:
        """Masters serving slots now that no ``kill_master`` promoted (a replica the cluster
        promoted by itself: a master it judged down on a loaded machine)."""
        return len({n.port for n in self.cluster.masters()} - self.expected_masters)

    # -- slot migrations --------------------------------------------------------------------------

    def reshard(self, queues: int = RESHARD_QUEUES) -> Event:
        """Migrate the slots of ``queues`` live queues (the next ones in turn), each to the master
        after the one serving it now. Raises if a slot did not end on its target (the scenario
        would prove nothing). ``t_end``: every migration done."""
        c, d = self.cluster, self.cluster.deployment
        mqs = self.evidence.mqs
        start = self.rounds * queues
        self.rounds += 1
        chosen = [mqs[(start + k) % len(mqs)] for k in range(queues)]
        masters = c.masters()
        serving = c.serving(mqs)
        e = self.evidence.event("reshard", "slots", queues=[mq.queue_id for mq in chosen])
        moves: list[dict[str, Any]] = []
        for mq in chosen:
            source = serving[mq.queue_id]
            target = masters[(masters.index(source) + 1) % len(masters)]
            slot = queue_slot(mq)
            t0 = time.time()
            moved = d.migrate_slot(slot, target)
            moves.append({"queue": mq.queue_id, "slot": slot, "from": c.name(source), "to": c.name(target),
                          "keys": moved, "t": t0, "t_end": time.time()})
        e.t_end = time.time()
        e.info["moves"] = moves
        now = c.serving(mqs)
        wrong = [m["queue"] for m in moves if c.name(now[m["queue"]]) != m["to"]]
        if wrong:
            raise RuntimeError(f"queues {wrong} are not served by their migration's target after it: "
                               "the scenario would prove nothing")
        log(f"{self.procs.name}: slots migrated: "
            + ", ".join(f"queue {m['queue']} (slot {m['slot']}, {m['keys']} keys) {m['from']} -> {m['to']} in "
                        f"{m['t_end'] - m['t']:.2f}s" for m in moves))
        return e

    def reshard_notes(self) -> list[str]:
        """What the migrations did, and how long each moved queue paused around its own migration:
        from its last listener call before the migration began to its first after it ended
        (``None``: no call after it, up to now)."""
        calls: dict[int, list[float]] = {}
        for x in self.evidence.entries():
            calls.setdefault(x.queue, []).append(x.start)
        for v in calls.values():
            v.sort()
        pauses: list[float] = []
        never: list[int] = []
        keys = 0
        moves = [m for e in self.evidence.events if e.kind == "reshard" for m in e.info.get("moves", [])]
        for m in moves:
            keys += int(m["keys"])
            starts = calls.get(int(m["queue"]), [])
            before = max((t for t in starts if t < m["t"]), default=None)
            after = min((t for t in starts if t > m["t_end"]), default=None)
            if after is None:
                never.append(int(m["queue"]))
            elif before is not None:
                pauses.append(after - before)
        took = [m["t_end"] - m["t"] for m in moves]
        notes = [f"{len(moves)} slot migrations of live queues ({keys:,} keys moved; each took "
                 f"{min(took, default=0):.2f}-{max(took, default=0):.2f} s)"]
        if pauses:
            notes.append(f"a moved queue's pause around its migration (last call before it to first after it): "
                         f"max {max(pauses):.2f} s, median {sorted(pauses)[len(pauses) // 2]:.2f} s"
                         + (f"; no call after the migration by the end of the faults: queues {never}" if never else ""))
        return notes

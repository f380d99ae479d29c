"""Faults: what a scenario does to the cluster, each action logged as an :class:`Event`.

Every injector picks its target from the lock table *right before* acting (the worker owning the
most queues), records the queues it hit, and returns the event, so the checker can measure the
failover of exactly those queues. Nothing here judges the outcome: that is the checker's job.

The Sentinel faults (``primary-kill``, ``primary-pause``, ``replica-pause``) act on the deployment
of ``chaos.topology`` and record what they saw of it in the event: which node Sentinel promoted and
when, and, for a failover to a replica known to be stale, what that replica lacked of the old
primary's state (the lock grants, commits and appends lost with it). The checker judges the fence
by those records. The Redis Cluster faults (a master's kill, slot migrations) are
``chaos.cluster_faults``'s, reached through :meth:`Faults.cluster_faults`.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery.utils.nodenames import worker_direct

from chaos.cluster_faults import ClusterFaults
from chaos.evidence import Event, Evidence, log
from chaos.listeners import CTL, TOPIC
from chaos.processes import Processes, child_pids
from chaos.topology import QueueState, SentinelRedis
from chaos.traffic import Traffic
from mqorder.celery.dispatch import CONSUME_REQUEST
from mqorder.model import MessageQueue
from mqorder.store.connect import connect
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import WorkerProcess

#: Work per listener call (ms) while a pause is being aimed inside listener calls.
SLOW_CALL_MS = 400


def _task_queue(raw: bytes | str) -> int | None:
    """The queue id a ConsumeRequest task message (kombu's JSON envelope) was for, if it is one."""
    try:
        msg = json.loads(raw)
        if msg["headers"].get("task") != CONSUME_REQUEST:
            return None
        body = msg["body"]
        if msg["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        mq = MessageQueue.from_key(args[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return mq.queue_id if mq.topic == TOPIC else None


class Faults:
    """kill -9, SIGSTOP, Redis restarts, churn, lost tasks, poison and beat faults."""

    def __init__(self, procs: Processes, evidence: Evidence, traffic: Traffic) -> None:
        self.procs = procs
        self.evidence = evidence
        self.traffic = traffic
        #: Control channel to the listeners (``slow:<client>`` in the ``ctl`` hash).
        self.ctl = redis.Redis.from_url(procs.ledger_url)
        #: Sentinel scenarios: the Sentinels' configuration epoch at the start, and the failovers
        #: this class caused (any other one is unplanned: no event records it).
        self.epoch0 = procs.sentinel.config_epoch() if procs.sentinel is not None else 0
        self.planned_failovers = 0
        #: Cluster scenarios: the faults on the cluster's nodes and slots.
        self._cluster = ClusterFaults(procs, evidence) if procs.cluster is not None else None

    def cluster_faults(self) -> ClusterFaults:
        if self._cluster is None:
            raise RuntimeError(f"scenario {self.procs.name} has no Redis Cluster (Scenario.cluster)")
        return self._cluster

    def alive_workers(self) -> list[WorkerProcess]:
        return self.procs.alive_workers()

    def _event(self, kind: str, target: str = "", **kw: Any) -> Event:
        return self.evidence.event(kind, target, **kw)

    def _busiest(self) -> tuple[WorkerProcess, list[int]] | None:
        owners = self.evidence.owners()
        best: tuple[WorkerProcess, list[int]] | None = None
        for w in self.procs.alive_workers():
            qs = sorted(q for q, o in owners.items() if o == w.hostname)
            if qs and (best is None or len(qs) > len(best[1])):
                best = (w, qs)
        return best

    # -- workers --------------------------------------------------------------------------------

    def kill_worker(self) -> Event | None:
        """``kill -9`` of the worker owning the most queues (owners read right before the kill)."""
        found = self._busiest()
        if found is None:
            log("no worker owns a queue; kill skipped")
            return None
        w, qs = found
        e = self._event("kill", w.name, queues=qs, info=self._owner_info(w))
        self.procs.kill_worker(w)
        return e

    def _owner_info(self, w: WorkerProcess) -> dict[str, Any]:
        """A fault's ``info`` about worker ``w``: its client id and, in a run with other groups
        (``groups-kill``), the queues it owns in each (``group_queues``: the checker measures each
        group's failover over its own queues, ``checker.group_events``)."""
        info: dict[str, Any] = {"client": w.hostname}
        if self.evidence.groups:
            info["group_queues"] = self.evidence.group_owners(w.hostname)
        return info

    def restart_worker(self, name: str) -> Event:
        e = self._event("restart", name)
        w = self.procs.start_worker(name, wait=False)
        self.procs.wait_registered(w)
        e.t_end = time.time()
        return e

    def kill_and_restart(self, after: float) -> Event | None:
        """``kill -9`` of the busiest owner, restarted under the same name ``after`` seconds later."""
        e = self.kill_worker()
        time.sleep(after)
        if e is not None:
            self.restart_worker(e.target)
        return e

    def join_worker(self) -> Event:
        name = self.procs.new_worker_name()
        e = self._event("join", name)
        self.procs.start_worker(name, wait=False)
        return e

    def leave_worker(self, name: str | None = None) -> Event | None:
        """Warm shutdown (SIGTERM) of a worker, in the background so the cadence is kept."""
        alive = self.procs.alive_workers()
        if not alive:
            return None
        w = self.procs.workers[name] if name else alive[0]
        e = self._event("leave", w.name)
        self.procs.stop_worker_soon(w)
        return e

    @contextmanager
    def _slow_calls(self, client: str) -> Iterator[None]:
        """Make ``client``'s listener calls slow for a moment, so a pause lands inside one."""
        key = f"slow:{client}"
        self.ctl.hset(CTL, key, SLOW_CALL_MS)
        time.sleep(0.3)
        try:
            yield
        finally:
            self.ctl.hdel(CTL, key)


    def pause_worker(self, seconds: float, *, in_call: bool = False) -> Event | None:
        """SIGSTOP of the whole process group of a queue owner for ``seconds``, then SIGCONT.

        With ``in_call`` the worker's listener calls are made slow (400 ms) for a moment first, so
        the pause lands inside listener calls: the case where a stale holder resumes mid-call.
        """
        found = self._busiest()
        if found is None:
            return None
        w, qs = found
        info = {**self._owner_info(w), "seconds": seconds, "in_call": in_call}
        if in_call:
            with self._slow_calls(w.hostname):
                e = self._event("sigstop", w.name, queues=qs, info=info)
                w.signal(signal.SIGSTOP)
        else:
            e = self._event("sigstop", w.name, queues=qs, info=info)
            w.signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            w.signal(signal.SIGCONT)
        e.t_end = time.time()
        return e

    def _busiest_pool(self) -> tuple[WorkerProcess, list[int], list[int]] | None:
        """``_busiest`` with its pool processes' pids; None without a queue owner or a pool."""
        found = self._busiest()
        if found is None:
            return None
        w, qs = found
        kids = child_pids(w.pid)
        return (w, qs, kids) if kids else None

    def pause_pool_process(self, seconds: float) -> Event | None:
        """SIGSTOP of one prefork pool process of a queue owner, inside a listener call, for
        ``seconds`` (its main process keeps heartbeating and renewing the worker's locks)."""
        found = self._busiest_pool()
        if found is None:
            return None
        w, _, kids = found
        with self._slow_calls(w.hostname):
            e = self._event("sigstop-child", w.name, info={"client": w.hostname, "pid": kids[0], "seconds": seconds})
            os.kill(kids[0], signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(kids[0], signal.SIGCONT)
        e.t_end = time.time()
        return e

    def kill_pool_processes(self) -> Event | None:
        """``kill -9`` of every prefork pool process of a queue owner, inside listener calls (its
        main process lives, heartbeats and respawns them): what the OOM killer does. The worker's
        main process ends the runs they left (``mqorder.celery.lost_runs``); before it did, each
        queue waited out its 60 s run lease."""
        found = self._busiest_pool()
        if found is None:
            return None
        w, qs, kids = found
        with self._slow_calls(w.hostname):
            e = self._event("kill-child", w.name, queues=qs, info={**self._owner_info(w), "pids": kids})
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        e.t_end = time.time()
        return e

    # -- Redis and the Celery broker ------------------------------------------------------------

    def restart_redis(self, down: float) -> Event:
        """Kill the Redis under test (SIGKILL) and restart it from its AOF after ``down`` seconds."""
        e = self._event("redis-kill", "redis", info={"fsync": self.procs.fsync})
        self.procs.kill_redis()
        e.info["killed_at"] = time.time()  # acks recorded before this were answered before the kill
        time.sleep(down)
        self.procs.start_redis(timeout=60)
        e.t_end = time.time()
        log(f"{self.procs.name}: redis back after {e.t_end - e.t:.1f}s")
        return e

    def _direct_queues(self) -> list[str]:
        """The Celery direct queue keys of every worker started in this scenario (with kombu's
        priority sub-queues), whether or not they exist right now."""
        out = []
        for w in self.procs.workers.values():
            q = worker_direct(w.hostname).name
            out += [q, *(f"{q}\x06\x16{p}" for p in (3, 6, 9))]
        return out

    def steal_tasks(self, burst: float = 1.0) -> Event:
        """Lost tasks: for ``burst`` seconds, take every ConsumeRequest task published to any worker
        direct queue away from the broker (a competing BRPOP that throws them away), and delete
        kombu's ``unacked`` structures. On RabbitMQ: a competing consumer (``chaos.amqp_steal``)."""
        amqp_url = self.procs.env_extra.get("MQORDER_CELERY_BROKER_URL")
        if amqp_url:
            return self._steal_amqp(amqp_url, burst)
        c = connect(self.procs.url, socket_timeout=5)
        e = self._event("delete-tasks", "broker")
        stolen = 0
        taken: list[tuple[float, int]] = []
        try:
            names = self._direct_queues()
            deadline = time.monotonic() + burst
            while time.monotonic() < deadline:
                got = c.brpop(names, timeout=0.1)
                if got is not None:
                    stolen += 1
                    q = _task_queue(got[1])
                    if q is not None:
                        taken.append((time.time(), q))
            e.info["unacked_deleted"] = int(c.delete("unacked", "unacked_index"))
        finally:
            c.close()
            e.t_end = time.time()
            e.info["stolen"] = stolen
            e.info["taken"] = taken
        return e

    def _steal_amqp(self, url: str, burst: float) -> Event:
        from chaos.amqp_steal import steal

        e = self._event("delete-tasks", "broker")
        try:
            names = [worker_direct(w.hostname).name for w in self.procs.workers.values()]
            e.info["stolen"], e.info["taken"] = steal(url, names, burst, TOPIC)
        finally:
            e.t_end = time.time()
        return e

    @contextmanager
    def losing_tasks(self, every: float) -> Iterator[None]:
        """While inside: every ``every`` seconds, a one-second burst of :meth:`steal_tasks`."""
        t = _Stealer(self, every)
        t.start()
        try:
            yield
        finally:
            t.stop()

    # -- the Sentinel deployment ----------------------------------------------------------------

    def _sentinel(self) -> SentinelRedis:
        if self.procs.sentinel is None:
            raise RuntimeError(f"scenario {self.procs.name} has no Sentinel deployment (Scenario.sentinel)")
        return self.procs.sentinel

    def kill_primary(self, *, restart_after: float = 2.0) -> Event:
        """``kill -9`` of the Redis primary. Returns once Sentinel promoted a replica, the killed
        node started again (``restart_after`` s after the promotion) as a replica of the new
        primary, and it is in sync and known to every Sentinel: the next kill finds the deployment
        whole. ``t_end``: that moment."""
        s = self._sentinel()
        node = s.primary()
        e = self._event("primary-kill", s.name(node))
        node.kill()
        e.info["lost_at"] = time.time()
        promoted = s.wait_failover(node.port)
        self._promoted(e, s, promoted)
        time.sleep(restart_after)
        s.deployment.restart_as_replica(node)
        s.wait_replicas()
        e.t_end = time.time()
        log(f"{self.procs.name}: {e.target} killed; {e.info['promoted']} promoted after {e.info['promoted_s']:.1f}s; "
            f"whole again after {e.t_end - e.t:.1f}s")
        return e

    def pause_primary(self, seconds: float) -> Event:
        """SIGSTOP of the Redis primary for ``seconds`` (longer than Sentinel's failover, which must
        happen meanwhile: else the scenario proves nothing and this raises), then SIGCONT: the old
        primary wakes up still believing it is the primary, until Sentinel demotes it. Records the
        error replies it gave meanwhile (``NOREPLICAS``, ``READONLY``); ``t_end``: it is a replica
        in sync again."""
        s = self._sentinel()
        node = s.primary()
        before = s.errorstats(node)
        e = self._event("primary-pause", s.name(node), info={"seconds": seconds})
        s.deployment.pause(node)
        e.info["lost_at"] = time.time()
        try:
            promoted = s.wait_failover(node.port, timeout=seconds)
            self._promoted(e, s, promoted)
            time.sleep(max(0.0, e.t + seconds - time.time()))
        finally:
            s.deployment.resume(node)
        e.info["resumed_at"] = time.time()
        e.info["demoted_s"] = round(s.wait_role(node, "slave"), 2)
        after = s.errorstats(node)
        e.info["old_primary_errors"] = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
        s.wait_replicas()
        e.t_end = time.time()
        log(f"{self.procs.name}: {e.target} paused {seconds:.0f}s; {e.info['promoted']} promoted after "
            f"{e.info['promoted_s']:.1f}s; old primary demoted {e.info['demoted_s']}s after SIGCONT, its error "
            f"replies meanwhile: {e.info['old_primary_errors'] or 'none'}")
        return e

    def unplanned_failovers(self) -> int:
        """Failovers Sentinel made that no fault of this class asked for (a just-promoted primary
        judged down again, for one): their losses and redeliveries would have no event to explain them."""
        return self._sentinel().config_epoch() - self.epoch0 - self.planned_failovers

    def _promoted(self, e: Event, s: SentinelRedis, node: RedisServer) -> None:
        self.planned_failovers += 1
        e.info["promoted"] = s.name(node)
        e.info["promoted_at"] = time.time()
        e.info["promoted_s"] = round(e.info["promoted_at"] - e.t, 3)

    def stale_pair(self) -> tuple[RedisServer, RedisServer]:
        """Two replicas: one to go stale (paused) and one Sentinel must never promote
        (``replica-priority 0``, set here), so a failover can only pick the stale one."""
        s = self._sentinel()
        stale, fresh = s.replicas()[:2]
        s.set_priority(fresh, 0)
        s.set_priority(stale, 100)
        return stale, fresh

    def pause_replica(self, node: RedisServer) -> Event:
        """SIGSTOP of a replica: it misses everything the primary does until it is resumed (it
        catches up then, unless the primary is gone)."""
        s = self._sentinel()
        e = self._event("replica-pause", s.name(node))
        s.deployment.pause(node)
        return e

    def wait_regranted(self, queues: list[int], old_client: str, timeout: float = 30.0) -> float:
        """Seconds until every queue of ``queues`` is owned by a client other than ``old_client``
        (read through the store URL: from the primary)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                owners = self.evidence.owners()
            except redis.RedisError:
                owners = {}
            if owners and all(owners.get(q) not in ("", None, old_client) for q in queues):
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"queues {queues} were not granted to another client within {timeout:.0f} s")

    def fail_over_to_stale(self, stale: RedisServer, stale_event: Event, *, restart_after: float = 2.0) -> Event:
        """``kill -9`` of the primary, then SIGCONT of the paused ``stale`` replica at once, so it is
        the one Sentinel promotes (the other replica has ``replica-priority 0``).

        The state of every queue is read from the primary right before the kill and from the stale
        replica right after its SIGCONT (a replica of a dead primary: what it holds is what it
        will serve once promoted). The queues whose lock (owner, epoch) differs are the *lost
        grants*, recorded in the event with the commits and appends the replica lacks. The killed
        node comes back as a replica ``restart_after`` s after the promotion; ``t_end``: the
        deployment is whole again. Raises if Sentinel promoted another node (nothing would be
        proven)."""
        s = self._sentinel()
        old = s.primary()
        mqs = self.evidence.mqs
        held = s.queue_states(old, mqs)
        e = self._event("primary-kill", s.name(old), info={"stale_since": stale_event.t, "stale": s.name(stale)})
        old.kill()
        e.info["lost_at"] = time.time()
        s.deployment.resume(stale)
        stale_event.t_end = time.time()
        kept = s.queue_states(stale, mqs)
        e.info.update(_lost(held, kept))
        promoted = s.wait_failover(old.port)
        self._promoted(e, s, promoted)
        if promoted is not stale:
            raise RuntimeError(f"Sentinel promoted {s.name(promoted)}, not the stale replica {s.name(stale)}: "
                               "the scenario would prove nothing")
        time.sleep(restart_after)
        s.deployment.restart_as_replica(old)
        s.wait_replicas()
        e.t_end = time.time()
        log(f"{self.procs.name}: {e.target} killed, stale {s.name(stale)} promoted after {e.info['promoted_s']:.1f}s; "
            f"lost grants {[(g['queue'], g['epoch']) for g in e.info['lost_grants']]}, lost commits on "
            f"{e.info['lost_commits']} queue(s), {e.info['lost_appends']} appends lost")
        return e

    # -- bad input ------------------------------------------------------------------------------

    def inject_poison(self, count: int) -> Event:
        """Send ``count`` poison messages, each to a different queue, among the regular traffic."""
        sent = self.traffic.send_poison(count)
        return self._event("poison", "producer", fault=False, queues=[p.queue for p in sent])

    # -- beat -----------------------------------------------------------------------------------

    def kill_beat(self) -> Event:
        b = next((b for b in self.procs.beats if b.alive()), None)
        e = self._event("beat-kill", "beat")
        if b is not None:
            b.kill()
        return e

    def start_beat(self) -> Event:
        e = self._event("beat-start", "beat")
        self.procs.start_beat()
        return e

    @contextmanager
    def two_beats(self) -> Iterator[Event]:
        """A second beat runs alongside the first while inside (duplicated schedules)."""
        e = self._event("beat-double", "beat")
        second = self.procs.start_beat()
        try:
            yield e
        finally:
            second.stop()
            e.t_end = time.time()


def _lost(held: dict[int, QueueState], kept: dict[int, QueueState]) -> dict[str, Any]:
    """What a promoted replica lacks of the old primary's state, per queue: lock grants (another
    owner or epoch), commits (a lower committed offset) and appends (a lower next offset)."""
    grants = [{"queue": q, "owner": h.owner, "epoch": h.epoch, "kept_owner": kept[q].owner,
               "kept_epoch": kept[q].epoch}
              for q, h in sorted(held.items()) if (h.owner, h.epoch) != (kept[q].owner, kept[q].epoch) and h.epoch]
    return {
        "lost_grants": grants,
        "lost_commits": sum(1 for q, h in held.items() if h.offset > kept[q].offset),
        "lost_appends": sum(max(0, h.next - kept[q].next) for q, h in held.items()),
    }


class _Stealer(threading.Thread):
    """Every ``every`` seconds, a one-second burst of taking ConsumeRequest tasks away from the
    Celery broker (lost tasks)."""

    def __init__(self, faults: Faults, every: float) -> None:
        super().__init__(name="chaos-deleter", daemon=True)
        self.faults = faults
        self.every = every
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.every):
            try:
                self.faults.steal_tasks(1.0)
            except redis.RedisError:
                pass  # the Redis under test may be down in the combined scenario

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)

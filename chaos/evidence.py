"""Evidence: everything the checker judges a scenario by, gathered from outside the workers.

* the fault log (:class:`Event`: what the runner did, and when, by the wall clock);
* lock-table samples (:class:`Monitor`: owner, epoch, lease and committed offset of every queue,
  a few times a second, read from the Redis under test);
* the structured records of the ledger Redis (``chaos.records``: listener calls, refused commits,
  beat publishes) and the DLQ.

Evidence only reads; it never changes the state of the cluster it watches.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster

from chaos import records
from chaos.listeners import GROUP
from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.connect import connect
from mqorder.store.log import MessageLog

#: One lock-table sample: (wall time, queue, owner, epoch, lease ms, offset, Redis now ms, pending
#: token, pend_until ms, run ms).
Sample = tuple[float, int, str, int, int, int, int, str, int, int]


def log(msg: str) -> None:
    sys.stderr.write(f"[chaos {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


@dataclass
class Event:
    """One injected fault (or other action) with its wall-clock start and end (seconds)."""

    t: float
    kind: str
    target: str = ""
    t_end: float = 0.0
    queues: list[int] = field(default_factory=list)
    fault: bool = True
    info: dict[str, Any] = field(default_factory=dict)

    def end(self) -> float:
        return self.t_end or self.t


class Monitor(threading.Thread):
    """Samples every queue's lock state (owner, epoch, lease, offset) a few times a second, of the
    chaos group and of each of ``groups`` (``groups-kill``: another group and its topic's queues)."""

    def __init__(self, url: str, mqs: list[MessageQueue], interval: float = 0.2,
                 on_tick: Callable[[], None] | None = None,
                 groups: dict[str, list[MessageQueue]] | None = None) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.url = url
        self.mqs = mqs
        self.interval = interval
        self.on_tick = on_tick
        self.samples: list[Sample] = []
        #: The samples of each of ``groups``, apart: a sample names its queue, not its group.
        self.group_samples: dict[str, list[Sample]] = {g: [] for g in groups or {}}
        #: (group, queue, where its samples go) of every sampled queue, the chaos group's first.
        self.parties: list[tuple[str, MessageQueue, list[Sample]]] = [(GROUP, mq, self.samples) for mq in mqs] + [
            (g, mq, self.group_samples[g]) for g, qs in (groups or {}).items() for mq in qs]
        #: With other groups: the task executions seen on each (group, queue), by their ``runner``
        #: id (``begin.lua``, one per Celery task execution, kept after its run ended): one that
        #: ran queues of two groups is a lingering request that switched to another group's queue.
        self.runners: dict[str, set[tuple[str, int]]] = defaultdict(set)
        self.fields = ("owner", "epoch", "lease", "offset", "pending", "pend_until", "run") + (
            ("runner",) if groups else ())
        self.stop_event = threading.Event()

    def run(self) -> None:
        # A Sentinel URL's client follows a failover: the samples are of whichever node is primary.
        # A cluster's reads each queue on the master serving it now (redirections followed).
        client = connect(self.url, socket_timeout=1, socket_connect_timeout=1)
        cluster = isinstance(client, RedisCluster)
        while not self.stop_event.wait(self.interval):
            if self.on_tick is not None:
                self.on_tick()
            try:
                # TIME has no key, so no place in a cluster's pipeline: asked of one node just before.
                clock = client.time() if cluster else None
                pipe = client.pipeline(transaction=False)
                if clock is None:
                    pipe.time()
                for group, mq, _ in self.parties:
                    pipe.hmget(keys.sub_state(mq.tag, group), *self.fields)
                res = pipe.execute()
            except (redis.RedisError, OSError):
                continue
            t = time.time()
            if clock is None:
                clock, res = res[0], res[1:]
            sec, usec = clock
            now_ms = sec * 1000 + usec // 1000
            for (group, mq, samples), values in zip(self.parties, res, strict=True):
                owner, epoch, lease, offset, pending, pend_until, run = values[:7]
                if len(values) > 7 and values[7]:
                    self.runners[values[7].decode()].add((group, mq.queue_id))
                samples.append((
                    t, mq.queue_id, (owner or b"").decode(), int(epoch or 0), int(lease or 0),
                    int(offset or 0), now_ms, (pending or b"").decode(), int(pend_until or 0), int(run or 0),
                ))
        client.close()


class Evidence:
    """The fault log, the lock-table monitor, and readers of the ledger Redis and the DLQ.

    ``groups``: the consumer groups of the workers beyond the chaos one (``groups-kill``), each
    with the queues of the topic it consumes; the lock table and the records of each are read
    apart (``group=``), those of the chaos group by default."""

    def __init__(self, name: str, url: str, ledger_url: str, brokers: BrokerRegistry,
                 locks: RebalanceLockManager, mqs: list[MessageQueue],
                 groups: dict[str, list[MessageQueue]] | None = None) -> None:
        self.name = name
        self.url = url
        self.brokers = brokers
        self.locks = locks
        self.mqs = mqs
        self.groups = dict(groups or {})
        self.ledger = redis.Redis.from_url(ledger_url)
        self.events: list[Event] = []
        self.monitor: Monitor | None = None

    # -- what the runner does -------------------------------------------------------------------

    def event(self, kind: str, target: str = "", **kw: Any) -> Event:
        e = Event(time.time(), kind, target, **kw)
        self.events.append(e)
        log(f"{self.name}: {kind} {target} {kw.get('queues', '') or ''}".rstrip())
        return e

    def trimmed(self) -> int:
        """Messages retention removed so far: the sum of the queues' first stored offsets."""
        from mqorder.retention.trimmer import first_offsets

        return sum(first_offsets(self.brokers, self.mqs).values())

    # -- the lock table -------------------------------------------------------------------------

    def queues_of(self, group: str) -> list[MessageQueue]:
        """The queues ``group`` consumes (the chaos topic's for the chaos group)."""
        return self.mqs if group == GROUP else self.groups[group]

    def owners(self, group: str = GROUP) -> dict[int, str]:
        """Queue id -> live owner (empty: none) of ``group``'s queues, read from the state hashes:
        the owner whose lease is still ahead of Redis's clock, as ``RebalanceLockManager.lock_entry``
        judges it. Read here in one pipeline, with ``TIME`` asked just before, because
        ``lock_entry`` pipelines ``TIME`` with the read, which redis-py refuses on a Redis Cluster."""
        out: dict[int, str] = {}
        for name, mqs in group_by_broker(self.queues_of(group)).items():
            client = self.brokers.get(name).client
            sec, usec = client.time()
            now = sec * 1000 + usec // 1000
            pipe = client.pipeline(transaction=False)
            for mq in mqs:
                pipe.hmget(keys.sub_state(mq.tag, group), "owner", "lease")
            for mq, (owner, lease) in zip(mqs, pipe.execute(), strict=True):
                out[mq.queue_id] = (owner or b"").decode() if int(lease or 0) > now else ""
        return out

    def group_owners(self, client: str) -> dict[str, list[int]]:
        """The queues ``client`` owns now in each of ``groups`` (a fault's event names them, as its
        ``queues`` name the chaos group's)."""
        return {g: sorted(q for q, o in self.owners(g).items() if o == client) for g in self.groups}

    def wait_all_owned(self, timeout: float) -> None:
        """Wait until every queue of every group has an owner."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(all(self.owners(g).values()) for g in (GROUP, *self.groups)):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.2)
        log(f"warning: not every queue had an owner after {timeout}s")

    def start_monitor(self, on_tick: Callable[[], None] | None = None) -> None:
        self.monitor = Monitor(self.url, self.mqs, on_tick=on_tick, groups=self.groups)
        self.monitor.start()

    def stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop_event.set()
            self.monitor.join(5)

    @property
    def samples(self) -> list[Sample]:
        return list(self.monitor.samples) if self.monitor is not None else []

    @property
    def runners(self) -> dict[str, set[tuple[str, int]]]:
        """The task executions the monitor saw on each (group, queue), in a run with other groups."""
        return {k: set(v) for k, v in self.monitor.runners.items()} if self.monitor is not None else {}

    def samples_of(self, group: str) -> list[Sample]:
        """The lock-table samples of ``group``'s queues."""
        if group == GROUP:
            return self.samples
        return list(self.monitor.group_samples[group]) if self.monitor is not None else []

    # -- the ledger Redis and the DLQ -----------------------------------------------------------

    def entries(self, group: str = GROUP) -> list[records.Entry]:
        """The listener calls of ``group`` (each group's listener writes a list of its own)."""
        ledger = records.LEDGER if group == GROUP else records.group_ledger(group)
        return records.read_all(self.ledger.lrange(ledger, 0, -1), records.Entry)

    def refusals(self) -> list[records.Refusal]:
        return records.read_all(self.ledger.lrange(records.REFUSALS, 0, -1), records.Refusal)

    def published(self) -> list[records.Published]:
        return records.read_all(self.ledger.lrange(records.PUBLISHED, 0, -1), records.Published)

    def dlq(self, group: str = GROUP) -> list[dict[str, str]]:
        mlog = MessageLog(self.brokers)
        try:
            msgs = mlog.read(MessageQueue(keys.dlq_topic(group), "broker-a", 0), 0, 1000)
        except redis.RedisError:
            return []
        return [{**m.properties, "body": m.body.decode(errors="replace")} for m in msgs]

    def close(self) -> None:
        self.ledger.close()

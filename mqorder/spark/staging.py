"""The staging area of a Spark write job: what makes a job all or nothing.

Step by step, for job ``J`` writing topic ``T``:

1. Each task sorts its partition and *stages* its rows per queue into a run, a list
   ``mqorder:{T:b:q}:stage:J:<partition>`` (``stage.lua``, one variadic ``RPUSH`` per chunk). Consumers never read runs. A retried
   or concurrent attempt of the same task stages the same rows at the same positions, so a run
   holds each row once, in order.
2. When every task has succeeded, Spark calls the job's ``commit()``: ``publish`` moves each
   queue's runs into the queue's log through the one append path (``publish_staged.lua`` calling
   ``append_entries`` idempotently by message id, then ``wake_owners``), a chunk per call,
   pipelined over queues. A commit interrupted half way and run again stores only what is missing.
3. When a task fails for good (or the commit refuses the job), Spark calls ``abort()``: ``drop``
   deletes every run the job's tasks registered. A run nobody deletes (the driver died) expires.

4. With option ``waitReplicas`` the commit checks, before publishing, that every broker's primary
   has that many replicas connected, and after publishing waits until they have every row
   (``wait_replicas``: one ``WAIT`` per broker, ``mqorder.store.durable``).

So a consumer sees a job's rows only once the job has succeeded; a failed job leaves nothing in the
logs. Runs of one queue live in that queue's hash tag, the job's run registry on the default
broker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.spark.encoding import StagedRow
from mqorder.spark.queues import QueueRef
from mqorder.store.append import QueueAppender
from mqorder.store.brokers import BrokerRegistry, group_by_broker
from mqorder.store.cluster_route import shard_groups
from mqorder.store.durable import SendWait, wait_after
from mqorder.store.failures import translated
from mqorder.store.replies import text
from mqorder.store.topics import TopicManager

#: Rows moved from staging into a log per script call (a call never holds Redis for long).
PUBLISH_CHUNK = 2000
#: Staging calls sent per round trip.
STAGE_PIPELINE = 16
#: A staging call carries at most about this many bytes, a round trip about this many: large
#: bodies make smaller chunks, so neither Redis nor the task holds gigabytes at once.
CALL_BYTES = 4 * 1024 * 1024
TRIP_BYTES = 32 * 1024 * 1024
#: A publish call moves at most about this many bytes (its rows are held in Lua at once).
PUBLISH_BYTES = 8 * 1024 * 1024
#: Items per staged row in a run's LIST (``stage.lua``): sort key, message id, header, body.
STAGED_ITEMS = 4
#: What running a job again does, said by a commit's ``ReplicasBehindError``.
RERUN = ("Running the job again is safe: every row has a message id, so it stores nothing twice and waits for "
         "the replicas again")


@dataclass
class QueueTotals:
    """What one queue of a job got: rows stored, and rows skipped as already stored (by id)."""

    stored: int = 0
    duplicates: int = 0
    first_offset: int | None = None


@dataclass
class PublishTotals:
    queues: dict[int, QueueTotals] = field(default_factory=dict)

    @property
    def stored(self) -> int:
        return sum(q.stored for q in self.queues.values())

    @property
    def duplicates(self) -> int:
        return sum(q.duplicates for q in self.queues.values())


class StagingArea:
    """The runs of one job on one topic; one per task, one on the committing side."""

    def __init__(self, brokers: BrokerRegistry, topic: str, queues: Sequence[QueueRef], job: str, *,
                 ttl_ms: int, pending_ttl_ms: int = 10_000, timeout: float = 10.0,
                 generated_ids: bool = True) -> None:
        self.brokers = brokers
        #: Ids made from the rows' content (no ``idColumn``): the commit numbers identical rows over
        #: each queue's merged runs (``publish_staged.lua``), not only within each task's run.
        self.generated_ids = generated_ids
        self.topic = topic
        self.queues = {q.index: q for q in queues}
        self.job = job
        self.ttl_ms = ttl_ms
        self.timeout = timeout
        self.appender = QueueAppender(brokers, pending_ttl_ms=pending_ttl_ms, timeout=timeout,
                                      topics=TopicManager(brokers), action="publish")

    def mq(self, index: int) -> MessageQueue:
        q = self.queues[index]
        return MessageQueue(self.topic, q.broker, q.queue_id)

    def run_key(self, index: int, run: int) -> str:
        return keys.stage_run(self.mq(index).tag, self.job, run)

    # -- tasks ---------------------------------------------------------------------------------------

    def register(self, run: int, indexes: Iterable[int]) -> None:
        """Record the runs a task is about to stage, so ``drop`` finds them even if the task dies."""
        members = [f"{i}:{run}" for i in indexes]
        if not members:
            return
        meta = self.brokers.meta
        reg = keys.spark_job_runs(self.job)
        pipe = meta.pipeline(transaction=False)
        pipe.sadd(reg, *members)
        pipe.pexpire(reg, self.ttl_ms)
        pipe.execute()

    def stage(self, index: int, run: int, rows: Sequence[StagedRow], *, chunk: int,
              after_chunk: Any = None) -> int:
        """Stage one run (all its rows, from position 0) in chunks; returns rows newly staged.

        ``after_chunk(rows_sent)`` is called after each round trip (the writer's fault-injection
        hook for tests, a no-op otherwise).
        """
        mq = self.mq(index)
        broker = self.brokers.get(mq.broker_name)
        kl = [keys.stage_run(mq.tag, self.job, run), keys.stage_cursor(mq.tag, self.job)]
        sizes = [len(sk) + len(mid) + len(h) + len(b) for sk, mid, h, b in rows]
        staged = 0
        calls: list[tuple[list[str], list[Any]]] = []
        start = trip_bytes = 0
        n = len(rows)
        while start < n:
            end, call_bytes = start, 0
            while end < n and end - start < chunk and call_bytes < CALL_BYTES:
                call_bytes += sizes[end]
                end += 1
            calls.append((kl, [start, self.ttl_ms, run, *chain.from_iterable(rows[start:end])]))
            trip_bytes += call_bytes
            start = end
            if len(calls) >= STAGE_PIPELINE or trip_bytes >= TRIP_BYTES or start == n:
                with translated(mq.broker_name, broker.safe_url, self.timeout, "stage"):
                    replies = broker.scripts.run_pipelined("stage", calls)
                staged += sum(int(r[0]) for r in replies)
                calls, trip_bytes = [], 0
                if after_chunk is not None:
                    after_chunk(start)
        return staged

    # -- the job's commit and abort --------------------------------------------------------------------

    def publish(self, runs: dict[int, set[int]], *, chunk: int = PUBLISH_CHUNK,
                row_bytes: dict[int, int] | None = None) -> PublishTotals:
        """Move every run of every queue into its log, in order; queues in parallel per broker.

        ``row_bytes`` (average staged row size per queue) shrinks a queue's chunk so one call moves
        about ``PUBLISH_BYTES`` at most.
        """
        sizes = row_bytes or {}
        chunks = {i: max(1, min(chunk, PUBLISH_BYTES // max(1, sizes.get(i, 1)))) for i in runs}
        totals = PublishTotals({i: QueueTotals() for i in runs})
        pending = {i: sorted(r) for i, r in runs.items() if r}
        while pending:
            by_broker = group_by_broker(list(pending), lambda i: self.mq(i))
            done: list[int] = []
            for broker_name, idxs in by_broker.items():
                broker = self.brokers.get(broker_name)
                with translated(broker_name, broker.safe_url, self.timeout, "publish"):
                    replies = self._publish_round(broker, idxs, pending, chunks)
                for i, reply in zip(idxs, replies, strict=True):
                    stored, dups, remaining, first = (int(x) for x in reply[:4])
                    t = totals.queues[i]
                    t.stored += stored
                    t.duplicates += dups
                    if stored and t.first_offset is None:
                        t.first_offset = first
                    if remaining == 0:
                        done.append(i)
            for i in done:
                del pending[i]
        return totals

    def staged_rows(self, runs: dict[int, set[int]]) -> tuple[dict[int, int], dict[int, int]]:
        """Before ``publish``, per queue: rows of ``runs`` an earlier commit of this job already
        published (each run's cursor: a streaming micro-batch whose commit was killed half way is
        replayed under the same job id, and the rows its first commit moved are no longer staged),
        and rows still staged. Each run's time to live is renewed in the same round trip, so what
        this count found cannot expire while the commit publishes it."""
        earlier: dict[int, int] = {}
        staged: dict[int, int] = {}
        for broker_name, idxs in group_by_broker(sorted(i for i in runs if runs[i]), lambda i: self.mq(i)).items():
            broker = self.brokers.get(broker_name)
            with translated(broker_name, broker.safe_url, self.timeout, "publish"):
                pipe = broker.client.pipeline(transaction=False)
                for i in idxs:
                    pipe.hmget(keys.stage_cursor(self.mq(i).tag, self.job), [str(r) for r in sorted(runs[i])])
                    for r in sorted(runs[i]):
                        pipe.llen(self.run_key(i, r))
                        pipe.pexpire(self.run_key(i, r), self.ttl_ms)
                replies = iter(pipe.execute())
                for i in idxs:
                    earlier[i] = sum(int(v) for v in next(replies) if v is not None)
                    items = 0
                    for _ in runs[i]:
                        items += int(next(replies))
                        next(replies)  # PEXPIRE
                    staged[i] = items // STAGED_ITEMS
        return earlier, staged

    def _publish_round(self, broker: Any, idxs: list[int], pending: dict[int, list[int]],
                       chunks: dict[int, int]) -> list[Any]:
        return broker.scripts.run_pipelined("publish_staged", [self._publish_call(i, pending[i], chunks[i]) for i in idxs])

    def _publish_call(self, index: int, runs: list[int], chunk: int) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of ``publish_staged.lua``: the append keys, the runs, then the wake-up tail
        exactly as ``QueueAppender`` builds it for ``send.lua``."""
        mq = self.mq(index)
        tag = mq.tag
        state_keys, wake_args = self.appender.wake_tail(mq)
        kl = [keys.queue_log(tag), keys.queue_next(tag), keys.queue_ids(tag), keys.stage_cursor(tag, self.job)]
        kl.extend(keys.stage_run(tag, self.job, r) for r in runs)
        kl.extend(state_keys)
        args: list[Any] = [len(runs), chunk, self.appender.pending_ttl_ms, self.appender.wake_prefix(mq),
                           1 if self.generated_ids else 0, *runs, *wake_args]
        return kl, args

    def check_replicas(self, wait: SendWait, indexes: Iterable[int]) -> None:
        """Before ``publish``: ``NotEnoughReplicasError`` if a broker of these queues has fewer
        replicas connected than ``wait`` asks for, so nothing is published that could not be
        made durable."""
        for broker_name in group_by_broker(sorted(indexes), lambda i: self.mq(i)):
            broker = self.brokers.get(broker_name)
            with translated(broker_name, broker.safe_url, self.timeout, "publish"):
                self.appender.replicas.before_write(broker, wait, "publish")

    def wait_replicas(self, wait: SendWait, totals: PublishTotals) -> None:
        """After ``publish``: ``WAIT`` once per broker for everything the commit wrote there, over
        all its round trips (the fence write makes it cover them whatever connection ran them);
        ``ReplicasBehindError`` (the rows ARE published) naming each broker that fell short."""
        by_broker = group_by_broker(sorted(totals.queues), lambda i: self.mq(i))
        targets = []
        for name, idxs in by_broker.items():
            broker = self.brokers.get(name)
            # On a Redis Cluster each shard replicates on its own: one fence and WAIT per shard.
            for part in shard_groups(broker.client, idxs, lambda i: self.mq(i).tag):
                targets.append((broker, keys.queue_next(self.mq(part[0]).tag),
                                sum(totals.queues[i].stored + totals.queues[i].duplicates for i in part)))
        wait_after(self.appender.replicas, wait, targets, timeout=self.timeout, action="publish", resend=RERUN)

    def registered_runs(self) -> dict[int, set[int]]:
        runs: dict[int, set[int]] = defaultdict(set)
        for m in self.brokers.meta.smembers(keys.spark_job_runs(self.job)):
            index, run = text(m).split(":")
            if int(index) in self.queues:
                runs[int(index)].add(int(run))
        return runs

    def drop(self) -> int:
        """Delete every run of the job (abort, or after a refused commit); returns runs deleted."""
        runs = self.registered_runs()
        deleted = 0
        by_broker = group_by_broker(list(runs), lambda i: self.mq(i))
        for broker_name, idxs in by_broker.items():
            # One DEL per key, all in one pipeline: the keys of different queues are in different
            # slots on a Redis Cluster (one DEL of them all would be CROSSSLOT), and redis-py's
            # cluster pipeline sends each node its DELs, every node in the same round trip.
            pipe = self.brokers.get(broker_name).client.pipeline(transaction=False)
            n_runs = 0
            for i in idxs:
                for r in runs[i]:
                    pipe.delete(self.run_key(i, r))
                    n_runs += 1
            for i in idxs:
                pipe.delete(keys.stage_cursor(self.mq(i).tag, self.job))
            deleted += sum(int(n) for n in pipe.execute()[:n_runs])
        self.brokers.meta.delete(keys.spark_job_runs(self.job))
        return deleted

    def forget(self) -> None:
        """After a successful publish: the run registry is no longer needed."""
        self.brokers.meta.delete(keys.spark_job_runs(self.job))

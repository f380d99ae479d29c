"""The batch and streaming writers of ``format("mqorder")``: stage in tasks, publish on commit.

``write()`` runs once per task on an executor: it reads its whole partition (Arrow batches, the
fast path), checks and orders it (``encoding``), and stages each queue's rows (``staging``).
``commit()`` runs once per job when every task succeeded (in a Python process Spark starts for
it, not the driver's): it refuses the job if any task found bad rows, else publishes every run
into the logs and records a report. ``abort()`` deletes what the tasks staged.

A stream does the same per micro-batch, with the batch id in the job id and in every message id:
a micro-batch replayed after a restart (same batch id, same rows) stores nothing twice.

With option ``waitReplicas`` the commit is durable too: it refuses the job before publishing if a
broker has fewer replicas connected than asked, and once published waits for them (one ``WAIT``
per broker); short of them the job fails with its report's status ``unreplicated``: the rows ARE
published, and the job run again stores nothing twice and waits again.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from mqorder import keys
from mqorder.errors import MessageError, NotEnoughReplicasError, ReplicasBehindError
from mqorder.spark.encoding import Refusal, encode_partition
from mqorder.spark.plan import WritePlan
from mqorder.spark.staging import PublishTotals, StagingArea
from mqorder.spark.worker_gc import freeze_imports

log = logging.getLogger("mqorder.spark")

#: How long a job's report stays readable (``mqorder.spark.publish`` reads it right away).
REPORT_TTL_S = 24 * 3600


@dataclass
class StagedRuns(WriterCommitMessage):
    """What one task staged: rows per queue index in its run, or why it refused its partition."""

    job: str
    run: int
    attempt: int
    rows: dict[int, int] = field(default_factory=dict)
    skipped_nulls: int = 0
    #: Bytes staged per queue index (sizes the commit's publish calls).
    bytes: dict[int, int] = field(default_factory=dict)
    #: Seconds the task spent receiving its rows, checking and ordering them, and staging them.
    seconds: dict[str, float] = field(default_factory=dict)
    refusal: Refusal | None = None


class JobRefusedError(MessageError):
    """Rows of the job break a rule (null key, body too large...): nothing of the job was published."""


class _Staging:
    """What the batch and the stream writers share: stage a partition, publish or drop a job."""

    plan: WritePlan

    # -- hooks (no-ops; tests override them to inject faults) --------------------------------------

    def run_id(self, ctx: TaskContext | None) -> int:
        """The run a task stages into: its partition id, the same for every attempt of the task."""
        return ctx.partitionId() if ctx is not None else 0

    def after_chunk(self, ctx: TaskContext | None, rows_done: int, rows_total: int) -> None:
        """Called after each staging round trip, with the rows of the partition staged so far."""

    # -- tasks ------------------------------------------------------------------------------------------

    def _stage_partition(self, batches: Iterator[pa.RecordBatch], job: str, id_prefix: str) -> StagedRuns:
        # A partition allocates millions of small objects that all live until it is staged: the
        # cyclic collector would only walk them over and over (about 10 % of the task).
        freeze_imports()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._stage_rows(batches, job, id_prefix)
        finally:
            if was_enabled:
                gc.enable()

    def _stage_rows(self, batches: Iterator[pa.RecordBatch], job: str, id_prefix: str) -> StagedRuns:
        ctx = TaskContext.get()
        run = self.run_id(ctx)
        attempt = ctx.attemptNumber() if ctx is not None else 0
        t0 = time.perf_counter()
        batch_list = list(batches)
        if not batch_list or not any(b.num_rows for b in batch_list):
            return StagedRuns(job, run, attempt)
        table = pa.Table.from_batches(batch_list)
        t1 = time.perf_counter()
        enc = encode_partition(table, self.plan, id_prefix=id_prefix)
        t2 = time.perf_counter()
        if enc.refusal:
            return StagedRuns(job, run, attempt, refusal=enc.refusal, skipped_nulls=enc.skipped_nulls)
        if not enc.runs:
            return StagedRuns(job, run, attempt, skipped_nulls=enc.skipped_nulls)
        brokers = self.plan.conn.registry()
        try:
            area = self._area(brokers, job)
            area.register(run, enc.runs)
            total = sum(len(r) for r in enc.runs.values())
            done = 0
            for index, rows in enc.runs.items():
                area.stage(index, run, rows, chunk=self.plan.stage_chunk,
                           after_chunk=lambda sent, d=done: self.after_chunk(ctx, d + sent, total))
                done += len(rows)
        finally:
            brokers.close()
        sizes = {i: sum(len(sk) + len(mid) + len(h) + len(b) for sk, mid, h, b in r) for i, r in enc.runs.items()}
        timing = {"input": t1 - t0, "encode": t2 - t1, "stage": time.perf_counter() - t2}
        return StagedRuns(job, run, attempt, {i: len(r) for i, r in enc.runs.items()}, enc.skipped_nulls, sizes,
                          timing)

    def _area(self, brokers, job: str) -> StagingArea:
        p = self.plan
        return StagingArea(brokers, p.topic, p.queues, job, ttl_ms=p.staging_ttl_ms,
                           pending_ttl_ms=p.conn.pending_ttl_ms, timeout=max(p.conn.timeout, 10.0),
                           generated_ids=p.id_column is None)

    # -- the job ----------------------------------------------------------------------------------------

    def _commit(self, messages: list[StagedRuns | None], job: str, batch_id: int | None = None) -> None:
        started = time.time()
        msgs = [m for m in messages if m is not None]
        job = _job_of(msgs, job)
        brokers = self.plan.conn.registry()
        try:
            area = self._area(brokers, job)
            refusal = Refusal()
            for m in msgs:
                if m.refusal:
                    refusal.add(m.refusal)
            skipped = sum(m.skipped_nulls for m in _one_per_run(msgs))
            if refusal:
                area.drop()
                text = (f"nothing of this job was published to topic {self.plan.topic!r}: "
                        + refusal.describe(self.plan.key, self.plan.order_by, self.plan.conn.max_message_size))
                self._report(brokers, job, {"status": "refused", "error": text, "skipped_nulls": skipped})
                raise JobRefusedError(text)
            runs: dict[int, set[int]] = defaultdict(set)
            expected: dict[int, int] = defaultdict(int)
            nbytes: dict[int, int] = defaultdict(int)
            for m in _one_per_run(msgs):
                for index, n in m.rows.items():
                    runs[index].add(m.run)
                    expected[index] += n
                    nbytes[index] += m.bytes.get(index, 0)
            wait = self.plan.wait
            if wait is not None:
                try:
                    area.check_replicas(wait, runs)
                except NotEnoughReplicasError as exc:
                    area.drop()
                    self._report(brokers, job, {"status": "refused", "error": str(exc), "skipped_nulls": skipped})
                    raise
            earlier, staged = area.staged_rows(runs)
            gone = {i: short for i in runs if (short := expected[i] - earlier.get(i, 0) - staged.get(i, 0)) > 0}
            if gone:
                # All or nothing: publishing the rest would put those rows, when the job is run
                # again, after later rows of their keys.
                area.drop()
                text = (f"nothing of job {job} was published to topic {self.plan.topic!r}: "
                        f"{sum(gone.values()):,} staged rows (queues {sorted(gone)}) were gone at its commit: they "
                        "expired (a task staged longer than option stagingTtl before the job committed: raise it) "
                        "or were deleted. Run the job again")
                if any(earlier.values()):
                    text += (f" (an earlier, interrupted commit of this job had published "
                             f"{sum(earlier.values()):,} rows: the re-run stores each of them once)")
                self._report(brokers, job, {"status": "refused", "error": text, "skipped_nulls": skipped})
                raise JobRefusedError(text)
            totals = area.publish(runs, row_bytes={i: nbytes[i] // max(1, expected[i]) for i in runs})
            for i, n in earlier.items():  # stored by an interrupted commit of this job: already stored
                totals.queues[i].duplicates += n
            area.forget()
            missing = {i: expected[i] - (t.stored + t.duplicates) for i, t in totals.queues.items()
                       if t.stored + t.duplicates != expected[i]}
            report = _report_fields(totals, expected, skipped, started, batch_id)
            report["tasks"] = len(msgs)
            report["task_seconds"] = {k: round(sum(m.seconds.get(k, 0.0) for m in msgs), 3)
                                      for k in ("input", "encode", "stage")}
            report["retried_tasks"] = sum(1 for m in msgs if m.attempt > 0)
            if missing:
                report["status"] = "incomplete"
                self._report(brokers, job, report)
                raise MessageError(
                    f"staged rows of job {job} were missing at commit ({sum(missing.values()):,} rows, queues "
                    f"{sorted(missing)}): they expired (raise option stagingTtl) or were deleted. The rows that "
                    "were found are published; run the job again to publish the rest (ids make it exactly once)")
            if wait is not None:
                try:
                    area.wait_replicas(wait, totals)
                except ReplicasBehindError as exc:
                    report["status"] = "unreplicated"
                    report["error"] = str(exc)
                    self._report(brokers, job, report)
                    raise
                report["replicas"] = wait.replicas
            self._report(brokers, job, report)
            log.info("mqorder: job %s published %d rows to %s (%d already stored)", job, totals.stored,
                     self.plan.topic, totals.duplicates)
            if skipped:
                # A plain df.write has no report to read this from (publish() returns it): said here,
                # not only in the job's Redis record (a new user saw 10 of 50 rows gone without a word).
                log.warning("mqorder: job %s left out %d row(s) with a null key, orderBy, body or id (onNull=skip); "
                            "its report: HGETALL %s", job, skipped, keys.spark_job(job))
        finally:
            brokers.close()

    def _abort(self, messages: list[StagedRuns | None], job: str) -> None:
        job = _job_of([m for m in messages if m is not None], job)
        brokers = self.plan.conn.registry()
        try:
            deleted = self._area(brokers, job).drop()
            report = brokers.meta.hget(keys.spark_job(job), "status")
            if report is None:
                self._report(brokers, job, {"status": "aborted", "runs_deleted": deleted})
        finally:
            brokers.close()

    def _report(self, brokers, job: str, fields: dict[str, object]) -> None:
        key = keys.spark_job(job)
        pipe = brokers.meta.pipeline(transaction=False)
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in fields.items()})
        pipe.expire(key, REPORT_TTL_S)
        pipe.execute()


def _job_of(msgs: list[StagedRuns], planned: str) -> str:
    """The job the tasks staged under. Spark may build a new writer for the commit (it does for
    every micro-batch of a stream), so the tasks' messages are what names the job."""
    jobs = {m.job for m in msgs}
    if len(jobs) > 1:
        raise RuntimeError(f"commit messages of several jobs: {sorted(jobs)}")
    return jobs.pop() if jobs else planned


def _one_per_run(msgs: list[StagedRuns]) -> list[StagedRuns]:
    """Spark gives one message per partition; keep one per run all the same (a run staged twice,
    by two attempts at once, is one run)."""
    seen: dict[int, StagedRuns] = {}
    for m in msgs:
        seen.setdefault(m.run, m)
    return list(seen.values())


def _report_fields(totals: PublishTotals, expected: dict[int, int], skipped: int, started: float,
                   batch_id: int | None) -> dict[str, object]:
    out: dict[str, object] = {
        "status": "published",
        "rows": sum(expected.values()),
        "stored": totals.stored,
        "duplicates": totals.duplicates,
        "skipped_nulls": skipped,
        "queues": {str(i): {"rows": expected[i], "stored": t.stored, "duplicates": t.duplicates,
                            "first_offset": t.first_offset} for i, t in sorted(totals.queues.items())},
        "commit_seconds": round(time.time() - started, 3),
    }
    if batch_id is not None:
        out["batch_id"] = batch_id
    return out


class MQOrderWriter(_Staging, DataSourceArrowWriter):
    """``df.write.format("mqorder")``: one job, all or nothing."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedRuns:
        return self._stage_partition(iterator, self.plan.job_id, "")

    def commit(self, messages: list[StagedRuns | None]) -> None:  # type: ignore[override]
        self._commit(messages, self.plan.job_id)

    def abort(self, messages: list[StagedRuns | None]) -> None:  # type: ignore[override]
        self._abort(messages, self.plan.job_id)


class MQOrderStreamWriter(_Staging, DataSourceStreamArrowWriter):
    """``df.writeStream.format("mqorder")``: each micro-batch is one all-or-nothing job.

    The job of batch ``B`` is ``<stream id>x<B>`` (the stream id derives from the checkpoint
    location) and the default message ids start with ``B.``, so a batch replayed after a failure
    (Spark replays the same rows under the same batch id) publishes nothing twice, even if its
    first run had committed.
    """

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def _batch_id(self) -> int:
        ctx = TaskContext.get()
        raw = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        if raw is None:
            raise RuntimeError("mqorder stream writer: Spark gave no streaming.sql.batchId to the task")
        return int(raw)

    def _job(self, batch_id: int) -> str:
        return f"{self.plan.job_id}x{batch_id}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> StagedRuns:
        batch_id = self._batch_id()
        return self._stage_partition(iterator, self._job(batch_id), f"{batch_id}.")

    def commit(self, messages: list[StagedRuns | None], batchId: int) -> None:  # type: ignore[override]
        self._commit(messages, self._job(batchId), batchId)

    def abort(self, messages: list[StagedRuns | None], batchId: int) -> None:  # type: ignore[override]
        self._abort(messages, self._job(batchId))

"""``spark.readStream.format("mqorder")``: micro-batches by offset ranges, checkpointed by Spark.

An offset is ``{"<queue index>": <next offset to read>}``. Spark stores the end offset of every
micro-batch in its checkpoint before it runs the batch, and a restarted query replays a batch
from the stored offsets: since a queue's log is append-only and read by offset, the replay reads
exactly the same messages, which is what makes the stream exactly once into an idempotent sink
(Spark's file sink, or ``format("mqorder")`` itself).

``latestOffset`` never goes past what is stored (each queue's next offset), and honours
``maxOffsetsPerTrigger`` (spread over the queues with a backlog, oldest work first) and
``Trigger.AvailableNow`` (the target is fixed when the query starts).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from mqorder.spark.options import ReadOptions
from mqorder.spark.reader import (
    EARLIEST,
    RangeGroup,
    bounds,
    parse_offsets,
    plan_partitions,
    queue_spans,
    read_group,
    resolve,
)
from mqorder.spark.worker_gc import freeze_imports

Offset = dict[str, int]


def _to_offset(d: dict[int, int]) -> Offset:
    return {str(k): int(v) for k, v in sorted(d.items())}


def _from_offset(o: dict) -> dict[int, int]:
    return {int(k): int(v) for k, v in o.items()}


def cap(start: dict[int, int], latest: dict[int, int], max_rows: int) -> dict[int, int]:
    """At most ``max_rows`` offsets past ``start`` in total, shared round-robin over queues with a
    backlog so no queue starves; deterministic (Spark may call this again for the same start).

    The queue served first turns with ``start`` (its offsets' sum, modulo the queues with a
    backlog): with fewer rows than such queues, serving them from the lowest index each time
    read only the first ``max_rows`` queues for as long as they had a backlog."""
    end = dict(start)
    backlog = {i: latest[i] - start.get(i, 0) for i in latest if latest[i] > start.get(i, 0)}
    budget = max_rows
    turn = sum(start.values())
    while budget > 0 and backlog:
        share = max(1, budget // len(backlog))
        order = sorted(backlog)
        k = turn % len(order)
        for i in order[k:] + order[:k]:
            take = min(share, backlog[i], budget)
            end[i] = end.get(i, 0) + take
            backlog[i] -= take
            budget -= take
            if budget == 0:
                break
        backlog = {i: n for i, n in backlog.items() if n > 0}
    for i in latest:
        end.setdefault(i, latest[i])
    return end


class MQOrderStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        brokers = opts.conn.registry()
        try:
            self.spans = queue_spans(brokers, opts.topic)
        finally:
            brokers.close()
        self._target: dict[int, int] | None = None

    def _stored(self) -> dict[int, int]:
        brokers = self.opts.conn.registry()
        try:
            limits = bounds(brokers, self.opts.topic, self.spans)
        finally:
            brokers.close()
        return {i: nxt for i, (_, nxt) in limits.items()}

    def initialOffset(self) -> Offset:
        brokers = self.opts.conn.registry()
        try:
            limits = bounds(brokers, self.opts.topic, self.spans)
        finally:
            brokers.close()
        wanted = parse_offsets(self.opts.starting, self.opts.topic, self.spans, EARLIEST, "startingOffsets")
        return _to_offset(resolve(wanted, limits))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_offsets_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._stored()

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        latest = self._target if self._target is not None else self._stored()
        begin = _from_offset(start)
        # Never behind where the query already is (a queue's counter cannot go back, but be safe).
        latest = {i: max(n, begin.get(i, 0)) for i, n in latest.items()}
        if isinstance(limit, ReadMaxRows):
            return _to_offset(cap(begin, latest, limit.max_rows))
        return _to_offset(latest)

    def partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        return plan_partitions(self.opts.topic, self.spans, _from_offset(start), _from_offset(end),
                               self.opts.max_rows_per_partition, self.opts.min_partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        freeze_imports()
        if isinstance(partition, RangeGroup):  # nothing to read gives Spark's placeholder partition
            yield from read_group(self.opts.conn, partition)

    def commit(self, end: Offset) -> None:
        """Nothing to release: offsets live in Spark's checkpoint, the log is read-only here."""

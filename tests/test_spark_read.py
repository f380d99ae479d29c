"""Topic → DataFrame on real Spark and real Redis: batch reads by offset range, streams into a file sink."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mqorder import Producer

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def produce(p: Producer, topic: str, n: int, start: int = 0) -> dict[str, tuple[int, int, str, str]]:
    """``n`` messages over 9 keys; msg id -> (queue, offset, key, body text)."""
    queues = p.describe_topic(topic).message_queues
    out = {}
    for i in range(start, start + n):
        key = f"k{i % 9}"
        res = p.send_orderly(topic, f"m{i}".encode(), sharding_key=key, keys=key, tags="T" if i % 2 else None,
                             properties={"n": str(i)} if i % 3 == 0 else None)
        out[res.msg_id] = (queues.index(res.message_queue), res.queue_offset, key, f"m{i}")
    return out


def test_batch_read_gives_every_stored_message_and_honours_offsets(spark, redis_url: str) -> None:
    from pyspark.errors import PySparkException

    with Producer(redis_url) as p:
        p.create_topic("events", queues=3)
        sent = produce(p, "events", 90)
    per_queue = {q: sum(1 for v in sent.values() if v[0] == q) for q in range(3)}

    def read(**opts: str):
        r = spark.read.format("mqorder").option("topic", "events")
        for k, v in opts.items():
            r = r.option(k, v)
        return r.load()

    rows = read().collect()
    assert len(rows) == 90
    for row in rows:
        q, off, key, body = sent[row.msg_id]
        assert (row.topic, row.queue, row.offset, row.key, bytes(row.body)) == ("events", q, off, key, body.encode())
        i = int(body[1:])
        assert row.tags == ("T" if i % 2 else None)
        assert row.properties == ({"n": str(i)} if i % 3 == 0 else {})
        assert row.born_timestamp is not None and row.store_timestamp >= row.born_timestamp.replace(microsecond=0)

    # Offsets as in Spark's Kafka source: JSON per queue (-2 earliest, -1 latest), or the topic's object.
    part = read(startingOffsets='{"0": 5, "2": -1}', endingOffsets='{"events": {"0": 10}}').collect()
    got = sorted((r.queue, r.offset) for r in part)
    assert got == [(0, o) for o in range(5, 10)] + [(1, o) for o in range(per_queue[1])]
    assert read(startingOffsets="latest").count() == 0
    # Ranges never pass what is stored.
    assert read(endingOffsets='{"1": 100000}').filter("queue = 1").count() == per_queue[1]

    # Partitions are groups of queue ranges: at least minPartitions, at most maxRowsPerPartition
    # offsets each, their count a multiple of minPartitions (13 groups of 7 -> 14 groups of 7).
    split = read(maxRowsPerPartition="7", minPartitions="2")
    assert split.rdd.getNumPartitions() == 2 * math.ceil(math.ceil(90 / 7) / 2) == 14
    assert sorted((r.queue, r.offset) for r in split.select("queue", "offset").collect()) == sorted(
        (q, off) for q, off, _, _ in sent.values())
    assert read(minPartitions="1").rdd.getNumPartitions() == 1
    assert read(minPartitions="5").rdd.getNumPartitions() == 5
    with pytest.raises(PySparkException, match="minPartitions"):
        read(minPartitions="0").collect()

    with pytest.raises(PySparkException, match="startingOffsets"):
        read(startingOffsets="yesterday").collect()
    with pytest.raises(PySparkException, match="has no queue 7"):
        read(startingOffsets='{"7": 0}').collect()


@pytest.mark.parametrize("sizes, max_rows, min_partitions", [
    ([90, 0, 7, 33], 7, 2), ([5, 5, 5], 250_000, 2), ([1], 10, 4), ([100, 1, 1, 1, 1], 30, 3), ([18_750] * 16, 250_000, 2),
])
def test_partitions_are_equal_groups_of_queue_ranges_covering_every_offset_once(
        sizes: list[int], max_rows: int, min_partitions: int) -> None:
    from mqorder.spark.queues import QueueRef
    from mqorder.spark.reader import partition_count, plan_partitions

    spans = [QueueRef(i, "broker-a", i) for i in range(len(sizes))]
    start = {i: 10 * i for i in range(len(sizes))}
    end = {i: 10 * i + n for i, n in enumerate(sizes)}
    groups = plan_partitions("t", spans, start, end, max_rows, min_partitions)
    total = sum(sizes)
    assert len(groups) == partition_count(total, max_rows, min_partitions) == min(
        total, min_partitions * math.ceil(max(min_partitions, math.ceil(total / max_rows)) / min_partitions))
    got = [(r.span.index, o) for g in groups for r in g.ranges for o in range(r.start, r.end)]
    assert got == [(i, o) for i in range(len(sizes)) for o in range(start[i], end[i])]  # once each, in order
    rows = [sum(r.end - r.start for r in g.ranges) for g in groups]
    assert max(rows) <= min(max_rows, math.ceil(total / len(groups))) and min(rows) >= 1
    assert all(r.start < r.end for g in groups for r in g.ranges)


def test_stream_read_into_a_file_sink_is_exactly_once_across_restarts(spark, redis_url: str, tmp_path: Path) -> None:
    with Producer(redis_url) as p:
        p.create_topic("feed", queues=3)
        sent = produce(p, "feed", 150)

        def run() -> list:
            q = (spark.readStream.format("mqorder").option("topic", "feed").option("startingOffsets", "earliest")
                 .option("maxOffsetsPerTrigger", "40").load()
                 .writeStream.format("parquet").option("path", str(tmp_path / "out"))
                 .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())
            assert q.awaitTermination(180), "the stream did not finish"
            assert q.exception() is None
            return [b for b in q.recentProgress if b["numInputRows"] > 0]

        first = run()
        assert len(first) >= 4  # 150 offsets, at most 40 per micro-batch
        assert all(b["numInputRows"] <= 40 for b in first)
        sent.update(produce(p, "feed", 100, start=150))
        second = run()  # restarted from the checkpoint: only what arrived since
        assert sum(b["numInputRows"] for b in second) == 100

    out = spark.read.parquet(str(tmp_path / "out"))
    rows = out.select("msg_id", "queue", "offset").collect()
    assert len(rows) == 250
    assert sorted(r.msg_id for r in rows) == sorted(sent)
    assert len({(r.queue, r.offset) for r in rows}) == 250

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

    split = read(maxRowsPerPartition="7")
    assert split.rdd.getNumPartitions() == sum(math.ceil(n / 7) for n in per_queue.values())
    assert split.count() == 90

    with pytest.raises(PySparkException, match="startingOffsets"):
        read(startingOffsets="yesterday").collect()
    with pytest.raises(PySparkException, match="has no queue 7"):
        read(startingOffsets='{"7": 0}').collect()


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

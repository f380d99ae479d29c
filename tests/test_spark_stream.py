"""Stream → topic on real Spark and real Redis: a micro-batch replayed after a crash stores nothing twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.client.selector import queue_index
from tests.spark_support import staged_keys, stored

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

ROWS_PER_BATCH = 50


def test_stream_write_restarted_from_its_checkpoint_is_exactly_once_and_ordered(
    spark, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions as F

    with Producer(redis_url) as p:
        p.create_topic("ticks", queues=4)
    ticks = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", ROWS_PER_BATCH)
             .option("numPartitions", 2).load()
             .select((F.col("value") % 7).cast("string").alias("key"), F.col("value"),
                     F.concat(F.lit("v"), F.col("value").cast("string")).alias("body")))

    def start(fmt: str, **trigger: bool):
        w = (ticks.writeStream.format(fmt).option("topic", "ticks").option("key", "key").option("orderBy", "value")
             .option("body", "body").option("stageChunk", "16").option("checkpointLocation", str(tmp_path / "ckpt")))
        return (w.trigger(**trigger) if trigger else w).start()

    def run(fmt: str, **trigger: bool) -> str:
        """Start the query and wait for it; its error's text ("": none). Spark gives a Python
        process it starts 10 s to connect back (not configurable): on a loaded machine one may not
        make it, and the query fails before its sink ran. Starting again from the checkpoint is
        then what this test is about anyway (as ``spark_kill_driver`` does)."""
        for attempt in range(1, 4):
            q = start(fmt, **trigger)
            try:
                assert q.awaitTermination(180), "the query did not end within 180 s"
                err = str(q.exception() or "")
            except StreamingQueryException as exc:
                err = str(exc)
            if "failed to connect back" not in err or attempt == 3:
                return err
            time.sleep(2.0 * attempt)
        raise AssertionError("unreachable")

    # Micro-batch 2 is published, then the query dies before Spark checkpoints it as done.
    assert "after micro-batch 2 was published" in run("mqorder_commit_then_crash")
    assert r.get("test:crashed-after-commit") == b"1"
    assert sum(len(m) for m in stored(redis_url, "ticks").values()) == 3 * ROWS_PER_BATCH

    # Restarted from the checkpoint: batch 2 is replayed with the same rows, then batches 3 and 4.
    for _ in range(3):
        assert run("mqorder", once=True) == ""

    reports = [{k.decode(): json.loads(v) for k, v in r.hgetall(key).items()}
               for key in r.scan_iter(match="mqorder:spark:job:*") if not key.endswith(b":runs")]
    by_batch: dict[int, list[dict]] = {}
    for rep in reports:
        by_batch.setdefault(rep["batch_id"], []).append(rep)
    # One report per batch (the job of a batch is the same in every run); batch 2's is its replay's,
    # which found every id already stored.
    assert all(len(reps) == 1 for reps in by_batch.values())
    assert (by_batch[2][0]["stored"], by_batch[2][0]["duplicates"]) == (0, ROWS_PER_BATCH)
    assert all(by_batch[b][0]["stored"] == ROWS_PER_BATCH for b in by_batch if b != 2)
    last = max(by_batch)
    assert last >= 4

    values = []
    for queue, msgs in stored(redis_url, "ticks").items():
        prev: dict[str, int] = {}
        for _, key, _, body in msgs:
            v = int(body.decode()[1:])
            assert key == str(v % 7) and queue_index(key, 4) == queue
            assert prev.get(key, -1) < v, f"key {key}: value {v} after {prev.get(key)}"
            prev[key] = v
            values.append(v)
    assert sorted(values) == list(range((last + 1) * ROWS_PER_BATCH))  # no gap, no duplicate
    assert staged_keys(r) == []

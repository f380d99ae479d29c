"""``bench.spark_floor``'s source is a fair floor: the reader's schema, the rows asked for, in the
partitions asked for, with values of the reader's shape (so a count of it costs Spark what a count
of a topic does, less the reading)."""

from __future__ import annotations

from collections import Counter

import pytest

from mqorder import Producer

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def test_the_floor_source_has_the_readers_schema_rows_and_partitions(spark, redis_url: str) -> None:
    from bench.spark_floor import floor_source

    with Producer(redis_url) as p:
        p.create_topic("floor_shape", queues=2)
        p.send_orderly("floor_shape", b"x" * 100, sharding_key="k")
    real = spark.read.format("mqorder").option("topic", "floor_shape").load()

    spark.dataSource.register(floor_source(1000, 3))
    floor = spark.read.format("mqorder_floor").load()

    assert floor.schema == real.schema
    assert floor.rdd.getNumPartitions() == 3
    assert floor.count() == 1000
    rows = floor.collect()
    assert Counter(r.queue for r in rows) == {0: 334, 1: 333, 2: 333}
    assert len({(r.queue, r.msg_id) for r in rows}) == 1000
    assert all(len(r.body) == 100 and len(r.msg_id) == 32 and r.key.startswith("key-") for r in rows)
    assert all(r.tags is None and r.properties == {} and r.store_timestamp > r.born_timestamp for r in rows)

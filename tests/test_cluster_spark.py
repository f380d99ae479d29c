"""Spark on a Redis Cluster: a DataFrame published to a topic whose queues are spread over the
three shards of a real cluster (option ``redisUrl`` = ``redis+cluster://``), every row checked in
its key's queue in order, read back with ``spark.read.format("mqorder")``, and a refused job
leaving nothing staged on any shard. The one Spark session of the test process is the
``spark`` fixture of ``tests/spark_support.py``."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from redis.crc import key_slot

from mqorder import Producer
from mqorder.client.selector import queue_index
from mqorder.spark.queues import QueueRef
from mqorder.spark.staging import StagingArea
from mqorder.store.log import MessageLog
from mqorder.testing.cluster import ClusterDeployment
from tests.spark_support import stored
from tests.test_spark_staging import staged_row

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

QUEUES = 9
SCHEMA = "tailnum STRING, dep_ts BIGINT, payload STRING"


@pytest.fixture(scope="module")
def cdep() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3) as d:
        yield d


@pytest.fixture
def url(cdep: ClusterDeployment) -> str:
    for node in cdep.nodes[: cdep.masters]:
        node.flushall()
    return cdep.url()


def flights(n_keys: int, per_key: int, seed: int) -> list[tuple[str, int, str]]:
    """Rows whose per-key order (dep_ts) is not the input order."""
    rnd = random.Random(seed)
    rows = [(f"N{k:03d}", ts, f"N{k:03d}|{ts}") for k in range(n_keys) for ts in rnd.sample(range(per_key * 10), per_key)]
    rnd.shuffle(rows)
    return rows


def leftovers(cdep: ClusterDeployment) -> list[bytes]:
    """Staging runs, cursors and run registries on any master (none once a job committed or aborted)."""
    out: list[bytes] = []
    for node in cdep.nodes[: cdep.masters]:
        c = cdep.client(node)
        out += list(c.scan_iter(match="mqorder:*stage:*")) + list(c.scan_iter(match="mqorder:spark:job:*:runs"))
    return out


def create(cdep: ClusterDeployment, url: str, topic: str) -> None:
    with Producer(url) as p:
        p.create_topic(topic, queues=QUEUES)
        ports = {cdep.master_of_slot(key_slot(mq.tag.encode())).port for mq in p.describe_topic(topic).message_queues}
    assert len(ports) == cdep.masters  # the topic's queues are on every shard


def check_in_order(url: str, topic: str, rows: list[tuple[str, int, str]]) -> None:
    """Every row once, in its key's queue, each key's rows in dep_ts order."""
    seen = []
    for q, msgs in stored(url, topic).items():
        last: dict[str, int] = {}
        for _, key, _, body in msgs:
            k, ts = body.decode().rsplit("|", 1)
            assert key == k and queue_index(k, QUEUES) == q, f"key {k!r} stored in queue {q}"
            assert last.get(k, -1) < int(ts), f"key {k!r}: dep_ts {ts} after {last.get(k)}"
            last[k] = int(ts)
            seen.append((k, int(ts)))
    assert sorted(seen) == sorted((k, ts) for k, ts, _ in rows)


def test_publish_to_a_cluster_topic_orders_every_key_once_and_reads_back(spark, cdep: ClusterDeployment,
                                                                         url: str) -> None:
    import mqorder.spark as ms

    create(cdep, url, "flights")
    rows = flights(n_keys=30, per_key=20, seed=5)
    df = spark.createDataFrame(rows, SCHEMA).repartition(3)
    report = ms.publish(df, "flights", key="tailnum", order_by="dep_ts", body="payload", redis_url=url)
    assert (report.rows, report.stored, report.duplicates) == (len(rows), len(rows), 0)
    check_in_order(url, "flights", rows)
    assert leftovers(cdep) == []
    again = ms.publish(df, "flights", key="tailnum", order_by="dep_ts", body="payload", redis_url=url)
    assert (again.stored, again.duplicates) == (0, len(rows))  # ids known on every shard

    read = spark.read.format("mqorder").option("topic", "flights").option("redisUrl", url).load()
    got = read.select("queue", "offset", "key", "body").collect()
    by_queue = {q: [(off, key, body) for off, key, _, body in msgs] for q, msgs in stored(url, "flights").items()}
    assert sorted((r.queue, r.offset, r.key, bytes(r.body)) for r in got) == sorted(
        (q, off, key, body) for q, msgs in by_queue.items() for off, key, body in msgs)
    assert len(got) == len(rows)
    part = (spark.read.format("mqorder").option("topic", "flights").option("redisUrl", url)
            .option("startingOffsets", '{"0": 3}').option("endingOffsets", '{"0": 5}').load())
    assert sorted(r.offset for r in part.filter("queue = 0").collect()) == [3, 4]


def test_write_format_merges_runs_per_queue_and_a_refused_job_leaves_nothing_on_any_shard(
    spark, cdep: ClusterDeployment, url: str
) -> None:
    """Four partitions each stage a run for most queues (on every shard); the commit merges them by
    orderBy. Then a job with a null key is refused at commit: its runs are dropped on every shard."""
    from pyspark.errors import PySparkException

    create(cdep, url, "merged")
    rows = flights(n_keys=25, per_key=16, seed=9)
    (spark.createDataFrame(rows, SCHEMA).repartition(4).write.format("mqorder").option("redisUrl", url)
     .option("topic", "merged").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "payload")
     .option("stageChunk", "13").mode("append").save())
    check_in_order(url, "merged", rows)
    assert leftovers(cdep) == []

    create(cdep, url, "refused")
    bad = [*flights(n_keys=20, per_key=10, seed=2), (None, 1, "null|1")]
    with pytest.raises(PySparkException, match="null"):
        (spark.createDataFrame(bad, SCHEMA).repartition(4).write.format("mqorder").option("redisUrl", url)
         .option("topic", "refused").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "payload")
         .mode("append").save())
    assert all(msgs == [] for msgs in stored(url, "refused").values())
    assert leftovers(cdep) == []



def test_staging_area_on_a_cluster_drops_and_publishes_the_runs_of_every_shard(
    cdep: ClusterDeployment, url: str
) -> None:
    """The writer's pieces without a JVM: runs staged for queues on all three shards; ``drop``
    deletes each of them (one DEL per key: two queues' keys are never in one slot), ``publish``
    moves every run into its queue's log, merged in sort order."""
    create(cdep, url, "t")
    with Producer(url) as p:
        spans = [QueueRef(i, mq.broker_name, mq.queue_id) for i, mq in enumerate(p.describe_topic("t").message_queues)]
        aborted = StagingArea(p.brokers, "t", spans, "job-a", ttl_ms=60_000)
        for run in range(3):
            aborted.register(run, range(QUEUES))
            for q in range(QUEUES):
                aborted.stage(q, run, [staged_row(v, f"a{q}") for v in range(run, 30, 3)], chunk=4)
        assert len(leftovers(cdep)) == 3 * QUEUES + 1  # the runs and the job's run registry
        assert aborted.drop() == 3 * QUEUES
        assert leftovers(cdep) == []

        job = StagingArea(p.brokers, "t", spans, "job-b", ttl_ms=60_000)
        for run in range(3):
            job.register(run, range(QUEUES))
            for q in range(QUEUES):
                job.stage(q, run, [staged_row(v, f"b{q}") for v in range(run, 30, 3)], chunk=4)
        totals = job.publish(job.registered_runs(), chunk=7)
        job.forget()
        assert (totals.stored, totals.duplicates) == (30 * QUEUES, 0)
        log = MessageLog(p.brokers)
        for q in range(QUEUES):  # every queue, on its own shard, merged across its three runs
            assert [int(m.body) for m in log.read(job.mq(q), 0, 100)] == list(range(30))
        assert job.drop() == 0 and leftovers(cdep) == []

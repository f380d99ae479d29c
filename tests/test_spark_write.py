"""DataFrame → topic on real Spark (``local[2,3]``) and real Redis: ordered, exactly once, all or nothing."""

from __future__ import annotations

import random

import pytest
import redis

from mqorder import Producer, TopicNotFoundError
from mqorder.client.selector import queue_index
from mqorder.errors import ConfigError
from tests.spark_support import staged_keys, stored

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

#: Unicode, empty and look-alike keys: the queue Spark computes must be the producer's for each.
ODD_KEYS = ["", "é", "日本語", "🚀", "a b", "0", "-1", "ß", "A", "a"]
SCHEMA = "tailnum STRING, dep_ts BIGINT, payload STRING"


def flights(n_keys: int = 40, per_key: int = 25, seed: int = 7) -> list[tuple[str, int, str]]:
    """Rows whose per-key order (dep_ts) is not the input order."""
    rnd = random.Random(seed)
    keys_ = ODD_KEYS + [f"N{i:03d}" for i in range(n_keys - len(ODD_KEYS))]
    rows = []
    for k in keys_:
        for ts in rnd.sample(range(per_key * 10), per_key):
            rows.append((k, ts, f"{k}|{ts}"))
    rnd.shuffle(rows)
    return rows


def check_ordered_once(url: str, topic: str, rows: list[tuple[str, int, str]], queues: int) -> None:
    """Every row stored exactly once, in its key's queue, each key's rows in dep_ts order."""
    seen: list[tuple[str, int]] = []
    for q, msgs in stored(url, topic).items():
        last: dict[str, int] = {}
        for _, key, _, body in msgs:
            k, ts = body.decode().rsplit("|", 1)
            assert (key or "") == k, f"header key {key!r} for body {body!r}"  # "" is stored as no key
            assert queue_index(k, queues) == q, f"key {k!r} stored in queue {q}"
            assert last.get(k, -1) < int(ts), f"key {k!r}: dep_ts {ts} after {last.get(k)} in queue {q}"
            last[k] = int(ts)
            seen.append((k, int(ts)))
    assert sorted(seen) == sorted((k, ts) for k, ts, _ in rows)


@pytest.fixture
def producer(redis_url: str):
    p = Producer(redis_url)
    yield p
    p.close()


def test_spark_queue_is_the_producer_queue_for_unicode_and_empty_keys(spark, producer: Producer) -> None:
    from pyspark.sql import functions as F

    import mqorder.spark as ms

    producer.create_topic("q8", queues=8)
    keys_ = [*ODD_KEYS, "日本", "x" * 300]
    got = dict(spark.createDataFrame([(k,) for k in keys_], "k STRING")
               .select("k", ms.queue_of("k", 8).alias("q")).collect())
    sent = {k: producer.send_orderly("q8", b"x", sharding_key=k).message_queue.queue_id for k in keys_}
    assert got == sent == {k: queue_index(k, 8) for k in keys_}
    # An integer key is hashed as its decimal text, by Spark's cast and by the producer alike.
    ints = spark.range(-3, 40).select(F.col("id"), ms.queue_of("id", 8).alias("q")).collect()
    assert {r.id: r.q for r in ints} == {i: producer.send_orderly("q8", b"x", sharding_key=i).message_queue.queue_id
                                        for i in range(-3, 40)}


def test_publish_orders_each_key_and_a_rerun_stores_nothing_twice(spark, redis_url: str, producer: Producer) -> None:
    import mqorder.spark as ms

    producer.create_topic("flights", queues=6)
    rows = flights()
    df = spark.createDataFrame(rows, SCHEMA).repartition(3)
    report = ms.publish(df, "flights", key="tailnum", order_by="dep_ts", body="payload")
    assert (report.rows, report.stored, report.duplicates) == (len(rows), len(rows), 0)
    assert sum(q["stored"] for q in report.queues.values()) == len(rows)
    check_ordered_once(redis_url, "flights", rows, 6)

    # The same DataFrame published again (a re-run after a driver crash): every id is known.
    again = ms.publish(df, "flights", key="tailnum", order_by="dep_ts", body="payload")
    assert (again.stored, again.duplicates) == (0, len(rows))
    check_ordered_once(redis_url, "flights", rows, 6)


def test_write_format_on_any_partitioning_keeps_order_with_a_json_body(spark, redis_url: str,
                                                                        producer: Producer) -> None:
    """``df.write.format("mqorder")`` without ``publish``: several partitions hold rows of one queue,
    and the commit merges their runs by orderBy."""
    import json

    producer.create_topic("merged", queues=3)
    rows = flights(n_keys=20, per_key=30, seed=11)
    (spark.createDataFrame(rows, SCHEMA).repartition(4).write.format("mqorder")
     .option("topic", "merged").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "json")
     .option("stageChunk", "37").mode("append").save())
    seen = []
    for q, msgs in stored(redis_url, "merged").items():
        last: dict[str, int] = {}
        for _, key, _, body in msgs:
            row = json.loads(body)
            key = key or ""  # an empty key is stored as no key, as the producer stores it
            assert row["tailnum"] == key and queue_index(key, 3) == q
            assert last.get(key, -1) < row["dep_ts"]
            last[key] = row["dep_ts"]
            seen.append((key, row["dep_ts"], row["payload"]))
    assert sorted(seen) == sorted(rows)


def test_identical_rows_in_different_partitions_are_each_published_once(spark, redis_url: str,
                                                                         producer: Producer) -> None:
    """A plain df.write of identical rows (same key, orderBy and body) spread over partitions
    published one message for all of them (each task numbered only its own twins); the commit now
    numbers them over the queue, and the same DataFrame written again, cut otherwise, adds nothing."""
    producer.create_topic("twins", queues=2)
    rows = [("k1", 1, "same")] * 5 + [("k1", 2, "next"), ("k2", 1, "same")] * 3
    df = spark.createDataFrame(rows, SCHEMA)

    def write(parts: int) -> None:
        (df.repartition(parts).write.format("mqorder").option("topic", "twins").option("key", "tailnum")
         .option("orderBy", "dep_ts").option("body", "payload").mode("append").save())

    write(4)
    got = sorted((key, body) for msgs in stored(redis_url, "twins").values() for _, key, _, body in msgs)
    assert got == sorted((k, b.encode()) for k, _, b in rows)
    write(3)
    again = sorted((key, body) for msgs in stored(redis_url, "twins").values() for _, key, _, body in msgs)
    assert again == got


def test_a_retried_task_adds_nothing_twice(spark, redis_url: str, producer: Producer) -> None:
    """Attempt 0 of every task dies after staging half its rows; Spark retries it (local[2,3])."""
    from mqorder.spark.publish import job_report

    producer.create_topic("retried", queues=4)
    rows = flights(n_keys=30, per_key=20, seed=3)
    (spark.createDataFrame(rows, SCHEMA).repartition(3).write.format("mqorder_first_attempt_dies")
     .option("topic", "retried").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "payload")
     .option("stageChunk", "25").option("jobId", "retried1").mode("append").save())
    report = job_report("retried1")
    assert report["status"] == "published"
    assert report["retried_tasks"] == report["tasks"] == 3  # every task failed once, and was retried
    assert (report["stored"], report["duplicates"]) == (len(rows), 0)
    check_ordered_once(redis_url, "retried", rows, 4)


def test_two_attempts_of_one_partition_at_once_store_each_row_once(spark, redis_url: str,
                                                                    producer: Producer) -> None:
    from mqorder.spark.publish import job_report

    producer.create_topic("twins", queues=4)
    rows = flights(n_keys=16, per_key=40, seed=5)
    # Partitions 0 and 1 hold the same rows in the same order, and stage into run 0 at the same time.
    twins = spark.createDataFrame(spark.sparkContext.parallelize([rows, rows], 2).flatMap(lambda part: part), SCHEMA)
    assert twins.rdd.getNumPartitions() == 2
    (twins.write.format("mqorder_two_attempts_at_once")
     .option("topic", "twins").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "payload")
     .option("stageChunk", "10").option("jobId", "twins1").mode("append").save())
    report = job_report("twins1")
    assert (report["tasks"], report["rows"], report["stored"]) == (2, len(rows), len(rows))
    check_ordered_once(redis_url, "twins", rows, 4)


def test_a_failed_job_leaves_nothing_visible(spark, redis_url: str, r: redis.Redis, producer: Producer) -> None:
    """The last partition fails on every attempt after the other tasks staged their rows."""
    from pyspark.errors import PySparkException

    from mqorder.spark.publish import job_report

    producer.create_topic("doomed", queues=4)
    rows = flights(n_keys=20, per_key=20, seed=9)
    with pytest.raises(PySparkException, match="fails after the other tasks succeeded"):
        (spark.createDataFrame(rows, SCHEMA).repartition(3).write.format("mqorder_last_partition_fails")
         .option("topic", "doomed").option("key", "tailnum").option("orderBy", "dep_ts").option("body", "payload")
         .option("stageChunk", "20").option("jobId", "doomed1").mode("append").save())
    assert int(r.get("test:succeeded:doomed1") or 0) >= 2  # the other tasks did stage their rows
    assert all(msgs == [] for msgs in stored(redis_url, "doomed").values())
    assert staged_keys(r) == []
    assert job_report("doomed1")["status"] == "aborted"


def test_bad_rows_are_refused_with_their_counts_and_nothing_is_published(spark, redis_url: str, r: redis.Redis,
                                                                         producer: Producer) -> None:
    import mqorder.spark as ms

    producer.create_topic("strict", queues=4)
    good = [(f"k{i % 7}", i, f"p{i}") for i in range(200)]
    bad = good + [(None, 1000, "x"), (None, 1001, "y"), ("k1", None, "z"), ("k2", 1002, "B" * 5000)]
    df = spark.createDataFrame(bad, SCHEMA).repartition(3)
    with pytest.raises(ms.JobRefusedError) as err:
        ms.publish(df, "strict", key="tailnum", order_by="dep_ts", body="payload",
                   options={"maxMessageSize": "4096"})
    text = str(err.value)
    assert "nothing of this job was published" in text
    assert "2 rows have a null key ('tailnum')" in text
    assert "1 rows have a null orderBy value ('dep_ts')" in text
    assert "1 rows are over max_message_size 4,096 bytes (the largest is 5,000)" in text
    assert all(msgs == [] for msgs in stored(redis_url, "strict").values())
    assert staged_keys(r) == []

    # onNull=skip leaves the null rows out and counts them; the over-size body still refuses.
    no_big = spark.createDataFrame(bad[:-1], SCHEMA).repartition(3)
    report = ms.publish(no_big, "strict", key="tailnum", order_by="dep_ts", body="payload", on_null="Skip")  # any case, as option onNull
    assert (report.stored, report.skipped_nulls) == (200, 3)


def test_a_refusal_names_a_long_key_a_binary_key_and_the_callers_key_column(spark, redis_url: str, r: redis.Redis,
                                                                              producer: Producer) -> None:
    """A key too long for a message header is not a body over max_message_size (the body here is 5
    bytes); a null key of a column publish casts to a string is named by the caller's column, not
    the job's internal copy of it; a key that is not UTF-8 text is refused with its count."""
    import datetime

    import mqorder.spark as ms

    producer.create_topic("longkey", queues=2)
    df = spark.createDataFrame([("K" * 70_000, 1, "small")], SCHEMA)
    with pytest.raises(ms.JobRefusedError) as err:
        ms.publish(df, "longkey", key="tailnum", order_by="dep_ts", body="payload")
    text = str(err.value)
    assert "over max_message_size" not in text, text
    assert "1 rows have a message header (their key and message id) of over 65,536 bytes" in text, text
    assert "shorten the key ('tailnum')" in text, text

    producer.create_topic("bydate", queues=2)
    df = spark.createDataFrame([(datetime.date(2024, 1, 1), 1, "a"), (None, 2, "b")],
                               "day DATE, dep_ts BIGINT, payload STRING")
    with pytest.raises(ms.JobRefusedError) as err:
        ms.publish(df, "bydate", key="day", order_by="dep_ts", body="payload")
    assert "1 rows have a null key ('day')" in str(err.value), str(err.value)

    # A binary key that is not UTF-8 text: a refusal with its count (it failed a task with a
    # UnicodeDecodeError deep in a JVM stack trace).
    producer.create_topic("bykey", queues=2)
    df = spark.createDataFrame([(bytearray(b"\xff\xfe"), 1, "a"), (bytearray(b"ok"), 2, "b")],
                               "k BINARY, dep_ts BIGINT, payload STRING")
    with pytest.raises(ms.JobRefusedError) as err:
        ms.publish(df, "bykey", key="k", order_by="dep_ts", body="payload")
    assert "1 rows have a key that is not UTF-8 text ('k')" in str(err.value), str(err.value)
    assert all(msgs == [] for msgs in stored(redis_url, "bykey").values())
    assert staged_keys(r) == []


def test_bad_options_fail_before_any_task_runs(spark, redis_url: str, producer: Producer) -> None:
    from pyspark.errors import PySparkException

    import mqorder.spark as ms

    producer.create_topic("opts", queues=2)
    df = spark.createDataFrame([("k", 1, "p")], SCHEMA)
    with pytest.raises(TopicNotFoundError, match="create it first"):
        ms.publish(df, "no_such_topic", key="tailnum", order_by="dep_ts")
    with pytest.raises(ConfigError, match="orderBy column 'departure' is not in the DataFrame"):
        ms.publish(df, "opts", key="tailnum", order_by="departure")
    with pytest.raises(ConfigError, match="on_null='maybe': choose fail or skip"):
        ms.publish(df, "opts", key="tailnum", order_by="dep_ts", on_null="maybe")
    for bad in (0, -1, 2.0, "4", True):  # 0 meant the default, -1 was a JVM error from repartition
        with pytest.raises(ConfigError, match=rf"partitions={bad!r}: give a whole number >= 1"):
            ms.publish(df, "opts", key="tailnum", order_by="dep_ts", partitions=bad)
    with pytest.raises(ConfigError, match=r"^redis_url='localhost:6379' has scheme"):  # not MQORDER_REDIS_URL
        ms.publish(df, "opts", key="tailnum", order_by="dep_ts", redis_url="localhost:6379")

    def w():
        return df.write.format("mqorder").option("topic", "opts").option("key", "tailnum")

    with pytest.raises(PySparkException, match="orderBy"):
        w().mode("append").save()
    with pytest.raises(PySparkException, match="unknown write option.*'order_by'"):
        w().option("orderBy", "dep_ts").option("order_by", "dep_ts").mode("append").save()
    with pytest.raises(PySparkException, match="append-only log"):
        w().option("orderBy", "dep_ts").mode("overwrite").save()
    with pytest.raises(PySparkException, match="cast it to a string"):
        (spark.createDataFrame([(1.5, 1, "p")], "tailnum DOUBLE, dep_ts BIGINT, payload STRING").write
         .format("mqorder").option("topic", "opts").option("key", "tailnum").option("orderBy", "dep_ts")
         .mode("append").save())
    with pytest.raises(PySparkException, match=r"column 'wait' has type interval day: a whole-row JSON body"):
        spark.sql("SELECT 'k' AS tailnum, 1L AS dep_ts, INTERVAL '1' DAY AS wait").write.format("mqorder") \
            .option("topic", "opts").option("key", "tailnum").option("orderBy", "dep_ts").mode("append").save()
    assert all(msgs == [] for msgs in stored(redis_url, "opts").values())


def test_an_unreachable_redis_is_one_mqorder_error_in_every_way_in(spark) -> None:
    """redis-py's ConnectionError came out of df.write / read as ~40 lines of traceback inside an
    AnalysisException that mqorder_error could not read, and out of publish() bare (a data
    engineer's walk-through). Each now carries BrokerUnavailableError saying what to do."""
    from pyspark.errors import PySparkException

    import mqorder.spark as ms
    from mqorder.errors import BrokerUnavailableError
    from mqorder.spark.errors import mqorder_error
    from mqorder.testing.embedded import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    df = spark.createDataFrame([("k", 1, "p")], SCHEMA)
    with pytest.raises(BrokerUnavailableError, match="publish: Redis did not answer .* start redis-server"):
        ms.publish(df, "opts", key="tailnum", order_by="dep_ts", redis_url=dead)
    for action in (
        lambda: df.write.format("mqorder").option("topic", "opts").option("key", "tailnum")
        .option("orderBy", "dep_ts").option("redisUrl", dead).mode("append").save(),
        lambda: spark.read.format("mqorder").option("topic", "opts").option("redisUrl", dead).load().count(),
    ):
        with pytest.raises(PySparkException) as exc:
            action()
        err = mqorder_error(exc.value)
        assert isinstance(err, BrokerUnavailableError), str(exc.value)[-800:]
        assert "Redis did not answer" in str(err) and "option redisUrl" in str(err)


def test_a_job_whose_staged_rows_are_gone_at_commit_publishes_nothing(spark, redis_url: str, r: redis.Redis,
                                                                    producer: Producer) -> None:
    """A task stages its run and ends; another one staging longer than ``stagingTtl`` makes the
    first run expire before the commit (here the slow task deletes it once it is staged). Once the
    commit published what was left and reported the job incomplete; run again, as it said, the job
    put the expired rows after later rows of their key. Now the job is refused, nothing published,
    and the re-run stores every row in order."""
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    from mqorder import keys
    from mqorder.model import MessageQueue

    producer.create_topic("gone", queues=1)
    fast_run = keys.stage_run(MessageQueue("gone", "broker-a", 0).tag, "gonejob", 0)
    expire = F.udf(lambda p, url=redis_url, key=fast_run: _expire_when_staged(url, key) if p == "slow" else p,
                   "string")
    rows = [("k", 1, "a"), ("k", 2, "b"), ("k", 3, "slow"), ("k", 4, "d")]
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 2), SCHEMA)

    def write(frame, job: str) -> None:
        (frame.write.format("mqorder").option("topic", "gone").option("key", "tailnum").option("orderBy", "dep_ts")
         .option("body", "payload").option("jobId", job).mode("append").save())

    with pytest.raises(PySparkException, match=r"nothing of job gonejob was published(.|\n)*2 staged rows \(queues \[0\]\) were gone"):
        write(df.withColumn("payload", expire("payload")), "gonejob")
    assert stored(redis_url, "gone") == {0: []}
    assert staged_keys(r) == []
    write(df, "gonejob2")
    assert [body for _, _, _, body in stored(redis_url, "gone")[0]] == [b"a", b"b", b"slow", b"d"]


def _expire_when_staged(url: str, key: str) -> str:
    """In the slow task: wait until the other task staged its two rows (4 items each), then delete
    its run, as ``stagingTtl`` would, and return the row's payload."""
    import time

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while client.llen(key) < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    client.delete(key)
    return "slow"

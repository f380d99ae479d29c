"""Durable sends (``wait_replicas``, ``MQORDER_SEND_WAIT_REPLICAS``) on a real primary with two
real replicas: a send acknowledged with ``wait_replicas=n`` is on ``n`` replicas when it returns,
a send whose replicas do not answer raises ``ReplicasBehindError`` (stored on the primary), and
asking for more replicas than are connected is refused before anything is stored.

The deployment is one primary and two ``--replicaof`` replicas, started once per module and
reached by plain ``redis://`` URLs to the primary. A replica "that does not answer" is SIGSTOPped
(``SentinelDeployment.pause``): it keeps its connection, so the primary still counts it as
connected, but it acknowledges nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from mqorder import Producer, keys
from mqorder.errors import (
    BrokerUnavailableError,
    ConfigError,
    NotEnoughReplicasError,
    ReplicasBehindError,
)
from mqorder.model import MessageQueue
from mqorder.settings import get_settings, load_settings
from mqorder.testing.embedded import RedisServer, wait_online_replicas
from mqorder.testing.sentinel import SentinelDeployment

#: The WAIT timeout of these tests (ms): long enough for a loaded machine's replica to answer,
#: short enough that each shortfall costs the suite well under a second.
WAIT_MS = 400


@dataclass
class Replicated:
    primary: RedisServer
    replicas: list[RedisServer]

    def client(self, srv: RedisServer) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=srv.port, socket_timeout=5)


@pytest.fixture(scope="module")
def replicated() -> Iterator[Replicated]:
    primary = RedisServer().start()
    replicas: list[RedisServer] = []
    try:
        for _ in range(2):
            replicas.append(RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start())
        wait_online_replicas(primary, 2)
        yield Replicated(primary, replicas)
    finally:
        for srv in [*replicas, primary]:
            if srv.proc is not None and srv.proc.poll() is None:
                SentinelDeployment.resume(srv)
            srv.stop()


@pytest.fixture
def dep(replicated: Replicated, monkeypatch: pytest.MonkeyPatch) -> Iterator[Replicated]:
    """The deployment, emptied (FLUSHALL reaches the replicas too), every replica answering, and
    ``MQORDER_REDIS_URL`` pointing at the primary."""
    c = replicated.client(replicated.primary)
    c.flushall()
    assert c.execute_command("WAIT", 2, 10_000) == 2
    c.close()
    monkeypatch.setenv("MQORDER_REDIS_URL", replicated.primary.url)
    monkeypatch.setenv("MQORDER_SEND_WAIT_TIMEOUT_MS", str(WAIT_MS))
    get_settings.cache_clear()
    yield replicated
    for srv in replicated.replicas:
        SentinelDeployment.resume(srv)  # a test that failed while they were paused
    get_settings.cache_clear()


@pytest.fixture
def producer(dep: Replicated) -> Iterator[Producer]:
    p = Producer()
    p.create_topic("t", queues=4)
    yield p
    p.close()


def _bodies(c: redis.Redis, mq: MessageQueue) -> list[bytes]:
    """The bodies in ``mq``'s log as this node has them, in offset order."""
    return [fields[b"b"] for _, fields in c.xrange(keys.queue_log(mq.tag))]


def _all_bodies(c: redis.Redis, queues: list[MessageQueue]) -> list[bytes]:
    return sorted(b for mq in queues for b in _bodies(c, mq))


@pytest.fixture
def paused(dep: Replicated) -> Iterator[list[RedisServer]]:
    """Both replicas SIGSTOPped for the test (resumed after it)."""
    for srv in dep.replicas:
        SentinelDeployment.pause(srv)
    yield dep.replicas
    for srv in dep.replicas:
        SentinelDeployment.resume(srv)


def test_a_send_waiting_for_replicas_is_on_them_when_it_returns(dep: Replicated, producer: Producer) -> None:
    one = producer.send_orderly("t", b"on-one", sharding_key="k", wait_replicas=1)
    # Read on the replicas themselves, right away: with wait_replicas=1 at least one has it.
    holders = [srv.port for srv in dep.replicas if b"on-one" in _bodies(dep.client(srv), one.message_queue)]
    assert holders, "wait_replicas=1 returned, yet no replica had the message"
    both = producer.send_orderly("t", b"on-both", sharding_key="k", wait_replicas=2)
    for srv in dep.replicas:
        assert _bodies(dep.client(srv), both.message_queue)[both.queue_offset] == b"on-both"


def test_the_setting_makes_every_send_wait_and_an_argument_wins(dep: Replicated, monkeypatch) -> None:
    monkeypatch.setenv("MQORDER_SEND_WAIT_REPLICAS", "2")
    get_settings.cache_clear()
    p = Producer()
    try:
        p.create_topic("t", queues=1)
        # A first send loads the scripts (on a server that has none yet, the append pipeline's
        # NOSCRIPT reply sends it, and its WAIT, once more): the counts below are the sends'.
        p.send_orderly("t", b"warm", sharding_key="k", wait_replicas=0)
        c = dep.client(dep.primary)
        c.config_resetstat()
        p.send_orderly("t", b"a", sharding_key="k")
        p.send_orderly("t", b"b", sharding_key="k", wait_replicas=0)  # the argument wins: no WAIT
        assert int(c.info("commandstats")["cmdstat_wait"]["calls"]) == 1
        with pytest.raises(NotEnoughReplicasError):
            p.send_orderly("t", b"c", sharding_key="k", wait_replicas=3)
    finally:
        p.close()


def test_replicas_that_do_not_answer_fail_the_send_within_the_timeout_but_it_is_stored(
    dep: Replicated, producer: Producer, paused: list[RedisServer]
) -> None:
    t0 = time.monotonic()
    with pytest.raises(ReplicasBehindError) as err:
        producer.send_orderly("t", b"maybe-lost", sharding_key="k", wait_replicas=1)
    took = time.monotonic() - t0
    assert WAIT_MS / 1000 * 0.9 <= took < WAIT_MS / 1000 + 2.0, took
    assert isinstance(err.value, BrokerUnavailableError)  # the "stored or not, unknown" class callers catch
    text = str(err.value)
    assert "IS stored on the primary" in text and f"only 0 of 1 replica acknowledged within {WAIT_MS} ms" in text
    assert "connected_slaves:2" in text and "a failover now could lose it" in text
    assert "resend with the same dedup key is safe" in text
    queues = producer.describe_topic("t").message_queues
    assert _all_bodies(dep.client(dep.primary), queues) == [b"maybe-lost"]


def test_asking_for_more_replicas_than_connected_is_refused_before_storing(dep: Replicated, producer: Producer) -> None:
    t0 = time.monotonic()
    with pytest.raises(NotEnoughReplicasError) as err:
        producer.send_orderly("t", b"never", sharding_key="k", wait_replicas=3)
    assert time.monotonic() - t0 < WAIT_MS / 1000  # refused, not waited out
    assert isinstance(err.value, BrokerUnavailableError)
    text = str(err.value)
    assert "wait for 3 replicas" in text and "connected_slaves:2" in text and "before anything was stored" in text
    queues = producer.describe_topic("t").message_queues
    assert _all_bodies(dep.client(dep.primary), queues) == []
    with pytest.raises(NotEnoughReplicasError, match="connected_slaves:2"):
        producer.send_orderly_batch("t", [("k", b"x")], wait_replicas=3)
    with pytest.raises(NotEnoughReplicasError, match="connected_slaves:2"):
        producer.send("t", b"x", wait_replicas=3)


@pytest.mark.parametrize("bad", [-1, 1.5, "two", True, "1.0", 17, 10**9])
def test_bad_wait_replicas_values_are_refused_before_sending(dep: Replicated, producer: Producer, bad: object) -> None:
    with pytest.raises(ConfigError, match=r"wait_replicas=.* must be a whole number of replicas.*nothing was sent"):
        producer.send_orderly("t", b"x", sharding_key="k", wait_replicas=bad)
    queues = producer.describe_topic("t").message_queues
    assert _all_bodies(dep.client(dep.primary), queues) == []


def test_bad_wait_settings_are_refused_naming_the_variable(dep: Replicated, monkeypatch) -> None:
    for value in ("-1", "one", "1.5", "1000000000"):  # a billion replicas: every send failed, the start did not
        monkeypatch.setenv("MQORDER_SEND_WAIT_REPLICAS", value)
        with pytest.raises(ConfigError, match="MQORDER_SEND_WAIT_REPLICAS: must be a whole number of replicas"):
            load_settings()
    monkeypatch.setenv("MQORDER_SEND_WAIT_REPLICAS", "1")
    monkeypatch.setenv("MQORDER_SEND_WAIT_TIMEOUT_MS", "0")
    with pytest.raises(ConfigError, match="MQORDER_SEND_WAIT_TIMEOUT_MS"):
        load_settings()
    monkeypatch.setenv("MQORDER_SEND_WAIT_TIMEOUT_MS", "3000")
    with pytest.raises(ConfigError, match=r"send_wait_timeout_ms \(3000 ms\) must be shorter than send_msg_timeout_ms"):
        load_settings()
    with pytest.raises(ConfigError, match=r"MQORDER_SEND_WAIT_REPLICAS: must be .*\(got True\)"):
        load_settings(send_wait_replicas=True)
    monkeypatch.setenv("MQORDER_SEND_WAIT_REPLICAS", "0")  # not waiting: the timeout is not checked
    assert load_settings().send_wait_replicas == 0
    p = Producer(send_msg_timeout_ms=2000)  # MQORDER_SEND_WAIT_TIMEOUT_MS=3000 from above
    try:
        p.create_topic("t", queues=1)
        with pytest.raises(ConfigError, match="must be shorter than MQORDER_SEND_MSG_TIMEOUT_MS"):
            p.send_orderly("t", b"x", sharding_key="k", wait_replicas=1)
    finally:
        p.close()


def test_a_batch_waits_once_per_broker_and_names_the_shortfall(dep: Replicated, producer: Producer) -> None:
    c = dep.client(dep.primary)
    queues = producer.describe_topic("t").message_queues
    items = [(f"key-{i % 7}", b"m%03d" % i) for i in range(100)]
    # Loaded first: run alone, this test's batch would meet NOSCRIPT and be sent again, WAIT too.
    producer.brokers.default.scripts.load("send")
    c.config_resetstat()
    results = producer.send_orderly_batch("t", items, wait_replicas=2)
    # Four queues on one broker: four append scripts and ONE wait, in one round trip.
    stats = c.info("commandstats")
    assert int(stats["cmdstat_wait"]["calls"]) == 1 and int(stats["cmdstat_evalsha"]["calls"]) == 4
    assert len({r.message_queue for r in results}) == 4
    want = sorted(b for _, b in items)
    for srv in dep.replicas:
        assert _all_bodies(dep.client(srv), queues) == want
    SentinelDeployment.pause(dep.replicas[1])
    try:
        with pytest.raises(ReplicasBehindError) as err:
            producer.send_orderly_batch("t", [("k", b"late-1"), ("j", b"late-2")], wait_replicas=2)
    finally:
        SentinelDeployment.resume(dep.replicas[1])
    assert "the 2 messages ARE stored on the primary" in str(err.value)
    assert "only 1 of 2 replicas acknowledged" in str(err.value)
    assert _all_bodies(c, queues) == sorted([*want, b"late-1", b"late-2"])


def test_a_keyed_resend_stores_nothing_again_and_waits_again(dep: Replicated, producer: Producer,
                                                              paused: list[RedisServer]) -> None:
    """The first send's WAIT falls short (its retries too: each a dedup hit that waits again). A
    resend from ANOTHER producer, while the replicas are still silent, must not be acknowledged:
    its script writes nothing, and only the fence write makes its WAIT cover the first copy."""
    queues = producer.describe_topic("t").message_queues
    with pytest.raises(ReplicasBehindError):
        producer.send_orderly("t", b"evt", sharding_key="k", dedup_key="evt-1", wait_replicas=1)
    other = Producer()
    try:
        with pytest.raises(ReplicasBehindError, match="IS stored on the primary"):
            other.send_orderly("t", b"evt", sharding_key="k", dedup_key="evt-1", wait_replicas=1)
        for srv in paused:
            SentinelDeployment.resume(srv)
        again = other.send_orderly("t", b"evt", sharding_key="k", dedup_key="evt-1", wait_replicas=2)
    finally:
        other.close()
    assert again.queue_offset == 0
    for srv in [dep.primary, *dep.replicas]:
        assert _all_bodies(dep.client(srv), queues) == [b"evt"]  # one copy, everywhere


def test_a_keyed_send_succeeds_when_the_replicas_catch_up_during_its_retries(
    dep: Replicated, producer: Producer, paused: list[RedisServer]
) -> None:
    def wake() -> None:
        time.sleep(WAIT_MS / 1000 * 1.5)  # after the first attempt's WAIT fell short
        for srv in paused:
            SentinelDeployment.resume(srv)

    t = threading.Thread(target=wake)
    t.start()
    t0 = time.monotonic()
    res = producer.send_orderly("t", b"evt", sharding_key="k", dedup_key="evt-2", wait_replicas=2)
    t.join()
    assert time.monotonic() - t0 >= WAIT_MS / 1000  # it did wait, and fall short, first
    queues = producer.describe_topic("t").message_queues
    for srv in [dep.primary, *dep.replicas]:
        assert _all_bodies(dep.client(srv), queues) == [b"evt"]
    assert res.queue_offset == 0


def test_a_keyed_batch_resend_waits_again_and_stores_nothing_twice(dep: Replicated, producer: Producer) -> None:
    queues = producer.describe_topic("t").message_queues
    items = [(f"key-{i}", b"b%d" % i) for i in range(20)]
    ids = [f"id-{i}" for i in range(20)]
    SentinelDeployment.pause(dep.replicas[0])
    try:
        with pytest.raises(ReplicasBehindError, match="only 1 of 2"):
            producer.send_orderly_batch("t", items, dedup_keys=ids, wait_replicas=2)
    finally:
        SentinelDeployment.resume(dep.replicas[0])
    res = producer.send_orderly_batch("t", items, dedup_keys=ids, wait_replicas=2)
    assert [r.queue_offset for r in res] == [r.queue_offset for r in producer.send_orderly_batch("t", items, dedup_keys=ids)]
    for srv in [dep.primary, *dep.replicas]:
        assert _all_bodies(dep.client(srv), queues) == sorted(b for _, b in items)


def test_plain_send_is_not_retried_elsewhere_after_a_shortfall(dep: Replicated, producer: Producer,
                                                              paused: list[RedisServer]) -> None:
    queues = producer.describe_topic("t").message_queues
    with pytest.raises(ReplicasBehindError):
        producer.send("t", b"once", wait_replicas=1)
    assert _all_bodies(dep.client(dep.primary), queues) == [b"once"]  # not resent (retry_times=2)


def test_a_delayed_send_waits_for_its_schedule_entry(dep: Replicated, producer: Producer) -> None:
    res = producer.send("t", b"later", delay_time_level=3, wait_replicas=2)
    for srv in dep.replicas:
        assert dep.client(srv).zcard(keys.delay_schedule(res.message_queue.tag)) == 1
    SentinelDeployment.pause(dep.replicas[0])
    try:
        with pytest.raises(ReplicasBehindError, match="delayed send: the message IS stored"):
            producer.send("t", b"later-2", delay_time_level=3, wait_replicas=2)
    finally:
        SentinelDeployment.resume(dep.replicas[0])


# -- the Spark writer's commit (option waitReplicas) -----------------------------------------------


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_the_spark_commit_waits_for_replicas_and_says_when_they_fall_short(spark, dep: Replicated,
                                                                           producer: Producer) -> None:
    import mqorder.spark as ms
    from mqorder.spark.writer import JobRefusedError

    queues = producer.describe_topic("t").message_queues
    primary = dep.client(dep.primary)
    rows = [(f"k{i % 10}", i, f"p{i:03d}") for i in range(200)]
    df = spark.createDataFrame(rows, "k STRING, ts BIGINT, payload STRING")
    report = ms.publish(df, "t", key="k", order_by="ts", body="payload", id_column="payload",
                        redis_url=dep.primary.url, wait_replicas=2)
    assert report.stored == 200
    want = sorted(p.encode() for _, _, p in rows)
    for srv in dep.replicas:  # read on the replicas as soon as the job returned
        assert _all_bodies(dep.client(srv), queues) == want

    more = [(f"k{i % 10}", 1000 + i, f"q{i:03d}") for i in range(50)]
    df2 = spark.createDataFrame(more, "k STRING, ts BIGINT, payload STRING")
    SentinelDeployment.pause(dep.replicas[1])
    try:
        with pytest.raises(ReplicasBehindError) as err:
            ms.publish(df2, "t", key="k", order_by="ts", body="payload", id_column="payload",
                       redis_url=dep.primary.url, wait_replicas=2)
    finally:
        SentinelDeployment.resume(dep.replicas[1])
    assert "the 50 messages ARE stored on the primary" in str(err.value)
    assert "only 1 of 2 replicas acknowledged" in str(err.value) and "Running the job again is safe" in str(err.value)
    want2 = sorted(want + [p.encode() for _, _, p in more])
    assert _all_bodies(primary, queues) == want2
    # Run again: every row is a duplicate (ids), and this time the replicas answer.
    again = ms.publish(df2, "t", key="k", order_by="ts", body="payload", id_column="payload",
                       redis_url=dep.primary.url, wait_replicas=2)
    assert (again.stored, again.duplicates) == (0, 50)
    for srv in [dep.primary, *dep.replicas]:
        assert _all_bodies(dep.client(srv), queues) == want2

    # More replicas than connected: refused before anything is published.
    with pytest.raises(JobRefusedError, match="connected_slaves:2"):
        ms.publish(spark.createDataFrame([("k", 1, "never")], "k STRING, ts BIGINT, payload STRING"), "t",
                   key="k", order_by="ts", body="payload", redis_url=dep.primary.url, wait_replicas=3)
    assert b"never" not in _all_bodies(primary, queues)
    # The data source option itself: refused when it is not a number of replicas.
    with pytest.raises(Exception, match=r"waitReplicas='-1' must be a whole number of replicas"):
        (df.write.format("mqorder").mode("append").option("topic", "t").option("key", "k")
         .option("orderBy", "ts").option("redisUrl", dep.primary.url).option("waitReplicas", "-1").save())


def test_async_sends_of_several_chunks_per_queue_wait_for_replicas_and_keep_order(dep: Replicated) -> None:
    """``send_orderly_async`` with ``send_wait_replicas``: sends with and without a dedup key go in
    separate chunks, so a batch holds several chunks of each queue, sent one per queue per round
    trip (``queue_rounds``) and then each shard's ``WAIT``; every future resolves once both
    replicas have the batch, and each replica holds each key's messages in call order."""
    p = Producer(linger_ms=200, send_wait_replicas=2)
    p.create_topic("t", queues=4)
    futures = []
    for n in range(10):
        for key in ("ka", "kb"):
            futures.append(p.send_orderly_async("t", f"{key}:{n}".encode(), sharding_key=key,
                                                dedup_key=f"{key}-{n}" if n % 2 else None))
    p.flush()
    results = [f.result(timeout=10) for f in futures]
    assert len({(r.message_queue, r.queue_offset) for r in results}) == 20
    for srv in [dep.primary, *dep.replicas]:
        for key in ("ka", "kb"):
            mq = results[0 if key == "ka" else 1].message_queue
            mine = [b.decode() for b in _bodies(dep.client(srv), mq) if b.startswith(key.encode())]
            assert mine == [f"{key}:{n}" for n in range(10)], (srv.port, key, mine)
    p.close()

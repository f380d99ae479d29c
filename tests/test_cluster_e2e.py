"""End to end on Redis Cluster: real ``celery worker`` subprocesses (prefork) whose store is a
3-master cluster, each master with a replica (``redis+cluster://``, ``mqorder.testing.cluster``), with a topic's queues spread
over the shards by their hash tags. Celery's broker cannot be a cluster (kombu has no cluster
transport), so it is a plain Redis of the test's own, which also holds the listeners' ledger
(``MQORDER_TEST_LEDGER_URL``, ``tests/listeners.py``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from mqorder import Producer, keys
from mqorder.errors import BrokerUnavailableError
from mqorder.settings import Settings
from mqorder.store.connect import close, connect
from mqorder.store.log import MessageLog
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer
from tests.sentinel_support import (
    GROUP,
    TOPIC,
    eventually,
    ledger_entries,
    longest_pause,
    order_violations,
    stamped_body,
)
from tests.support import Cluster, body, check_order, ledger, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cdep() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3, replicas_per_master=1) as d:
        yield d


@pytest.fixture(scope="module")
def side() -> Iterator[RedisServer]:
    """Celery's broker and the listeners' ledger: a plain Redis."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def led(side: RedisServer) -> Iterator[redis.Redis]:
    side.flushall()
    c = redis.Redis.from_url(side.url)
    yield c
    c.close()


@pytest.fixture
def ccluster(cdep: ClusterDeployment, side: RedisServer, led: redis.Redis, tmp_path: Path) -> Iterator[Cluster]:
    """Workers whose store is the cluster and whose Celery broker is ``side``."""
    for node in cdep.nodes[: cdep.masters]:
        cdep.client(node).flushall()
    client = connect(cdep.url())
    c = Cluster(cdep.url(), tmp_path, client)
    c.celery_broker_url = side.url
    yield c
    c.stop()
    close(client)


def _start(c: Cluster, side: RedisServer, *names: str, **extra: str) -> None:
    for name in names:
        c.start_worker(name, MQORDER_TEST_LEDGER_URL=side.url, **extra)


def _handled(led: redis.Redis, group: str, n: int) -> bool:
    return len({(e["key"], e["seq"]) for e in ledger(led, group) if e["ok"]}) >= n


def _shards_of(cdep: ClusterDeployment, p: Producer, topic: str) -> set[int]:
    """Ports of the masters serving the topic's queues."""
    return {cdep.master_of_slot(key_slot(mq.tag.encode())).port for mq in p.describe_topic(topic).message_queues}


def test_two_workers_every_key_in_order_over_three_shards(cdep: ClusterDeployment, side: RedisServer,
                                                           ccluster: Cluster, led: redis.Redis) -> None:
    p = Producer(ccluster.url)
    p.create_topic("t-order", queues=8)
    assert len(_shards_of(cdep, p, "t-order")) == 3  # the queues really are spread over the shards
    _start(ccluster, side, "w1", "w2")
    keys_ = [f"order-{i}" for i in range(1000)]
    for seq in range(1, 5):
        p.send_orderly_batch("t-order", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: _handled(led, "g-order", 4000), timeout=120, what="4000 messages handled")
    entries = ledger(led, "g-order")
    violations, handled, _ = check_order(entries)
    assert violations == [] and handled == 4000
    assert {e["client"] for e in entries} == {w.hostname for w in ccluster.workers.values()}
    log = MessageLog(p.brokers)
    wait_for(lambda: sum(log.lag("g-order", mq) for mq in p.describe_topic("t-order").message_queues) == 0,
             timeout=30, what="every offset committed")
    # Celery's tasks went through the plain Redis, never the cluster.
    assert led.keys("_kombu.binding.*")
    p.close()


def test_trickle_is_woken_over_sharded_pubsub(cdep: ClusterDeployment, side: RedisServer, ccluster: Cluster,
                                              led: redis.Redis) -> None:
    """Sends one at a time to idle queues: each is handled through a sharded wake-up (SPUBLISH on
    the queue's shard), not by the sweep, so within well under a sweep interval."""
    p = Producer(ccluster.url)
    p.create_topic("t-order", queues=6)
    _start(ccluster, side, "w1", MQORDER_SWEEP_INTERVAL_MS="60000", MQORDER_CONSUME_LINGER_MS="0")
    # Wait for the worker's shard subscriptions: one channel per queue it owns.
    client = ccluster.client
    wait_for(lambda: all(
        int(cdep.client(cdep.master_of_slot(key_slot(mq.tag.encode()))).execute_command(
            "PUBSUB", "SHARDNUMSUB", keys.shard_wake_channel(mq.tag, ccluster.workers["w1"].hostname))[1]) == 1
        for mq in p.describe_topic("t-order").message_queues), timeout=30, what="sharded wake subscriptions")
    for i in range(30):
        p.send_orderly("t-order", body(f"k{i}", 1), sharding_key=f"k{i}")
        time.sleep(0.05)
    wait_for(lambda: _handled(led, "g-order", 30), timeout=20, what="30 trickled messages handled")
    assert client is not None
    p.close()


def test_key_mode_and_concurrent_listeners_on_the_cluster(side: RedisServer, ccluster: Cluster,
                                                          led: redis.Redis) -> None:
    p = Producer(ccluster.url)
    p.create_topic("t-keys", queues=4)
    p.create_topic("t-conc", queues=4)
    led.hset("ctl:g-keys", "rand_sleep_ms", 2)
    led.hset("ctl:g-conc", "flaky:c3:1", 2)  # comes back through %RETRY%g-conc, twice
    _start(ccluster, side, "w1", "w2")
    p.send_orderly_batch("t-keys", [(f"k{i % 50}", body(f"k{i % 50}", i // 50 + 1)) for i in range(600)])
    p.send_orderly_batch("t-conc", [(f"c{i}", body(f"c{i}", 1)) for i in range(200)])
    wait_for(lambda: _handled(led, "g-keys", 600), timeout=120, what="600 key-ordered messages")
    wait_for(lambda: _handled(led, "g-conc", 200), timeout=120, what="200 concurrent messages")
    violations, handled, _ = check_order(ledger(led, "g-keys"))
    assert violations == [] and handled == 600
    per_key: dict[str, list[int]] = defaultdict(list)
    for e in ledger(led, "g-conc"):
        per_key[e["key"]].append(e["reconsume"])
    assert max(per_key["c3"]) == 2  # the flaky message really was retried through the retry topic
    p.close()


def test_transactions_and_delays_on_the_cluster(side: RedisServer, ccluster: Cluster, led: redis.Redis) -> None:
    from mqorder.client.transaction import LocalTransactionState, TransactionProducer

    tp = TransactionProducer(ccluster.url)
    tp.create_topic("t-order", queues=4)
    _start(ccluster, side, "w1")

    def execute(msg: object, arg: object) -> LocalTransactionState:
        return LocalTransactionState.COMMIT if arg == "commit" else LocalTransactionState.ROLLBACK

    for i in range(20):
        tp.send_in_transaction("t-order", body(f"t{i}", 1), sharding_key=f"t{i}", executor=execute,
                               arg="commit" if i % 2 == 0 else "rollback")
    tp.send("t-order", body("late", 1), delay_time_level=1)  # 1 s
    wait_for(lambda: _handled(led, "g-order", 11), timeout=60, what="10 committed + 1 delayed message")
    handled = {e["key"] for e in ledger(led, "g-order")}
    assert handled == {f"t{i}" for i in range(0, 20, 2)} | {"late"}
    tp.close()


def test_retention_trims_what_the_workers_consumed_on_every_shard(cdep: ClusterDeployment, side: RedisServer,
                                                                  ccluster: Cluster, led: redis.Redis) -> None:
    """A worker's retention pass (the ``consumed`` policy) trims each queue's log behind its
    group's committed offset, on the shard that holds it."""
    p = Producer(ccluster.url)
    p.create_topic("t-order", queues=6)
    assert len(_shards_of(cdep, p, "t-order")) == 3
    _start(ccluster, side, "w1", MQORDER_RETENTION_POLICY="consumed", MQORDER_RETENTION_MS="1000",
           MQORDER_RETENTION_MIN_MS="0", MQORDER_RETENTION_INTERVAL_MS="500")
    p.send_orderly_batch("t-order", [(f"k{i}", body(f"k{i}", 1)) for i in range(300)])
    wait_for(lambda: _handled(led, "g-order", 300), timeout=60, what="300 messages handled")
    mqs = p.describe_topic("t-order").message_queues

    def stored() -> dict[int, int]:
        """Entries left in each queue's log, read on the master serving it."""
        return {mq.queue_id: int(cdep.client(cdep.master_of_slot(key_slot(mq.tag.encode()))).xlen(
            keys.queue_log(mq.tag))) for mq in mqs}

    wait_for(lambda: set(stored().values()) == {0}, timeout=30, what="every queue trimmed")
    p.close()


def test_the_cluster_refuses_to_be_celerys_broker(ccluster: Cluster) -> None:
    """Without MQORDER_CELERY_BROKER_URL a cluster store cannot carry Celery's tasks: the worker
    stops at start with a message naming the choices."""
    ccluster.celery_broker_url = None
    w = ccluster.start_worker("w0", wait=False)
    wait_for(lambda: w.proc is not None and w.proc.poll() is not None, timeout=60, what="the worker to refuse")
    text = w.logfile.read_text() if w.logfile is not None else ""
    assert "MQORDER_CELERY_BROKER_URL" in text and "Cluster" in text, text[-2000:]


def test_kill_9_of_a_master_during_consumption(cdep: ClusterDeployment, side: RedisServer, ccluster: Cluster,
                                               led: redis.Redis) -> None:
    """Last in this module (it kills a master for good). Kill -9 a master while two workers consume
    a steady stream; the cluster promotes its replica. Sends wait for one replica until the kill,
    so none acknowledged is lost; the order of what was handled holds; the queues of the other shards are
    never stopped; consumption of the failed shard's queues resumes soon after the promotion."""
    p = Producer(ccluster.url)
    p.create_topic(TOPIC, queues=6)
    for name in ("w1", "w2"):
        ccluster.start_worker(name, MQORDER_LISTENERS="tests.sentinel_listeners", SENTINEL_TEST_LEDGER_URL=side.url)
    acked: list[tuple[str, int, float]] = []
    stop, killed = threading.Event(), threading.Event()
    n_keys = 18

    def send_loop() -> None:
        seq = dict.fromkeys((f"k{i}" for i in range(n_keys)), 0)
        i = 0
        while not stop.is_set():
            k = f"k{i % n_keys}"
            try:
                # One replica acknowledges each send until the kill; the promoted replica has none.
                p.send_orderly(TOPIC, stamped_body(k, seq[k] + 1, time.time()), sharding_key=k,
                               wait_replicas=0 if killed.is_set() else 1)
            except (redis.RedisError, BrokerUnavailableError):
                time.sleep(0.05)
                continue  # the same (key, seq) again: a key's acknowledged sends stay in order
            seq[k] += 1
            acked.append((k, seq[k], time.time()))
            i += 1
            time.sleep(0.004)

    def handled() -> list[dict]:
        return ledger_entries(led, GROUP)

    mqs = p.describe_topic(TOPIC).message_queues
    slots = {mq: key_slot(mq.tag.encode()) for mq in mqs}
    victim = cdep.master_of_slot(slots[mqs[0]])
    on_victim = {mq.queue_id for mq in mqs if cdep.master_of_slot(slots[mq]) is victim}
    sender = threading.Thread(target=send_loop, daemon=True)
    try:
        sender.start()
        wait_for(lambda: len(handled()) >= 500, timeout=60, what="500 handled before the kill")
        t_kill = time.time()
        killed.set()
        cdep.kill(victim)
        cdep.wait_failover(victim, slots[mqs[0]])
        t_failover = time.time()

        def first_new_on_victim() -> float | None:
            times = [e["start"] for e in handled() if e["sent"] >= t_failover and e["queue"] in on_victim]
            return min(times) if times else None

        assert eventually(lambda: first_new_on_victim() is not None, timeout=30), "the failed shard never resumed"
        time.sleep(2)
        stop.set()
        sender.join(timeout=10)
        last = {k: s for k, s, _ in acked}
        settle_s = (Settings.model_fields["run_lease_ms"].default + Settings.model_fields["sweep_interval_ms"].default
                    + Settings.model_fields["pending_ttl_ms"].default) / 1000 + 10
        wait_for(lambda: all(any(e["key"] == k and e["seq"] == s for e in handled()) for k, s in last.items()),
                 timeout=settle_s, what="the last send of every key handled")
    finally:
        stop.set()
        sender.join(timeout=10)
        p.close()
    entries = handled()
    assert order_violations(entries) == []
    seen = {(e["key"], e["seq"]) for e in entries}
    lost = {(k, s) for k, s, _ in acked} - seen
    assert not lost, f"{len(lost)} sends acknowledged by a replica were lost"
    others = [e["start"] for e in entries if e["queue"] not in on_victim]
    pause_others = longest_pause(others, since=t_kill - 0.5)
    resumed = first_new_on_victim()
    assert resumed is not None and resumed - t_failover <= 10.0
    print(f"\ncluster e2e failover: promoted {t_failover - t_kill:.2f} s after the kill; the other shards' longest "
          f"pause {pause_others:.2f} s; the failed shard's first new message handled {resumed - t_failover:.2f} s "
          f"after the promotion; {len(acked)} acked sends, {len(entries)} handled")

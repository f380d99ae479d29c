"""The chaos suite's Redis Cluster rows (``cluster-kill``, ``cluster-failover``, ``cluster-reshard``):
their faults on a real cluster, without workers, and how the checker and the report read them.

* ``ClusterDeployment.migrate_slot`` moves every key of a queue to another master while a client
  keeps writing to it through the store's cluster client, and refuses a move it cannot make;
* ``ClusterFaults`` on a 3-master + 3-replica cluster: a round of slot migrations, then a master
  killed, its replica promoted and the killed node back as the promoted node's in-sync replica;
  the lock-table monitor samples every queue throughout, whichever master serves it;
* the checker measures a cluster failover over the killed shard's queues only (the others never
  stopped), and the report names the cluster's settings and its promoted replica.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from chaos import records, report
from chaos.checker import RunData, check
from chaos.cluster_faults import ClusterFaults
from chaos.cluster_topology import BROKER_DB, ClusterSpec
from chaos.evidence import Event, Evidence
from chaos.listeners import TOPIC
from chaos.processes import Processes
from chaos.records import Entry
from chaos.traffic import Ack
from mqorder import Producer, keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.connect import close, connect
from mqorder.testing.cluster import ClusterDeployment

T = 1000.0


# -- the harness: a slot migrated under writes ------------------------------------------------------


@pytest.fixture(scope="module")
def cdep() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3) as d:
        yield d


def test_migrate_slot_moves_every_key_of_a_queue_while_a_client_keeps_writing(cdep: ClusterDeployment) -> None:
    client = connect(cdep.url(), socket_timeout=2)
    tag = "{mqorder-test:b:7}"
    stream, state = f"log:{tag}", f"state:{tag}"
    client.hset(state, mapping={"epoch": 41, "offset": 3})
    written: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                client.xadd(stream, {"i": i})
                written.append(i)
                i += 1
            except redis.RedisError as exc:  # an ASK or TRYAGAIN the client did not follow
                errors.append(exc)
            time.sleep(0.002)

    t = threading.Thread(target=writer)
    t.start()
    try:
        time.sleep(0.3)
        slot = key_slot(stream.encode())
        source = cdep.master_of_slot(slot)
        target = next(n for n in cdep.masters_serving() if n is not source)
        moved = cdep.migrate_slot(slot, target)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(10)
    assert moved == 2  # the stream and the state hash: the whole queue
    assert cdep.master_of_slot(slot) is target
    assert errors == []
    entries: Any = client.xrange(stream)
    assert [int(fields[b"i"]) for _, fields in entries] == written and len(written) > 100
    assert client.hgetall(state) == {b"epoch": b"41", b"offset": b"3"}
    direct = cdep.client(target)
    assert direct.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 2
    direct.close()
    close(client)


def test_migrate_slot_refuses_a_move_it_cannot_make(cdep: ClusterDeployment) -> None:
    with pytest.raises(ValueError, match="not a hash slot"):
        cdep.migrate_slot(16384, cdep.nodes[0])
    slot = 100
    with pytest.raises(ValueError, match="already served by"):
        cdep.migrate_slot(slot, cdep.master_of_slot(slot))


# -- the cluster faults on a 3-master, 3-replica cluster ------------------------------------------


def _wait_replicated(d: ClusterDeployment, timeout: float = 30.0) -> None:
    """Until each serving master's replicas hold all it wrote. This test's sends do not wait for
    replicas (the cluster-failover scenario's do: ``wait_replicas`` 1), and Redis Cluster loses a
    killed master's writes its replica had not received yet: under the suite's load a kill right
    after the sends once took 8 of the 60 messages with it. The kill is what is under test here,
    not replication's lag."""
    deadline = time.monotonic() + timeout
    while True:
        behind = []
        for m in d.masters_serving():
            info = d.client(m).info("replication")
            offsets = [v.get("offset", -1) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if not offsets or min(offsets) < info["master_repl_offset"]:
                behind.append((m.port, info["master_repl_offset"], offsets))
        if not behind:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still behind their masters after {timeout:.0f} s: {behind}")
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_cluster_faults_migrate_live_queues_and_fail_over_a_master_back_as_its_replica() -> None:
    procs = Processes("cluster-test", fsync="everysec", env={}, concurrency=1,
                      cluster=ClusterSpec(replicas_per_master=1))
    evidence = None
    try:
        procs.start_servers()
        # Celery's broker is a plain Redis, never the cluster.
        assert procs.env()["MQORDER_CELERY_BROKER_URL"].endswith(f"/{BROKER_DB}")
        assert procs.env()["MQORDER_REDIS_URL"].startswith("redis+cluster://")
        p = Producer(procs.url)
        p.create_topic(TOPIC, queues=6)
        mqs = p.describe_topic(TOPIC).message_queues
        for i in range(60):
            p.send_orderly(TOPIC, b"x", sharding_key=i)
        brokers = BrokerRegistry(procs.url)
        evidence = Evidence("cluster-test", procs.url, procs.ledger_url, brokers,
                            RebalanceLockManager(brokers, 30_000), mqs)
        evidence.start_monitor()
        assert evidence.owners() == dict.fromkeys(range(6), "")  # nobody consumes: no owner
        cf = ClusterFaults(procs, evidence)
        assert procs.cluster is not None
        before = procs.cluster.serving(mqs)

        e = cf.reshard(queues=2)
        moves = e.info["moves"]
        assert [m["queue"] for m in moves] == [0, 1] and all(m["keys"] >= 2 for m in moves)
        after = procs.cluster.serving(mqs)
        assert all(after[m["queue"]] is not before[m["queue"]] for m in moves)

        _wait_replicated(procs.cluster.deployment)
        k = cf.kill_master(restart_after=0.5)
        assert k.kind == "primary-kill" and k.queues == sorted(k.queues)
        killed = next(n for n in procs.cluster.nodes if procs.cluster.name(n) == k.target)
        promoted = next(n for n in procs.cluster.nodes if procs.cluster.name(n) == k.info["promoted"])
        assert procs.cluster.deployment.role(killed) == "slave"
        assert promoted in procs.cluster.masters() and killed not in procs.cluster.masters()
        assert 0 < k.info["promoted_s"] < k.info["restarted_s"] < k.end() - k.t
        assert cf.planned_failovers == 1 and cf.unplanned_failovers() == 0
        assert any("promoted" in n for n in cf.failover_notes())
        # Every message is still there, on whichever master serves its queue now.
        assert sum(_end(brokers, mq) for mq in mqs) == 60
        time.sleep(0.5)
        sampled = {s[1] for s in evidence.samples if s[0] > k.end()}
        assert sampled == set(range(6))
        p.close()
    finally:
        if evidence is not None:
            evidence.stop_monitor()
            evidence.close()
        procs.stop_servers()
        procs.remove_files(keep_logs=False)


def _end(brokers: BrokerRegistry, mq: MessageQueue) -> int:
    """The end (next offset) of a queue, read through the store's cluster client."""
    return int(brokers.get(mq.broker_name).client.get(keys.queue_next(mq.tag)) or 0)


# -- the checker and the report ---------------------------------------------------------------------


def _call(queue: int, key: str, seq: int, start: float, *, epoch: int = 1, run: str = "a") -> Entry:
    return Entry(key=key, seq=seq, queue=queue, offset=seq - 1, epoch=epoch, client="c1", pid=1, start=start,
                 end=start + 0.01, reconsume=0, status=records.SUCCESS, still_owner=True, run=run)


def _run(events: list[Event]) -> RunData:
    """Queue 0 is on the killed shard (no call from T to T + 6); queue 1 on another, called throughout."""
    entries, acks = [], []
    for i, t in enumerate([T - 2, T - 1, T + 6, T + 7], start=1):
        acks.append(Ack("k0", i, 0, i - 1, t - 0.01))
        entries.append(_call(0, "k0", i, t, epoch=1 if t < T else 2, run="a" if t < T else "b"))
    for i in range(1, 40):
        t = T - 2 + i * 0.25
        acks.append(Ack("k1", i, 1, i - 1, t - 0.01))
        entries.append(_call(1, "k1", i, t, run="c"))
    return RunData(scenario="t", fsync="everysec", entries=entries, acks=acks, unknown=[], poison=[], dlq=[],
                   events=events, samples=[], refusals=[], published=[], beats=[], drained=True, batch=32,
                   max_reconsume=3, suspend_s=1.0, send_wait=1)


def _kill(queues: list[int]) -> Event:
    return Event(T, "primary-kill", "node-0:1", t_end=T + 8, queues=queues,
                 info={"lost_at": T, "promoted_at": T + 3, "promoted_s": 3.0})


def test_a_cluster_failover_is_measured_over_the_killed_shards_queues_only() -> None:
    shard = check(_run([_kill([0])]))
    assert shard.redis_failovers == [6.0]
    assert shard.redis_failover_events[0]["queues"] == 1 and shard.problems == []
    # A Sentinel failover names no queue: every queue sent something after it is measured.
    whole = check(_run([_kill([])]))
    assert sorted(whole.redis_failovers)[-1] == 6.0 and len(whole.redis_failovers) == 2


def test_a_shard_queue_that_never_resumes_fails_the_run() -> None:
    data = _run([_kill([0])])
    data.entries = [e for e in data.entries if not (e.queue == 0 and e.start > T)]
    res = check(data)
    assert any("no listener call after the primary-kill" in p for p in res.problems)


def test_the_report_names_the_cluster_and_its_promoted_replica() -> None:
    res = check(_run([_kill([0])]))
    d = report.compact(res, title="cluster failover", env={}, quick=False, seconds=30,
                       cluster=ClusterSpec(replicas_per_master=1, send_wait=1).describe())
    text = "\n".join(report._details(d))
    assert "Redis Cluster 3 masters × 1 replica(s)" in text and "Celery broker a plain Redis" in text
    assert "the cluster's promoted replica served the shard's slots after 3.00 s" in text
    assert "all 1 queues of the shard had a listener call again within 6.00 s" in text
    assert "cluster-failover" in report.LAST and "cluster-reshard" in report.LAST

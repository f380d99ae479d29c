"""``ClusterRoute``: the lean round trips on a real Redis Cluster (3 masters, each with a replica).

Routing by slot with every node written before any is read; ``WAIT`` on the node of the write it
follows; ``MOVED`` after a slot migration and ``ASK`` during one; a killed master is a
``ConnectionError`` and the promoted replica serves the next round trip; a lock grant waited for
(``WAIT``, ``ReplicaWait``) is on the replica the cluster promotes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from mqorder import keys
from mqorder.errors import ConfigError
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import Broker, BrokerRegistry
from mqorder.store.cluster_route import ClusterClient, command_key
from mqorder.store.connect import close, connect
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline
from mqorder.store.replication import ReplicaWait
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer


@pytest.fixture(scope="module")
def cdep() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3, replicas_per_master=1) as d:
        yield d


@pytest.fixture
def cc(cdep: ClusterDeployment) -> Iterator[ClusterClient]:
    client = connect(cdep.url())
    assert isinstance(client, ClusterClient)
    client.flushall()
    yield client
    close(client)


def _keys_on_three_nodes(cdep: ClusterDeployment) -> list[str]:
    """Three keys, each in a slot of a different master."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < 3:
        k = f"k{i}"
        out.setdefault(cdep.master_of_slot(key_slot(k.encode())).port, k)
        i += 1
    return list(out.values())


def _id(cdep: ClusterDeployment, node: RedisServer) -> str:
    raw = cdep.client(node).execute_command("CLUSTER", "MYID")
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _masters(cdep: ClusterDeployment) -> list[RedisServer]:
    out = []
    for n in cdep.nodes:
        if n.proc is None or n.proc.poll() is not None:
            continue
        if cdep.client(n).info("replication").get("role") == "master":
            out.append(n)
    return out


def _begin_migration(cdep: ClusterDeployment, slot: int) -> tuple[RedisServer, RedisServer]:
    src = cdep.master_of_slot(slot)
    dst = next(n for n in _masters(cdep) if n is not src)
    cdep.client(dst).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _id(cdep, src))
    cdep.client(src).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _id(cdep, dst))
    return src, dst


def _move_keys(cdep: ClusterDeployment, src: RedisServer, dst: RedisServer, slot: int) -> None:
    c = cdep.client(src)
    ks = c.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if ks:
        c.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *ks)


def _end_migration(cdep: ClusterDeployment, dst: RedisServer, slot: int) -> None:
    for n in _masters(cdep):
        cdep.client(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE", _id(cdep, dst))


def test_command_key_finds_the_routing_key() -> None:
    assert command_key(("EVALSHA", "abc", 2, "k1", "k2", "a")) == b"k1"
    assert command_key(("EVALSHA", "abc", 0, "a")) is None
    assert command_key(("XREAD", "COUNT", 5, "BLOCK", 10, "STREAMS", "s1", "0-0")) == b"s1"
    assert command_key(("HMGET", b"h", "f")) == b"h"
    assert command_key(("WAIT", 1, 100)) is None


def test_one_round_trip_over_three_nodes_keeps_the_callers_order(cdep: ClusterDeployment, cc: ClusterClient) -> None:
    ks = _keys_on_three_nodes(cdep)
    lease = ConnectionLease(cc)
    try:
        out = lease.round_trip([("SET", k, f"v-{k}") for k in ks] + [("GET", k) for k in reversed(ks)])
    finally:
        lease.release()
    assert out[:3] == [b"OK"] * 3
    assert out[3:] == [f"v-{k}".encode() for k in reversed(ks)]
    for k in ks:  # each key really is on the master serving its slot
        assert cdep.client(cdep.master_of_slot(key_slot(k.encode()))).get(k) == f"v-{k}".encode()


def test_wait_goes_to_the_node_of_the_write_before_it(cdep: ClusterDeployment, cc: ClusterClient) -> None:
    ks = _keys_on_three_nodes(cdep)
    lease = ConnectionLease(cc)
    try:
        # Alone in its round trip, WAIT follows the lease's last write: 1 replica acknowledges it.
        lease.round_trip([("SET", ks[0], "x")])
        assert lease.round_trip([("WAIT", 1, 2000)]) == [1]
        out = RawPipeline(lease).execute_command("SET", ks[1], "y").execute_command("WAIT", 1, 2000) \
            .execute_command("SET", ks[2], "z").execute_command("WAIT", 1, 2000).execute()
        assert out == [b"OK", 1, b"OK", 1]
    finally:
        lease.release()


def test_moved_after_a_migration_is_followed(cdep: ClusterDeployment, cc: ClusterClient) -> None:
    mq = MessageQueue("t-moved", "broker-a", 0)
    k = keys.queue_next(mq.tag)
    slot = key_slot(k.encode())
    cc.set(k, 41)
    src, dst = _begin_migration(cdep, slot)
    _move_keys(cdep, src, dst, slot)
    _end_migration(cdep, dst, slot)
    lease = ConnectionLease(cc)  # its slot map still says src
    try:
        assert lease.round_trip([("INCR", k), ("GET", k)]) == [42, b"42"]
    finally:
        lease.release()
    assert cc.primary_for(k).port == dst.port  # the map was patched from the MOVED
    assert int(cdep.client(dst).get(k) or 0) == 42


def test_ask_during_a_migration_is_followed_and_a_script_sees_its_whole_queue(cdep: ClusterDeployment,
                                                                              cc: ClusterClient) -> None:
    reg = BrokerRegistry(cdep.url())
    try:
        mq = MessageQueue("t-ask", "broker-a", 1)
        state = keys.sub_state(mq.tag, "g")
        locks = RebalanceLockManager(reg)
        e1 = locks.try_lock_batch("g", [mq], "c1")[mq]
        slot = key_slot(mq.tag.encode())
        src, dst = _begin_migration(cdep, slot)
        _move_keys(cdep, src, dst, slot)  # every key of the queue is on dst; the slot still src's
        try:
            # src answers ASK for the missing keys; the script runs on dst after ASKING.
            assert locks.try_lock_batch("g", [mq], "c1")[mq] == e1  # renewed: the same epoch
        finally:
            _end_migration(cdep, dst, slot)
        assert cdep.client(dst).hget(state, "owner") == b"c1"
        assert locks.try_lock_batch("g", [mq], "c2") == {}  # c1's live lock moved with the slot
        entry = locks.lock_entry("g", mq)  # read on the node that now holds it, by its clock
        assert entry.owner == "c1" and entry.epoch == e1 and locks.is_locked("g", mq, "c1")
    finally:
        reg.close()


def test_slot_batches_split_by_slot_on_a_cluster_only(cdep: ClusterDeployment) -> None:
    broker = Broker("broker-a", cdep.url())
    try:
        mqs = [MessageQueue("t", "broker-a", i) for i in range(8)]
        batches = broker.slot_batches(mqs, lambda mq: mq.tag)
        assert sorted(mq.queue_id for b in batches for mq in b) == list(range(8))
        assert all(len({key_slot(mq.tag.encode()) for mq in b}) == 1 for b in batches)
        assert len(batches) == 8
    finally:
        broker.close()


def test_the_sweep_records_each_shard_primarys_own_identity(cdep: ClusterDeployment) -> None:
    """On a cluster each queue's state gets the replication id of the primary of its own shard
    (sweep.lua's node identity: a shard's failover changes only its own)."""
    brokers = BrokerRegistry(cdep.url())
    try:
        broker = brokers.default
        mqs = [MessageQueue("t", "broker-a", i) for i in range(8)]
        locks = RebalanceLockManager(brokers)
        locks.assign("g", [(mq, "c1", f"t{i}") for i, mq in enumerate(mqs)])
        assert locks.sweep("g", [(mq, f"s{i}") for i, mq in enumerate(mqs)], "c1") == []  # nothing to consume
        recorded = {mq: broker.client.hget(keys.sub_state(mq.tag, "g"), "node") for mq in mqs}
        for mq in mqs:
            primary = broker.client.primary_for(mq.tag)
            own = broker.client.node_client(primary).info("replication")["master_replid"]
            assert recorded[mq] == own.encode()
        assert len(set(recorded.values())) == 3  # the three masters, each its own
    finally:
        brokers.close()


def test_a_plain_url_to_a_cluster_node_is_refused_with_the_cluster_url(cdep: ClusterDeployment) -> None:
    node = cdep.nodes[0]
    broker = Broker("broker-a", f"redis://127.0.0.1:{node.port}/0")
    try:
        with pytest.raises(ConfigError, match=r"redis\+cluster://"):
            broker.ping()
    finally:
        broker.close()


def test_a_durable_batch_waits_on_every_shard_it_wrote(cdep: ClusterDeployment, cc: ClusterClient) -> None:
    from mqorder import Producer

    p = Producer(cdep.url())
    try:
        p.create_topic("t-dur", queues=6)
        masters = _masters(cdep)
        p.brokers.default.scripts.load("send")  # else the first batch meets NOSCRIPT and is sent again
        items = [(f"k{i}", b"m") for i in range(60)]
        for dedup in (None, [f"d{i}" for i in range(60)]):  # with dedup keys: a fence write per shard
            for m in masters:
                cdep.client(m).config_resetstat()
            results = p.send_orderly_batch("t-dur", items, wait_replicas=1, dedup_keys=dedup)
            assert len(results) == 60
            shards = {cdep.master_of_slot(key_slot(r.message_queue.tag.encode())).port for r in results}
            assert len(shards) == 3
            for m in masters:  # exactly one WAIT per shard, on the connection that wrote there
                stats = cdep.client(m).info("commandstats")
                assert int(stats.get("cmdstat_wait", {}).get("calls", 0)) == 1, (m.port, dedup is None)
    finally:
        p.close()


def test_sharded_wake_ups_follow_a_slot_migration(cdep: ClusterDeployment, cc: ClusterClient) -> None:
    """The listener subscribes a queue's shard channel on the node serving its slot; after the slot
    migrates (the server unsubscribes the channel there), it re-homes it to the new node, where
    a wake-up published on the shard then arrives."""
    import threading

    from mqorder.consumer.shard_wake import ShardWakeListener
    from mqorder.store.wake import WakeUp

    mq = MessageQueue("t-swake", "broker-a", 5)
    reg = BrokerRegistry(cdep.url())
    stop = threading.Event()
    got: list[WakeUp] = []
    listener = ShardWakeListener(reg, "c1", lambda: [mq], got.append, stop)
    t = threading.Thread(target=listener.run, daemon=True)
    t.start()
    chan = keys.shard_wake_channel(mq.tag, "c1")
    slot = key_slot(mq.tag.encode())

    def subscribers(node: RedisServer) -> int:
        return int(cdep.client(node).execute_command("PUBSUB", "SHARDNUMSUB", chan)[1])

    def until(pred: object, what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():  # type: ignore[operator]
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        src = cdep.master_of_slot(slot)
        until(lambda: subscribers(src) == 1, "the subscription on the slot's node")
        cc.execute_command("SPUBLISH", chan, WakeUp("g", mq.key, "tok1").encode(), target_nodes=cc.primary_for(chan))
        until(lambda: [w.token for w in got] == ["tok1"], "the first wake-up")
        src, dst = _begin_migration(cdep, slot)
        _move_keys(cdep, src, dst, slot)
        _end_migration(cdep, dst, slot)
        until(lambda: subscribers(dst) == 1 and subscribers(src) == 0, "the subscription to move with the slot")
        cdep.client(dst).execute_command("SPUBLISH", chan, WakeUp("g", mq.key, "tok2").encode())
        until(lambda: [w.token for w in got] == ["tok1", "tok2"], "the wake-up on the new node")
    finally:
        stop.set()
        t.join(timeout=5)
        reg.close()


def _replica_of(cdep: ClusterDeployment, master: RedisServer) -> RedisServer:
    for n in cdep.nodes:
        if n.proc is None or n.proc.poll() is not None:
            continue
        role = cdep.client(n).execute_command("ROLE")
        if role[0] in (b"slave", "slave") and int(role[2]) == master.port:
            return n
    raise AssertionError(f"no replica of {master.port}")


def test_a_durable_write_redirected_to_another_shard_is_waited_for_there(cdep: ClusterDeployment,
                                                                          cc: ClusterClient) -> None:
    """A batch's shard group (two queues of master X, the client's slot map stale: one queue's slot
    migrated to Y) ends with one WAIT on X. The write answered MOVED went again to Y alone: the
    WAIT had run on X, never on Y, and the send was acknowledged while Y's replica (stopped here)
    had nothing of it. A WAIT follows a redirected write on its new node now: ReplicasBehindError."""
    import os
    import signal

    from mqorder import Producer
    from mqorder.client.selector import queue_index
    from mqorder.errors import ReplicasBehindError
    from mqorder.store.log import MessageLog

    p = Producer(cdep.url(), send_wait_timeout_ms=500)
    try:
        p.create_topic("t-mv", queues=16)
        p.brokers.default.scripts.load("send")
        mqs = p.describe_topic("t-mv").message_queues
        by_master: dict[int, list[MessageQueue]] = {}
        for mq in mqs:
            by_master.setdefault(cdep.master_of_slot(key_slot(mq.tag.encode())).port, []).append(mq)
        qa, qb = next(v for v in by_master.values() if len(v) >= 2)[:2]
        key_of = {mq: next(f"k{i}" for i in range(10_000) if queue_index(f"k{i}", 16) == mq.queue_id) for mq in (qa, qb)}
        items = [(key_of[qa], b"a"), (key_of[qb], b"b")]
        assert len(p.send_orderly_batch("t-mv", items, wait_replicas=1)) == 2  # the map is loaded, all healthy
        x = cdep.master_of_slot(key_slot(qa.tag.encode()))
        y = next(m for m in _masters(cdep) if m is not x)
        cdep.migrate_slot(key_slot(qa.tag.encode()), y)  # the producer's map still says X
        stopped = _replica_of(cdep, y)
        assert stopped.proc is not None
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplicasBehindError):
                p.send_orderly_batch("t-mv", items, wait_replicas=1)
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        assert [m.body for m in MessageLog(p.brokers).read(qa, 0, 10)] == [b"a", b"a"]  # stored on Y all the same
    finally:
        p.close()


def test_a_killed_master_fails_the_round_trip_then_its_promoted_replica_serves(cdep: ClusterDeployment,
                                                                              cc: ClusterClient) -> None:
    """Last in this module: it kills a master (the cluster keeps working on its replica)."""
    mq = MessageQueue("t-fo", "broker-a", 3)
    reg = BrokerRegistry(cdep.url())
    broker = reg.default
    try:
        locks = RebalanceLockManager(reg, replica_wait=ReplicaWait(None, 2000))
        assert ReplicaWait(None, 2000).wanted(broker, mq.tag) == 1  # this shard has a replica
        epoch = locks.try_lock_batch("g", [mq], "c1")[mq]  # returned only once a replica has it
        slot = key_slot(mq.tag.encode())
        dead = cdep.master_of_slot(slot)
        cdep.kill(dead)
        lease = ConnectionLease(broker.client)
        try:
            with pytest.raises(redis.ConnectionError):
                lease.round_trip([("HGET", keys.sub_state(mq.tag, "g"), "epoch")])
            promoted = cdep.wait_failover(dead, slot)
            # The grant the primary acknowledged after WAIT is on the promoted replica.
            assert int(cdep.client(promoted).hget(keys.sub_state(mq.tag, "g"), "epoch") or 0) == epoch
            for _ in range(50):  # the slot map is re-read (rate-limited) after the failure
                try:
                    assert lease.round_trip([("HGET", keys.sub_state(mq.tag, "g"), "owner")]) == [b"c1"]
                    break
                except redis.ConnectionError:
                    time.sleep(0.2)
            else:
                raise AssertionError("the promoted replica never served the round trip")
        finally:
            lease.release()
        # The fence: the next grant is above the last one, whatever the promoted replica missed.
        assert locks.try_lock_batch("g", [mq], "c1")[mq] == epoch  # own live lock renewed
    finally:
        reg.close()

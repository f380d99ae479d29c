"""One shard of a Redis Cluster down (a master without a replica; ``cluster-require-full-coverage
no``): the lock manager's steps do the other shards' part. A step over a broker's queues goes out
to every shard in one round trip, which raised as a whole at the dead node: lease renewals,
sweeps and a rebalance's assignments stopped on *every* shard for as long as one was down (each
queue's lease then lapsed and its run stopped: an outage of one shard stalled the whole topic).
Found by a review; a real 3-master cluster, one master killed."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import redis
from redis.crc import key_slot

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.cluster_route import ClusterClient
from mqorder.store.connect import close, connect
from mqorder.store.raw_pipe import RawPipeline
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer


def test_a_dead_shard_fails_only_its_own_queues_renewals_sweeps_and_assignments(caplog) -> None:
    with ClusterDeployment(masters=3) as cdep:
        brokers = BrokerRegistry(cdep.url())
        try:
            mqs = [MessageQueue("t", "broker-a", i) for i in range(12)]
            dead = cdep.master_of_slot(key_slot(mqs[0].tag.encode()))
            lost = [mq for mq in mqs if cdep.master_of_slot(key_slot(mq.tag.encode())) is dead]
            alive = [mq for mq in mqs if mq not in lost]
            assert lost and len(alive) >= 4  # queues on all three shards
            locks = RebalanceLockManager(brokers, lock_max_live_time_ms=60_000)
            assert set(locks.assign("g", [(mq, "c1", f"a{i}") for i, mq in enumerate(mqs)])) == set(mqs)
            epochs = locks.try_lock_lanes([("g", mqs)], "c1")[0]
            assert set(epochs) == set(mqs)
            client = brokers.default.client
            for mq in alive:
                client.hset(keys.sub_state(mq.tag, "g"), "lease", 1)  # about to lapse: the renewal must extend it
                client.set(keys.queue_next(mq.tag), 3)  # a backlog and no request: the sweep redispatches
            cdep.kill(dead)
            with caplog.at_level(logging.WARNING):
                t0 = time.monotonic()
                renewed = locks.try_lock_lanes([("g", mqs)], "c1")[0]
                assert set(renewed) == set(alive)
                assert all(int(client.hget(keys.sub_state(mq.tag, "g"), "lease")) > 1 for mq in alive)
                swept = locks.sweep("g", [(mq, f"s{i}") for i, mq in enumerate(mqs)], "c1")
                assert {r.mq for r in swept} == set(alive)
                moved = locks.assign("g", [(mq, "c2", f"b{i}") for i, mq in enumerate(mqs)], dead_clients=["c1"])
                assert set(moved) == set(alive)
                assert locks.unlock_batch("g", alive[:1], "c2", force=True) == set(alive[:1])
                took = time.monotonic() - t0
            assert "lock: " in caplog.text and f"of {len(mqs)} calls on broker 'broker-a' failed" in caplog.text
            assert took < 10, took  # a dead node is refused at once, not waited for per call
            # A plain round trip (the consume path's) still fails as a whole: a run's commands all
            # go to its own queue's node, and its callers retry the whole round trip.
            pipe = RawPipeline(client)
            for mq in (alive[0], lost[0]):
                pipe.execute_command("HGET", keys.sub_state(mq.tag, "g"), "owner")
            with pytest.raises(redis.ConnectionError):
                pipe.execute()
        finally:
            brokers.close()


def test_a_partial_round_trip_keeps_the_first_replies_when_a_redirect_target_is_down() -> None:
    """A write answered MOVED to a node that is down: the retry goes to that one node, and failed
    the whole round trip, the other node's reply (its script had run) thrown away."""
    with ClusterDeployment(masters=3) as cdep:
        cc = connect(cdep.url())
        assert isinstance(cc, ClusterClient)
        try:
            x, y, z = sorted({m.port: m for _, _, m in cdep.slot_map()}.values(), key=lambda m: m.port)
            a = next(f"k{i}" for i in range(10_000) if cdep.master_of_slot(key_slot(f"k{i}".encode())) is x)
            b = next(f"k{i}" for i in range(10_000) if cdep.master_of_slot(key_slot(f"k{i}".encode())) is y)
            assert RawPipeline(cc).execute_command("SET", a, 0).execute_command("SET", b, 0).execute() == [b"OK"] * 2
            cdep.migrate_slot(key_slot(a.encode()), z)  # the client's map still says X
            cdep.kill(z)
            out = RawPipeline(cc).execute_command("SET", a, 1).execute_command("SET", b, 1).execute(
                raise_on_error=False, partial=True)
            assert isinstance(out[0], redis.ConnectionError) and out[1] == b"OK", out
        finally:
            close(cc)


def _replica_of(cdep: ClusterDeployment, master: RedisServer) -> RedisServer:
    for n in cdep.nodes:
        if n.proc is not None and n.proc.poll() is None:
            role = cdep.client(n).execute_command("ROLE")
            if role[0] in (b"slave", "slave") and int(role[2]) == master.port:
                return n
    raise AssertionError(f"no replica of {master.port}")


def test_two_writes_of_one_wait_redirected_to_two_nodes_are_each_waited_for() -> None:
    """One group of X (two writes, one WAIT), both slots gone, to Y and Z, behind the client's map:
    the caller's WAIT went again with the second write to Z, and the first write's node Y, whose
    replica is stopped, was waited on by nobody."""
    with ClusterDeployment(masters=3, replicas_per_master=1) as cdep:
        cc = connect(cdep.url())
        assert isinstance(cc, ClusterClient)
        try:
            x, y, z = sorted({m.port: m for _, _, m in cdep.slot_map()}.values(), key=lambda m: m.port)
            on_x = [f"k{i}" for i in range(10_000) if cdep.master_of_slot(key_slot(f"k{i}".encode())) is x]
            q1 = on_x[0]
            q2 = next(k for k in on_x if key_slot(k.encode()) != key_slot(q1.encode()))

            def durable(v: int) -> list:
                pipe = RawPipeline(cc)
                return pipe.execute_command("SET", q1, v).execute_command("SET", q2, v).execute_command(
                    "WAIT", 1, 500).execute()

            assert durable(0) == [b"OK", b"OK", 1]  # the map loaded, every replica up
            cdep.migrate_slot(key_slot(q1.encode()), y)
            cdep.migrate_slot(key_slot(q2.encode()), z)
            stopped = _replica_of(cdep, y)
            assert stopped.proc is not None
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            try:
                out = durable(1)
            finally:
                os.kill(stopped.proc.pid, signal.SIGCONT)
            assert cdep.client(y).get(q1) == b"1"
            assert out == [b"OK", b"OK", 0]  # Y's replica has nothing of q1's write
        finally:
            close(cc)


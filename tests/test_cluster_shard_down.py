"""One shard of a Redis Cluster down (a master without a replica; ``cluster-require-full-coverage
no``): the lock manager's steps do the other shards' part. A step over a broker's queues goes out
to every shard in one round trip, which raised as a whole at the dead node: lease renewals,
sweeps and a rebalance's assignments stopped on *every* shard for as long as one was down (each
queue's lease then lapsed and its run stopped: an outage of one shard stalled the whole topic).
Found by a review; a real 3-master cluster, one master killed."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from redis.crc import key_slot

from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.raw_pipe import RawPipeline
from mqorder.testing.cluster import ClusterDeployment


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

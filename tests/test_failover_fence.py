"""The failover fence (invariant 9) against a real primary and replica, promoted by hand.

Asynchronous replication means a promoted replica may lack the old primary's last writes. These
tests make that happen deterministically: the replica is detached (``REPLICAOF NO ONE``, which is
what a promotion does) at a chosen moment, the old primary goes on accepting writes (a lock grant, a
commit, appends), and then dies. Every later call goes to the promoted replica, as a client that
followed Sentinel would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.testing.embedded import RedisServer
from mqorder.testing.sentinel import SentinelDeployment
from tests.support import grant_floor, wait_for

S = ConsumeOrderlyStatus
MQ = MessageQueue("t", "broker-a", 0)
LEASE_MS = 300


class Pair:
    """A primary and one replica of it, each a real ``redis-server``."""

    def __init__(self) -> None:
        self.primary = RedisServer().start()
        self.replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(self.primary.port)]).start()
        wait_for(self.in_sync, 20, what="replica in sync")

    def in_sync(self) -> bool:
        info = redis.Redis.from_url(self.primary.url).info("replication")
        return any(isinstance(v, dict) and v.get("state") == "online" for v in info.values())

    def promote(self) -> None:
        """What Sentinel does to the chosen replica: it stops following and takes writes. Whatever
        the primary accepts from now on is missing here."""
        redis.Redis.from_url(self.replica.url).execute_command("REPLICAOF", "NO", "ONE")

    def stop(self) -> None:
        self.primary.stop()
        self.replica.stop()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.stop()


def state(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.sub_state(MQ.tag, "g")).items()}


def commit(brokers: BrokerRegistry, client: str, epoch: int, offset: int, read_to: int, token: str = "tok") -> list:
    """``commit.lua`` as a run holding ``token`` calls it (no reads pipelined)."""
    tag = MQ.tag
    return brokers.default.scripts.commit(
        keys=[keys.sub_state(tag, "g"), keys.queue_next(tag), keys.sub_retries(tag, "g")],
        args=[client, epoch, token, offset, 60_000, LEASE_MS, "0", "", read_to],
    )


def test_a_grant_the_promoted_replica_missed_is_never_handed_out_again(pair: Pair) -> None:
    """B held the queue; its lease lapsed; A took it over on the old primary (epoch e_a) and
    committed under it. The promoted replica missed the takeover and still shows B's lapsed lock.
    With a plain counter, the next grant there would be e_a again: two clients, one epoch. The clock
    epoch puts every grant on the new primary above e_a, and neither A nor B can commit."""
    old = BrokerRegistry(pair.primary.url)
    new = BrokerRegistry(pair.replica.url)
    try:
        locks_old = RebalanceLockManager(old, LEASE_MS)
        e_b = locks_old.try_lock_batch("g", [MQ], "B")[MQ]
        old.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
        assert old.default.client.execute_command("WAIT", 1, 2000) == 1  # B's grant is on the replica
        time.sleep(LEASE_MS / 1000 + 0.1)  # B is paused past its lease
        pair.promote()  # ... and the replica that will be promoted stops here
        e_a = locks_old.try_lock_batch("g", [MQ], "A")[MQ]
        assert e_a > e_b
        old.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
        assert commit(old, "A", e_a, 0, 0)[0] == b"OK"
        pair.primary.kill()

        st = state(new.default.client)
        assert (st["owner"], int(st["epoch"])) == ("B", e_b)  # the takeover is lost
        locks_new = RebalanceLockManager(new, LEASE_MS)
        # B wakes up: its lapsed lease is not held, so it can neither commit nor renew in place.
        assert commit(new, "B", e_b, 0, 0)[0] == b"FENCED"
        e_b2 = locks_new.try_lock_batch("g", [MQ], "B")[MQ]
        assert e_b2 > e_a, "a grant after the failover repeated (or went below) an epoch granted before it"
        # A, whose grant the new primary never saw, is refused too.
        new.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
        assert commit(new, "A", e_a, 0, 0)[0] == b"FENCED"
        assert commit(new, "B", e_b2, 0, 0)[0] == b"OK"
    finally:
        old.close()
        new.close()


def test_a_run_that_read_messages_the_promoted_replica_lacks_cannot_commit_them(pair: Pair) -> None:
    """A keeps its lock across the failover (its grant was replicated), but it read offsets 3..5
    from the old primary, which the promoted replica never got. Committing them would skip the
    different messages that the new primary stores at offsets 3..5: refused as AHEAD."""
    settings = load_settings(redis_url=pair.primary.url)
    p = Producer(settings=settings)
    p.create_topic("t", queues=1)
    old = p.brokers
    new = BrokerRegistry(pair.replica.url)
    try:
        for i in range(3):
            p.send_orderly("t", b"%d" % i, sharding_key="k")
        e = RebalanceLockManager(old, 60_000).try_lock_batch("g", [MQ], "A")[MQ]
        old.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
        assert old.default.client.execute_command("WAIT", 1, 2000) == 1
        pair.promote()
        for i in range(3, 6):
            p.send_orderly("t", b"%d" % i, sharding_key="k")  # acknowledged, never replicated
        pair.primary.kill()
        new_p = Producer(settings=load_settings(redis_url=pair.replica.url))
        try:
            new_p.send_orderly("t", b"other", sharding_key="k2")  # stored at offset 3 now
        finally:
            new_p.close()
        assert commit(new, "A", e, 3, 3)[0] == b"OK"  # offsets 0..2 are the same messages here
        refused = commit(new, "A", e, 6, 6)
        assert refused[0] == b"AHEAD" and int(refused[1]) == 4
        assert state(new.default.client)["offset"] == "3"
    finally:
        p.close()
        new.close()


def test_a_lapsed_lease_is_regranted_under_a_new_epoch_even_to_its_owner(redis_url: str) -> None:
    brokers = BrokerRegistry(redis_url)
    try:
        locks = RebalanceLockManager(brokers, LEASE_MS)
        floor = grant_floor(brokers.default.client)
        e1 = locks.try_lock_batch("g", [MQ], "A")[MQ]
        assert e1 >= floor
        assert locks.try_lock_batch("g", [MQ], "A")[MQ] == e1  # a live lease renews in place
        brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), "pending", "tok")
        time.sleep(LEASE_MS / 1000 + 0.1)
        # touch.lua (ctx.still_owner) and commit.lua do not accept a lapsed lease ...
        touch = brokers.default.scripts.touch(keys=[keys.sub_state(MQ.tag, "g")], args=["A", e1, "tok", 0, 0])
        assert int(touch[0]) == 0
        assert commit(brokers, "A", e1, 0, 0)[0] == b"FENCED"
        # ... and taking it again is a new grant.
        e2 = locks.try_lock_batch("g", [MQ], "A")[MQ]
        assert e2 > e1
        assert commit(brokers, "A", e2, 0, 0)[0] == b"OK"
    finally:
        brokers.close()


def test_grants_within_one_millisecond_still_increase(redis_url: str) -> None:
    """The low part of the epoch counts grants within one ms of Redis's clock."""
    brokers = BrokerRegistry(redis_url)
    try:
        locks = RebalanceLockManager(brokers, 60_000)
        epochs = []
        for client in ("c1", "c2", "c3", "c4"):
            locks.unlock_batch("g", [MQ], locks.lock_entry("g", MQ).owner or "x", force=True)
            epochs.append(locks.try_lock_batch("g", [MQ], client)[MQ])
        assert epochs == sorted(set(epochs))
        # A clock that went back (a primary restarted with its clock behind) never takes epochs back.
        brokers.default.client.hset(keys.sub_state(MQ.tag, "g"), "epoch", epochs[-1] + 10**12)
        locks.unlock_batch("g", [MQ], "c4", force=True)
        assert locks.try_lock_batch("g", [MQ], "c5")[MQ] == epochs[-1] + 10**12 + 1
    finally:
        brokers.close()


# -- WAIT: no listener call under an epoch the replicas do not have ----------------------------------


@pytest.fixture(scope="module")
def deployment() -> Iterator[SentinelDeployment]:
    with SentinelDeployment(replicas=1, sentinels=1) as d:
        yield d


def test_a_run_waits_for_a_replica_to_hold_its_epoch_before_calling_the_listener(
    deployment: SentinelDeployment,
) -> None:
    primary = deployment.primary()
    url = primary.url
    deployment.direct_client(primary).flushall()
    settings = load_settings(redis_url=url, lock_wait_replicas=1, lock_wait_timeout_ms=200)
    p = Producer(settings=settings)
    p.create_topic("t", queues=1)
    eng = ConsumerEngine(settings, "c1")
    seen: list[int] = []
    spec = ListenerSpec(lambda msgs, ctx: seen.extend(m.queue_offset for m in msgs) or S.SUCCESS, "t", "g")
    (replica,) = deployment.replicas()
    try:
        for i in range(3):
            p.send_orderly("t", b"%d" % i, sharding_key="k")
        RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
        deployment.pause(replica)
        try:
            out = request_class(spec)(eng, spec, "g", MQ, "tok0").run()
            # The epoch was granted, but no replica acknowledged it: no listener call, the run is
            # dispatched again later (and keeps its lock).
            assert seen == [] and out.verb.value == "REQUEUE" and out.countdown >= 1.0
            assert state(deployment.direct_client(primary))["owner"] == "c1"
        finally:
            deployment.resume(replica)
        # The replica catches up after SIGCONT; the requeued run is dispatched again (as the
        # Celery task would be) until a WAIT succeeds, then it consumes.
        deployment.wait_replicas_online(1)
        for _ in range(20):
            if out.verb.value != "REQUEUE":
                break
            out = request_class(spec)(eng, spec, "g", MQ, out.token).run()
        assert seen == [0, 1, 2]
        # The replica has the epoch the listener ran under.
        st = state(deployment.direct_client(replica))
        assert st["owner"] == "c1"
    finally:
        p.close()
        eng.brokers.close()


def test_lock_wait_replicas_defaults_to_one_behind_sentinel_and_zero_on_a_plain_redis(
    deployment: SentinelDeployment, redis_url: str,
) -> None:
    from mqorder.store.brokers import Broker
    from mqorder.store.replication import ReplicaWait

    rw = ReplicaWait.from_settings(load_settings(redis_url=redis_url))
    assert rw.wanted(Broker("broker-a", redis_url)) == 0
    assert rw.wanted(Broker("broker-a", deployment.url())) == 1
    assert ReplicaWait(2, 100).wanted(Broker("broker-a", redis_url)) == 2

"""A run's commits after its primary died must not reach the new primary on another connection.

A run reads on the connection it holds (``ConnectionLease``). When the primary dies, a Sentinel
client's pool hands out connections to the promoted replica, which may lack the last messages the
run read. The commit's ``AHEAD`` check compares offsets only: once producers append to the new
primary past the run's ``read_to``, a commit there is accepted, and the new messages at the
offsets the run had read on the old primary are skipped. So every fenced call of a run's own
thread goes on the connection that read: when it broke, the run fails and starts over from the
committed offset on the new primary. Once a bug: a SUSPEND's commit (and the last commit of a run,
and the lease renewal) went through the pool, to the new primary, and committed past messages
nobody had handled (a review's repro through a proxy; here a real replica promoted by hand, and
the client's pool pointed at it as Sentinel's would be).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.testing.embedded import RedisServer, wait_online_replicas
from tests.engine_support import run_in_thread

TOPIC, SUB, ME = "tf", "g", "c1"


@contextmanager
def primary_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A primary and its replica, in sync; both stopped after (the test may stop the primary)."""
    a = RedisServer().start()
    b = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(a.port)]).start()
    try:
        wait_online_replicas(a, 1)
        yield a, b
    finally:
        for srv in (b, a):
            try:
                srv.stop()
            except Exception:  # noqa: BLE001 - a was stopped by the test already
                pass


def test_a_suspend_after_the_primary_died_does_not_commit_on_the_promoted_replica_past_new_messages() -> None:
    with primary_and_replica() as (a, b):
        settings = load_settings(redis_url=a.url, consume_linger_ms=0)
        p = Producer(settings=settings)
        p.create_topic(TOPIC, queues=1)
        mq = MessageQueue(TOPIC, "broker-a", 0)
        ra, rb = redis.Redis(port=a.port), redis.Redis(port=b.port)
        ra.hset(keys.assignment(SUB), mapping={mq.key: ME})
        eng = ConsumerEngine(settings, ME)
        assert RebalanceLockManager(eng.brokers).assign(SUB, [(mq, ME, "t0")])[mq] in ("MOVED", "DISPATCH")
        ra.hset(keys.sub_state(mq.tag, SUB), mapping={"pending": "t0", "pend_until": 2**62})  # as a dispatch
        for n in range(3):
            p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
        assert ra.wait(1, 5000) == 1
        rb.replicaof("no", "one")  # promoted: it misses what comes next
        for n in range(3, 6):
            p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
        pb = Producer(settings=load_settings(redis_url=b.url))
        seen: list[str] = []
        pool = eng.brokers.get(mq.broker_name).client.connection_pool

        def listener(msgs, ctx):
            body = msgs[0].body.decode()
            seen.append(body)
            if body == "m5":
                # The primary dies, producers go on on the promoted replica past offset 5, and the
                # client's pool hands out connections to it (Sentinel's does after a failover).
                a.stop()
                for n in range(3, 7):
                    pb.send_orderly(TOPIC, f"n{n}".encode(), sharding_key="k")
                pool.connection_kwargs["port"] = b.port
                pool.reset()
                return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
            return ConsumeOrderlyStatus.SUCCESS

        spec = ListenerSpec(listener, TOPIC, SUB)
        out = [run_in_thread(eng, spec, SUB, mq, "t0", 60)]
        assert out and out[0] is not None and out[0].verb == "IDLE", out
        assert seen[:6] == [f"m{n}" for n in range(6)], seen
        state = {k.decode(): v.decode() for k, v in rb.hgetall(keys.sub_state(mq.tag, SUB)).items()}
        committed = int(state.get("offset", 0))
        log = [f[b"b"].decode() for _, f in rb.xrange(keys.queue_log(mq.tag))]
        assert log == ["m0", "m1", "m2", "n3", "n4", "n5", "n6"]
        # Whatever the promoted replica has below the committed offset was handled by somebody.
        skipped = [m for m in log[:committed] if m not in seen]
        assert not skipped, f"committed to {committed} on the promoted replica: {skipped} were never handled"
        p.close()
        pb.close()
        eng.brokers.close()



def test_a_pull_consumers_commit_after_a_failover_names_the_message_it_pulled() -> None:
    """The pull consumer's reads and commits go through the pool: after a failover its
    ``update_offset`` reaches the promoted replica, where the offset alone was accepted once
    producers had refilled the offsets it pulled on the old primary. It now names the message it
    pulled at ``offset - 1`` (``update_offset.lua``: CHANGED), and a commit of the same message
    stored again by a producer's retry is still accepted."""
    from mqorder.client.pull_consumer import PullConsumer
    from mqorder.errors import OffsetFencedError

    with primary_and_replica() as (a, b):
        settings = load_settings(redis_url=a.url, heartbeat_interval_ms=200)
        p = Producer(settings=settings)
        p.create_topic(TOPIC, queues=1)
        c = PullConsumer(SUB, settings=settings, client_id="pa")
        (mq,) = c.fetch_message_queues_in_balance(TOPIC)
        for n in range(3):
            p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
        assert redis.Redis(port=a.port).wait(1, 5000) == 1
        rb = redis.Redis(port=b.port)
        rb.replicaof("no", "one")  # promoted: it misses what comes next
        for n in range(3, 6):
            p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
        res = c.pull(mq, 0, 32)
        assert [m.body for m in res.msg_found_list] == [f"m{n}".encode() for n in range(6)]
        a.stop()
        pb = Producer(settings=load_settings(redis_url=b.url))
        for n in range(3, 7):
            pb.send_orderly(TOPIC, f"n{n}".encode(), sharding_key="k")
        pool = c.brokers.get(mq.broker_name).client.connection_pool
        pool.connection_kwargs["port"] = b.port  # as a Sentinel client's pool after the failover
        pool.reset()
        with pytest.raises(OffsetFencedError, match=r"offset 5 is .*, not .*nothing was committed"):
            c.update_offset(mq, res.next_begin_offset)
        assert int(rb.hget(keys.sub_state(mq.tag, SUB), "offset") or 0) == 0
        # What the promoted node holds, pulled there, commits; so does m2, pulled on the old
        # primary and replicated before the failover (the same message at its offset).
        c.update_offset(mq, 3)
        again = c.pull(mq, 3, 32)
        assert [m.body for m in again.msg_found_list] == [b"n3", b"n4", b"n5", b"n6"]
        c.update_offset(mq, again.next_begin_offset)
        assert int(rb.hget(keys.sub_state(mq.tag, SUB), "offset")) == 7
        c.shutdown()
        p.close()
        pb.close()

"""A run's commit must not follow its queue's slot to a promoted replica that lacks what it read.

On a Redis Cluster a run's round trips go through its ``ClusterRoute``, which follows the slot map
and ``MOVED``. After a failover to a replica that missed the last appends, the demoted primary
answers ``MOVED`` (or another thread's refresh already points the map at the promoted node), and
a commit that followed it was accepted there: ``AHEAD`` compares offsets only, so once producers
appended past the run's ``read_to`` on the new primary, the commit skipped the new messages at the
offsets the run had read on the old one. A run pins its queue on its lease now: the queue's slot stays on
the node it first went to, a move is a ``SlotMovedError`` and the run starts over from the
committed offset on the promoted node.

The lag is real, not edited in: the replica is stopped (``SIGSTOP``), its link killed on the
primary, three messages appended to the primary only, then the replica is woken with a
``CLUSTER FAILOVER TAKEOVER`` already waiting in its socket, which it runs before its
replication cron reconnects: it is promoted without m3..m5, as after a crash of the primary.
"""

from __future__ import annotations

import signal
import socket

import pytest
from redis.crc import key_slot

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.cluster_route import ClusterClient, SlotMovedError
from mqorder.store.connect import close, connect
from mqorder.store.raw_pipe import ConnectionLease
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer
from tests.engine_support import run_in_thread
from tests.support import wait_for

TOPIC, SUB, ME = "tcf", "g", "c1"


def _replica_of(cdep: ClusterDeployment, master: RedisServer) -> RedisServer:
    for n in cdep.nodes:
        role = cdep.client(n).execute_command("ROLE")
        if role[0] in (b"slave", "slave") and int(role[2]) == master.port:
            return n
    raise AssertionError(f"no replica of {master.port}")


def test_a_pinned_lease_refuses_a_slot_the_map_moved_and_a_plain_one_follows() -> None:
    """The mechanism alone: the slot map pointed elsewhere between two round trips."""
    with ClusterDeployment(masters=3) as cdep:
        cc = connect(cdep.url())
        assert isinstance(cc, ClusterClient)
        try:
            k = "pin-k"
            slot = key_slot(k.encode())
            home = cc.primary_for(k)
            other = next(n for n in cc.get_primaries() if n.name != home.name)
            pinned, plain = ConnectionLease(cc), ConnectionLease(cc)
            pinned.pin(k)
            try:
                assert pinned.round_trip([("SET", k, "1")]) == [b"OK"]
                assert plain.round_trip([("GET", k)]) == [b"1"]
                cc.nodes_manager.slots_cache[slot] = [other]  # as a refresh after a failover would
                with pytest.raises(SlotMovedError, match=f"slot {slot} moved"):
                    pinned.round_trip([("GET", k)])
                # The plain lease goes where the map says; that node answers MOVED back home.
                assert plain.round_trip([("GET", k)]) == [b"1"]
                # The refusal unpinned the lease: its next round trip (the run's retry) pins anew.
                assert pinned.round_trip([("GET", k)]) == [b"1"]
                # A slot the lease was not asked to pin (a run's ledger, its wake-up stream)
                # follows the map as before: its move loses nothing.
                k2 = next(f"other-{i}" for i in range(1000) if key_slot(f"other-{i}".encode()) != slot)
                slot2 = key_slot(k2.encode())
                assert pinned.round_trip([("SET", k2, "2")]) == [b"OK"]
                away = next(n for n in cc.get_primaries() if n.name != cc.primary_for(k2).name)
                cc.nodes_manager.slots_cache[slot2] = [away]
                assert pinned.round_trip([("GET", k2), ("GET", k)]) == [b"2", b"1"]
            finally:
                pinned.release()
                plain.release()
        finally:
            close(cc)


def test_a_suspend_after_a_cluster_failover_does_not_commit_on_the_promoted_replica_past_new_messages() -> None:
    with ClusterDeployment(masters=3, replicas_per_master=1) as cdep:
        settings = load_settings(redis_url=cdep.url(), consume_linger_ms=0)
        cc = connect(cdep.url())
        p = Producer(settings=settings)
        pb = Producer(settings=settings)
        eng = ConsumerEngine(settings, ME)
        stopped: list[RedisServer] = []
        try:
            p.create_topic(TOPIC, queues=1)
            mq = MessageQueue(TOPIC, "broker-a", 0)
            slot = key_slot(mq.tag.encode())
            a = cdep.master_of_slot(slot)
            b = _replica_of(cdep, a)
            cc.hset(keys.assignment(SUB), mapping={mq.key: ME})
            assert RebalanceLockManager(eng.brokers).assign(SUB, [(mq, ME, "t0")])[mq] in ("MOVED", "DISPATCH")
            cc.hset(keys.sub_state(mq.tag, SUB), mapping={"pending": "t0", "pend_until": 2**62})  # as a dispatch
            for n in range(3):
                p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
            ra = cdep.client(a)
            assert ra.wait(1, 5000) == 1
            # The replica misses what comes next: stopped, its link cut on the primary.
            assert b.proc is not None
            b.proc.send_signal(signal.SIGSTOP)
            stopped.append(b)
            ra.execute_command("CLIENT", "KILL", "TYPE", "replica")
            for n in range(3, 6):
                p.send_orderly(TOPIC, f"m{n}".encode(), sharding_key="k")
            takeover = socket.create_connection(("127.0.0.1", b.port), timeout=10)
            seen: list[str] = []

            def listener(msgs, ctx):
                body = msgs[0].body.decode()
                seen.append(body)
                if body == "m5":
                    # Promote the lagging replica: the command waits in its socket, run first on wake.
                    takeover.sendall(b"CLUSTER FAILOVER TAKEOVER\r\n")
                    b.proc.send_signal(signal.SIGCONT)
                    stopped.remove(b)
                    assert takeover.recv(64).startswith(b"+OK")
                    wait_for(lambda: cdep.role(a) == "slave" and cdep.role(b) == "master", 20, what="the takeover")
                    for n in range(3, 7):  # producers go on on the promoted node
                        pb.send_orderly(TOPIC, f"n{n}".encode(), sharding_key="k")
                    return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
                return ConsumeOrderlyStatus.SUCCESS

            spec = ListenerSpec(listener, TOPIC, SUB)
            out = [run_in_thread(eng, spec, SUB, mq, "t0", 90)]
            assert seen[:6] == [f"m{n}" for n in range(6)], seen
            rb = cdep.client(b)
            log = [f[b"b"].decode() for _, f in rb.xrange(keys.queue_log(mq.tag))]
            assert log == ["m0", "m1", "m2", "n3", "n4", "n5", "n6"], "the replica did not lag as staged"
            committed = int(rb.hget(keys.sub_state(mq.tag, SUB), "offset") or 0)
            # Whatever the promoted node has below the committed offset was handled by somebody.
            skipped = [m for m in log[:committed] if m not in seen]
            assert not skipped, f"committed to {committed} on the promoted node: {skipped} were never handled"
            # The run started over on the promoted node and drained it (before: REQUEUE, the
            # SUSPEND's commit accepted there at offset 5).
            assert out and out[0] is not None and out[0].verb == "IDLE", out
            assert committed == len(log)
            takeover.close()
        finally:
            for srv in stopped:
                if srv.proc is not None:
                    srv.proc.send_signal(signal.SIGCONT)
            p.close()
            pb.close()
            eng.brokers.close()
            close(cc)

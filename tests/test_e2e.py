"""End to end: real redis-server, real ``celery worker`` subprocesses (prefork), real listeners.

Every assertion is computed from the ledger the listeners in ``tests/listeners.py`` append to.
Tests taking ``broker_cluster`` run twice: with Celery's broker on the store's Redis and on
RabbitMQ (a vhost of the test's own).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import redis
from celery.utils.nodenames import worker_direct

from mqorder import Producer, keys
from mqorder.model import MessageQueue
from mqorder.store.log import MessageLog
from tests.support import Cluster, body, check_order, ledger, wait_for

pytestmark = pytest.mark.e2e


def _handled(r: redis.Redis, group: str, n: int) -> bool:
    return len({(e["key"], e["seq"]) for e in ledger(r, group) if e["ok"]}) >= n


def test_two_workers_eight_queues_2000_keys_every_key_in_order_none_lost(broker_cluster: Cluster, r: redis.Redis) -> None:
    cluster = broker_cluster
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=8)
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    keys_ = [f"order-{i}" for i in range(2000)]
    for seq in range(1, 5):  # interleaved: step 1 of every key, then step 2...
        p.send_orderly_batch("t-order", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: _handled(r, "g-order", 8000), timeout=120, what="8000 messages handled")
    entries = ledger(r, "g-order")
    violations, handled, dups = check_order(entries)
    assert violations == []
    assert handled == 8000
    assert {e["client"] for e in entries} == {cluster.workers["w1"].hostname, cluster.workers["w2"].hostname}
    if cluster.rabbit is not None:  # the ConsumeRequests really went through RabbitMQ's direct queues
        direct = {worker_direct(w.hostname).name for w in cluster.workers.values()}
        assert direct <= set(cluster.rabbit.queues())
        assert r.keys("_kombu.binding.*") == []  # and none of Celery's queues lives in the store's Redis
    log = MessageLog(p.brokers)
    assert sum(log.lag("g-order", mq) for mq in p.describe_topic("t-order").message_queues) == 0


def _calls(entries: list[dict]) -> dict[int, list[tuple[int, int, str]]]:
    """Listener calls per queue: (start, end, who), one per call (a batch shares start/end)."""
    calls: dict[int, set[tuple[int, int, str]]] = defaultdict(set)
    for e in entries:
        calls[e["queue"]].add((e["start"], e["end"], f"{e['client']}/{e['pid']}"))
    return {q: sorted(c) for q, c in calls.items()}


def test_no_two_listener_calls_of_one_queue_overlap_on_prefork_c4(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-excl", queues=4)
    r.hset("ctl:g-excl", "sleep_ms", 3)
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    items = [(f"k{i % 40}", body(f"k{i % 40}", i // 40 + 1)) for i in range(800)]
    p.send_orderly_batch("t-excl", items)
    wait_for(lambda: _handled(r, "g-excl", 800), timeout=120, what="800 handled")
    entries = ledger(r, "g-excl")
    assert check_order(entries)[0] == []
    per_queue = _calls(entries)
    assert len(per_queue) == 4
    processes = set()
    for q, calls in per_queue.items():
        for (_, e1, w1), (s2, _, w2) in zip(calls, calls[1:], strict=False):
            assert s2 >= e1, f"queue {q}: call by {w2} started at {s2} before the call by {w1} ended at {e1}"
        processes.update(w for _, _, w in calls)
    assert len(processes) >= 3  # the calls really were spread over several pool processes


def test_suspended_message_is_retried_after_countdown_then_dlq_and_queue_moves_on(broker_cluster: Cluster, r: redis.Redis) -> None:
    cluster = broker_cluster
    p = Producer(cluster.url)
    p.create_topic("t-suspend", queues=1)
    r.hset("ctl:g-suspend", mapping={"suspend:a:2": 2, "suspend:b:1": 99})
    cluster.start_worker("w1")
    for k, seq in [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1)]:
        p.send_orderly("t-suspend", body(k, seq), sharding_key="same-queue", keys=[f"{k}{seq}"])
    wait_for(lambda: any(e["key"] == "c" and e["ok"] for e in ledger(r, "g-suspend")), timeout=60, what="c handled")
    entries = ledger(r, "g-suspend")
    seq = [(e["key"], e["seq"], e["reconsume"], e["ok"]) for e in entries]
    assert seq == [
        ("a", 1, 0, True),
        ("a", 2, 0, False), ("a", 2, 1, False), ("a", 2, 2, True),  # suspended twice, then success
        ("a", 3, 0, True),
        ("b", 1, 0, False), ("b", 1, 1, False), ("b", 1, 2, False),  # 1 + max_reconsume_times(2)
        ("c", 1, 0, True),
    ]
    a2 = [e for e in entries if (e["key"], e["seq"]) == ("a", 2)]
    gaps = [(y["start"] - x["end"]) / 1e6 for x, y in zip(a2, a2[1:], strict=False)]
    assert all(g >= 0.25 for g in gaps), gaps  # suspend_current_queue_time_millis=300
    dlq = MessageLog(p.brokers).read(MessageQueue(keys.dlq_topic("g-suspend"), "broker-a", 0), 0, 10)
    assert [m.keys for m in dlq] == [["b1"]]
    assert "max reconsume" in dlq[0].properties["DLQ_REASON"]


def test_undecodable_stored_message_goes_to_dlq_and_does_not_block_its_queue(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=1)
    mq = MessageQueue("t-order", "broker-a", 0)
    p.send_orderly("t-order", body("x", 1), sharding_key="x")
    r.xadd(keys.queue_log(mq.tag), {"h": b"\x00garbage", "b": b""}, id="1-1")
    r.incr(keys.queue_next(mq.tag))
    p.send_orderly("t-order", body("x", 2), sharding_key="x")
    cluster.start_worker("w1")
    wait_for(lambda: _handled(r, "g-order", 2), timeout=60, what="both good messages handled")
    dlq = MessageLog(p.brokers).read(MessageQueue(keys.dlq_topic("g-order"), "broker-a", 0), 0, 10)
    assert len(dlq) == 1 and dlq[0].properties["ORIGIN_QUEUE_OFFSET"] == "1"
    assert "undecodable" in dlq[0].properties["DLQ_REASON"]


def test_worker_joining_and_leaving_mid_stream_keeps_order_and_loses_nothing(broker_cluster: Cluster, r: redis.Redis) -> None:
    cluster = broker_cluster
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=8)
    r.hset("ctl:g-order", "sleep_ms", 1)
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    n_keys, min_steps = 300, 10
    stop = threading.Event()
    steps = [0]

    def produce() -> None:
        # Messages keep coming until the join and the leave are both behind us, however long a
        # worker takes to start on a loaded machine.
        prod = Producer(cluster.url)
        while not stop.is_set() or steps[0] < min_steps:
            seq = steps[0] + 1
            prod.send_orderly_batch("t-order", [(f"k{i}", body(f"k{i}", seq)) for i in range(n_keys)])
            steps[0] = seq
            time.sleep(0.4)
        prod.close()

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(1.0)
    cluster.start_worker("w3")  # joins mid-stream
    time.sleep(1.5)
    cluster.workers["w1"].stop(timeout=60)  # graceful leave while messages keep coming
    time.sleep(1.0)
    stop.set()
    t.join()
    total = n_keys * steps[0]
    wait_for(lambda: _handled(r, "g-order", total), timeout=120, what=f"{total} handled")
    entries = ledger(r, "g-order")
    violations, handled, _ = check_order(entries)
    assert violations == []
    assert handled == total
    clients = {e["client"] for e in entries}
    assert cluster.workers["w3"].hostname in clients  # the newcomer got queues
    assert cluster.workers["w1"].hostname in clients  # the leaver consumed before leaving


def _owned_by(r: redis.Redis, mqs: list[MessageQueue], group: str, client: str) -> set[int]:
    return {mq.queue_id for mq in mqs if (r.hget(keys.sub_state(mq.tag, group), "owner") or b"").decode() == client}


def test_kill_9_of_a_queue_owner_fails_over_in_order_and_the_restarted_worker_rejoins(
    broker_cluster: Cluster, r: redis.Redis
) -> None:
    """``kill -9`` of a worker (its pool too) mid-stream: no clean leave, whatever it had fetched
    from Celery's broker is lost (Redis) or back in its direct queue (RabbitMQ). Its queues move
    to the survivor within seconds; restarted under the same name, it gets its stale
    ConsumeRequests (RabbitMQ) and queues again; every key stays in order and nothing is lost."""
    cluster = broker_cluster
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=8)
    mqs = p.describe_topic("t-order").message_queues
    r.hset("ctl:g-order", "sleep_ms", 1)
    w1 = cluster.start_worker("w1")
    w2 = cluster.start_worker("w2")
    n_keys, min_steps = 200, 12
    stop = threading.Event()
    steps = [0]

    def produce() -> None:
        prod = Producer(cluster.url)
        while not stop.is_set() or steps[0] < min_steps:
            seq = steps[0] + 1
            prod.send_orderly_batch("t-order", [(f"k{i}", body(f"k{i}", seq)) for i in range(n_keys)])
            steps[0] = seq
            time.sleep(0.3)
        prod.close()

    t = threading.Thread(target=produce)
    t.start()
    try:
        victims = wait_for(lambda: _owned_by(r, mqs, "g-order", w1.hostname), timeout=30, what="w1 owns queues")
        wait_for(lambda: any(e["client"] == w1.hostname for e in ledger(r, "g-order")), timeout=30,
                 what="w1 consuming")
        killed_us = time.time_ns() // 1000
        w1.kill()

        def taken_over() -> dict[int, int]:
            first: dict[int, int] = {}
            for e in ledger(r, "g-order"):
                if e["client"] == w2.hostname and e["queue"] in victims and e["start"] > killed_us:
                    first.setdefault(e["queue"], e["start"])
            return first if set(first) == victims else {}

        first = wait_for(taken_over, timeout=30, what=f"w2 consuming w1's queues {sorted(victims)}")
        failover_s = (max(first.values()) - killed_us) / 1e6
        # heartbeat_timeout_ms (3 s) + one heartbeat + a rebalance; a lost task would cost a sweep.
        assert failover_s < 10, f"failover took {failover_s:.1f}s"
        restarted_us = time.time_ns() // 1000
        cluster.start_worker("w1")  # same name: same direct queue, stale requests in it on RabbitMQ
        wait_for(lambda: any(e["client"] == w1.hostname and e["start"] > restarted_us
                             for e in ledger(r, "g-order")), timeout=30, what="the restarted w1 consuming")
    finally:
        stop.set()
        t.join()
    total = n_keys * steps[0]
    wait_for(lambda: _handled(r, "g-order", total), timeout=120, what=f"{total} handled")
    violations, handled, _ = check_order(ledger(r, "g-order"))
    assert violations == []
    assert handled == total
    log = MessageLog(p.brokers)
    assert sum(log.lag("g-order", mq) for mq in mqs) == 0
    p.close()


def test_a_worker_killed_holding_the_rebalance_mutex_delays_failover_only_until_the_mutex_lapses(
    cluster: Cluster, r: redis.Redis
) -> None:
    """The rebalance mutex is held as by a worker killed mid-rebalance (it lapses 7 s later), and
    w1 is killed: w2's rebalance is skipped while the mutex is held, owed, and tried again at its
    next heartbeats, so w1's queues move within seconds of the lapse, not at the next scheduled
    rebalance (once a bug: a skipped rebalance counted as done, and failover waited for beat or the
    stale-rebalance timer, 2 x 20 s; seen as a kill -9 test timing out under load)."""
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4)
    mqs = p.describe_topic("t-order").message_queues
    w1 = cluster.start_worker("w1")
    w2 = cluster.start_worker("w2")
    victims = wait_for(lambda: _owned_by(r, mqs, "g-order", w1.hostname), timeout=30, what="w1 owns queues")
    r.set(keys.rebalance_mutex(), "a-dead-holder", px=7000)
    w1.kill()
    t0 = time.monotonic()
    wait_for(lambda: _owned_by(r, mqs, "g-order", w2.hostname) >= victims, timeout=20,
             what=f"w2 holding w1's queues {sorted(victims)}")
    took = time.monotonic() - t0
    assert took >= 6.0  # not before the mutex lapsed: the skip really happened
    assert "rebalance skipped" in (cluster.tmp / "w2.log").read_text()


def test_broadcast_group_delivers_every_message_to_every_worker_in_order(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-bcast", queues=2)
    w1 = cluster.start_worker("w1")
    w2 = cluster.start_worker("w2")
    for seq in range(1, 21):
        p.send_orderly_batch("t-bcast", [(f"k{i}", body(f"k{i}", seq)) for i in range(10)])

    def per_client() -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = defaultdict(list)
        for e in ledger(r, "g-bcast"):
            out[e["client"]].append(e)
        return out

    wait_for(lambda: all(check_order(per_client().get(w.hostname, []))[1] == 200 for w in (w1, w2)),
             timeout=60, what="both clients handled all 200")
    for w in (w1, w2):
        violations, handled, _ = check_order(per_client()[w.hostname])
        assert violations == [] and handled == 200


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_pool_serves_a_trickle_from_lingering_requests_and_stops_promptly(
    cluster: Cluster, r: redis.Redis, pool: str
) -> None:
    """Stock linger: a steady trickle is handled in order by requests that stay on their queues
    (far fewer Celery tasks than messages; in prefork the children learn that no request waits
    from the main process's capacity signal), and a warm shutdown does not wait for a lingering
    request's linger to run out."""
    from celery import Celery

    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4)
    # A long linger, so that a shutdown which waited for lingering requests would show.
    w = cluster.start_worker("w1", pool=pool, concurrency=4, MQORDER_CONSUME_LINGER_MS="8000")
    keys_ = [f"trickle-{i}" for i in range(20)]
    sent = 0
    for seq in range(1, 16):  # 300 messages at ~100 msg/s, over 4 queues
        for k in keys_:
            p.send_orderly("t-order", body(k, seq), sharding_key=k)
            sent += 1
            time.sleep(0.01)
    wait_for(lambda: _handled(r, "g-order", sent), timeout=60, what=f"{sent} handled")
    violations, handled, _ = check_order(ledger(r, "g-order"))
    assert violations == [] and handled == sent
    app = Celery("t-ctl", broker=cluster.url)
    try:
        stats = app.control.inspect(destination=[w.hostname], timeout=3.0).stats() or {}
    finally:
        app.close()
    tasks = stats[w.hostname]["total"].get("mqorder.consume_request", 0)
    assert 1 <= tasks < sent / 5, f"{tasks} consume_request tasks for {sent} messages"
    p.send_orderly("t-order", body("last", 1), sharding_key="last")  # a request is lingering now
    time.sleep(0.2)
    t0 = time.monotonic()
    w.stop(timeout=30)
    took = time.monotonic() - t0
    assert not w.alive() and took < 6.5, f"warm shutdown took {took:.1f}s with 8 s lingers"


def test_a_topic_created_while_workers_run_is_consumed_within_seconds_without_beat(
    cluster: Cluster, r: redis.Redis
) -> None:
    cluster.start_worker("w1")  # subscribes g-late to t-late, which does not exist yet
    p = Producer(cluster.url)
    p.create_topic("t-late", queues=4)
    t0 = time.monotonic()
    p.send_orderly("t-late", body("k", 1), sharding_key="k")
    # No beat runs here, and a worker's own fallback rebalance waits 40 s: only the topology
    # version bumped by create_topic can make this quick.
    wait_for(lambda: _handled(r, "g-late", 1), timeout=5, interval=0.05, what="first message of a new topic")
    assert time.monotonic() - t0 < 5
    p.close()


def test_a_write_only_topic_is_held_and_consumed_once_opened_for_reading(cluster: Cluster, r: redis.Redis) -> None:
    cluster.start_worker("w1")
    p = Producer(cluster.url)
    p.create_topic("t-late", queues=2, perm="w")  # RocketMQ's PERM_WRITE only: fill, do not consume
    p.send_orderly("t-late", body("k", 1), sharding_key="k")
    time.sleep(3)  # several heartbeats: the topology change was seen, and nobody took the queues
    assert not _handled(r, "g-late", 1)
    assert all(not r.hget(keys.sub_state(mq.tag, "g-late"), "owner") for mq in p.describe_topic("t-late").message_queues)
    p.topics.update_perm("t-late", "rw")
    wait_for(lambda: _handled(r, "g-late", 1), timeout=5, interval=0.05, what="the held message once readable")
    p.close()


def test_kill_9_of_a_pool_child_mid_run_moves_its_queue_on_in_seconds_not_the_run_lease(
    cluster: Cluster, r: redis.Redis
) -> None:
    """A Celery operator's walk-through: ``kill -9`` of one prefork child (the OOM killer, or
    ``celery control terminate``) left its queue marked running until the run lease (60 s) ran
    out. The worker's main process now ends the dead execution's run (``abandon.lua``) and sweeps:
    the queue goes on within seconds, in order, nothing lost."""
    import os
    import signal

    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    r.hset("ctl:g-order", "sleep_ms", 150)  # a run is always mid-call
    cluster.start_worker("w1", concurrency=2)
    n = 60
    p.send_orderly_batch("t-order", [("k", body("k", s)) for s in range(1, n + 1)])
    first = wait_for(lambda: [e for e in ledger(r, "g-order") if e["ok"]], timeout=30, what="the key consuming")
    victim = first[0]["pid"]
    killed_us = time.time_ns() // 1000
    os.kill(int(victim), signal.SIGKILL)
    resumed = wait_for(lambda: [e for e in ledger(r, "g-order") if e["start"] > killed_us and e["pid"] != victim],
                       timeout=60, what="the key consuming again after its child was killed")
    took_s = (resumed[0]["start"] - killed_us) / 1e6
    assert took_s < 15, f"the queue waited {took_s:.1f} s after its pool child died (run lease: 60 s)"
    wait_for(lambda: _handled(r, "g-order", n), timeout=60, what=f"{n} handled")
    violations, handled, _ = check_order(ledger(r, "g-order"))
    assert violations == [] and handled == n
    assert "died mid-run (its pool process was lost); ended its run" in cluster.workers["w1"].logfile.read_text()
    p.close()


def test_a_run_past_its_hard_time_limit_frees_its_queue_at_once(cluster: Cluster, r: redis.Redis) -> None:
    """Celery kills the pool process of a task past its hard time limit (``--time-limit``): the
    run it left ended at once (``lost_runs``), where its queue waited out the 60 s run lease."""
    from mqorder.testing.launcher import WorkerProcess
    from tests.support import ROOT

    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    r.hset("ctl:g-order", "sleep_ms", 3000)  # every call outlives the 2 s limit
    w = WorkerProcess("tl1", env=cluster.env(), concurrency=2, logfile=cluster.tmp / "tl1.log", cwd=ROOT,
                      loglevel="INFO", extra_args=["--time-limit=2"])
    cluster.workers["tl1"] = w
    w.start()
    w.wait_registered(cluster.client, timeout=60)
    p.send_orderly_batch("t-order", [("k", body("k", 1))])
    wait_for(lambda: "died mid-run" in (cluster.tmp / "tl1.log").read_text(), timeout=30,
             what="a run killed by the hard time limit ended at once")
    released = time.monotonic()
    r.hset("ctl:g-order", "sleep_ms", 0)
    wait_for(lambda: _handled(r, "g-order", 1), timeout=40, what="the message handled once calls are quick")
    took = time.monotonic() - released
    assert took < 15, f"the queue waited {took:.1f} s after its run was killed (run lease: 60 s)"
    p.close()


@pytest.mark.parametrize("group,topic", [("g-order", "t-order"), ("g-keys", "t-keys")])
def test_a_listener_call_longer_than_the_run_lease_keeps_its_queue(cluster: Cluster, r: redis.Redis,
                                                                    group: str, topic: str) -> None:
    """A call that outlives ``run_lease_ms`` (60 s by default; 1.5 s here) used to let the run mark
    lapse under it: the sweep dispatched a second ConsumeRequest, which ran the same message beside
    the first call under a new epoch, and the first call's commit was refused, round after round
    (a config walk-through: 20 calls of offsets 0 and 1, 7 of them overlapping, nothing committed).
    The process renews the run's lease while its call runs (``LeaseKeeper``)."""
    p = Producer(cluster.url)
    p.create_topic(topic, queues=1)
    r.hset(f"ctl:{group}", "sleep_ms", 4000)
    cluster.start_worker("w1", MQORDER_RUN_LEASE_MS="1500", MQORDER_CONSUME_LINGER_MS="500")
    p.send_orderly_batch(topic, [("k", body("k", s)) for s in (1, 2, 3)])
    wait_for(lambda: _handled(r, group, 3), timeout=60, what="3 handled")
    time.sleep(2)  # a second call of a message would start within a sweep or two
    entries = ledger(r, group)
    assert check_order(entries)[0] == []
    assert [e["seq"] for e in entries] == [1, 2, 3], entries
    calls = sorted((e["start"], e["end"]) for e in entries)
    for (_, e1), (s2, _) in zip(calls, calls[1:], strict=False):
        assert s2 >= e1, f"a call started at {s2} before the one before it ended at {e1}"
    assert len({e["epoch"] for e in entries}) == 1


@pytest.mark.parametrize("group,topic", [("g-order", "t-order"), ("g-keys", "t-keys")])
def test_a_lagging_group_gives_its_pool_slot_to_another_groups_queue(cluster: Cluster, r: redis.Redis,
                                                                    group: str, topic: str) -> None:
    """Pool slots are shared by every group of a worker. A run with a backlog kept its slot for the
    whole 60 s budget, so a lagging group held the worker and another group's queue waited (an
    operator walk-through: 3 minutes, and with time retention 25,594 messages trimmed unread). It
    now re-queues itself behind a waiting request after ``consume_yield_after_ms`` (1 s)."""
    p = Producer(cluster.url)
    p.create_topic(topic, queues=1)
    p.create_topic("t-excl", queues=1)
    r.hset(f"ctl:{group}", "sleep_ms", 20)
    cluster.start_worker("w1", concurrency=1)
    p.send_orderly_batch(topic, [("k", body("k", s)) for s in range(1, 1001)])  # ~20 s of calls (one key)
    wait_for(lambda: len(ledger(r, group)) >= 20, timeout=30, what="the backlog's run under way")
    t0 = time.monotonic()
    p.send_orderly("t-excl", body("x", 1), sharding_key="x")
    wait_for(lambda: _handled(r, "g-excl", 1), timeout=40, what="the other group's message")
    waited = time.monotonic() - t0
    assert waited < 5, f"the other group's message waited {waited:.1f} s for the worker's only slot"
    assert check_order(ledger(r, group))[0] == []


def test_a_new_group_with_consume_from_last_offset_starts_at_the_end_and_resumes(cluster: Cluster, r: redis.Redis) -> None:
    """RocketMQ's default for a new group: only what is sent once it registers. A restart resumes
    where it stopped (what was sent while it was down is consumed), never at the end again."""
    p = Producer(cluster.url)
    p.create_topic("t-from-end", queues=4)
    ks = [f"k{i}" for i in range(8)]
    p.send_orderly_batch("t-from-end", [(k, body(k, 1)) for k in ks])  # before the group exists
    w = cluster.start_worker("w1")
    p.send_orderly_batch("t-from-end", [(k, body(k, s)) for s in (2, 3) for k in ks])
    wait_for(lambda: _handled(r, "g-from-end", 16), timeout=60, what="16 handled")
    w.stop(timeout=30)
    p.send_orderly_batch("t-from-end", [(k, body(k, 4)) for k in ks])  # while it is down
    cluster.start_worker("w1b")
    wait_for(lambda: _handled(r, "g-from-end", 24), timeout=60, what="24 handled")
    entries = [e for e in ledger(r, "g-from-end") if e["ok"]]
    for k in ks:
        assert [e["seq"] for e in entries if e["key"] == k] == [2, 3, 4], k


def test_consume_from_where_takes_rocketmq_names_and_refuses_others() -> None:
    from mqorder import ConsumeFromWhere, orderly_listener
    from mqorder.errors import ListenerError

    assert ConsumeFromWhere.parse("consume_from_first_offset") is ConsumeFromWhere.FIRST_OFFSET
    assert ConsumeFromWhere.parse("LAST_OFFSET") is ConsumeFromWhere.LAST_OFFSET
    with pytest.raises(ListenerError, match="consume_from_where must be one of 'first_offset', 'last_offset'"):
        orderly_listener(topic="t", group="g-bad-where", consume_from_where="middle")

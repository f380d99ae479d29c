"""The admin commands against real ``celery worker`` subprocesses (prefork and threads pools) on a
real redis-server: what ``status`` and ``consumers`` show of a live group, a stuck queue found and
cleared, a DLQ replayed through the workers, and a forced offset reset under a running owner.

Every delivery is read from the ledger the listeners of ``tests/listeners.py`` append to."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner, Result

from mqorder import Producer, keys
from mqorder.cli import app
from mqorder.model import MessageQueue
from tests.support import Cluster, body, ledger, wait_for
from tests.test_metrics import free_port

pytestmark = pytest.mark.e2e


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def cli_json(*args: str) -> Any:
    res = cli(*args, "--json")
    assert res.exit_code == 0, res.stderr + res.stdout
    return json.loads(res.stdout)


def ok_entries(r: redis.Redis, group: str) -> list[dict]:
    return [e for e in ledger(r, group) if e["ok"]]


def test_status_and_consumers_of_a_live_group_and_a_stuck_queue_found_then_cleared(
    cluster: Cluster, r: redis.Redis
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4)
    w1 = cluster.start_worker("w1", concurrency=2)
    w2 = cluster.start_worker("w2", pool="threads", concurrency=3)
    p.send_orderly_batch("t-order", [(f"k{i % 20}", body(f"k{i % 20}", i // 20 + 1)) for i in range(200)])
    wait_for(lambda: len(ok_entries(r, "g-order")) >= 200, timeout=60, what="200 handled")

    def fresh() -> dict[str, Any] | None:
        """The consumers while every heartbeat is under 3 s old (one every second): a worker
        starved of CPU for a moment (the suite's load once made it 3.2 s) is asked again."""
        got = cli_json("consumers", "g-order")
        return got if all(0 <= c["heartbeat_age_ms"] < 3000 for c in got["consumers"]) else None

    gc = wait_for(fresh, timeout=30, what="heartbeats under 3 s old")
    by_id = {c["client_id"]: c for c in gc["consumers"]}
    assert gc["live"] == 2 and set(by_id) == {w1.hostname, w2.hostname}
    assert (by_id[w1.hostname]["pool"], by_id[w1.hostname]["concurrency"]) == ("prefork", 2)
    assert (by_id[w2.hostname]["pool"], by_id[w2.hostname]["concurrency"]) == ("threads", 3)
    assert all(c["pid"] for c in gc["consumers"])
    assigned = sorted(q for c in gc["consumers"] for q in c["assigned"])
    assert assigned == [f"t-order:broker-a:{i}" for i in range(4)]
    assert all(len(c["assigned"]) == 2 for c in gc["consumers"])
    assert sum(c["locks_held"] for c in gc["consumers"]) == 4

    st = cli_json("status", "g-order", "t-order")
    assert st["lag"] == 0 and st["stuck"] == 0 and sum(q["max_offset"] for q in st["queues"]) == 200
    owners = {f"t-order:broker-a:{q['queue_id']}": q["owner"] for q in st["queues"]}
    assert owners == {q: c["client_id"] for c in gc["consumers"] for q in c["assigned"]}
    assert all(q["epoch"] >= 1 and q["commit_ms"] for q in st["queues"] if q["max_offset"])

    # A message whose listener keeps suspending (every 1 s, up to 16 times): its queue is stuck.
    r.hset("ctl:g-order", "suspend:stuck:1", 1000)
    sent = p.send_orderly("t-order", body("stuck", 1), sharding_key="stuck")
    stuck_q = sent.message_queue.queue_id
    wait_for(lambda: cli("status", "g-order", "--stuck-after", "2", "--check").exit_code == 1, timeout=20,
             what="the suspending queue reported stuck")
    st = cli_json("status", "g-order", "--stuck-after", "2")
    stuck = [q for q in st["queues"] if q["stuck"]]
    assert [q["queue_id"] for q in stuck] == [stuck_q]
    assert stuck[0]["lag"] == 1 and stuck[0]["head_reconsume"] >= 1 and stuck[0]["owner"]
    human = cli("status", "g-order", "--stuck-after", "2")
    assert f"STUCK: t-order:broker-a:{stuck_q}" in human.stdout
    r.hdel("ctl:g-order", "suspend:stuck:1")  # the operator fixes the cause: the next retry succeeds
    wait_for(lambda: cli("status", "g-order", "--stuck-after", "2", "--check").exit_code == 0, timeout=20,
             what="the queue moving again")
    assert cli_json("status", "g-order")["lag"] == 0


def test_dlq_replay_through_live_workers_redelivers_in_original_order_once(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-suspend", queues=2)
    # g-suspend dead-letters after 2 reconsumes (300 ms apart): a:1 and a:2 die, a:3 passes.
    r.hset("ctl:g-suspend", mapping={"suspend:a:1": 99, "suspend:a:2": 99})
    cluster.start_worker("w1")
    for seq in (1, 2, 3):
        p.send_orderly("t-suspend", body("a", seq), sharding_key="a", keys="a")
    wait_for(lambda: any(e["seq"] == 3 for e in ok_entries(r, "g-suspend")), timeout=30, what="a:3 handled")
    page = cli_json("dlq", "list", "g-suspend")
    assert page["total"] == 2
    assert [(m["origin_offset"], m["keys"], m["reconsume_times"]) for m in page["messages"]] == [
        (0, ["a"], 2), (1, ["a"], 2)]
    assert all("max reconsume times 2" in m["reason"] for m in page["messages"])

    r.delete("ctl:g-suspend")  # fixed: the listener accepts them now
    before = len(ok_entries(r, "g-suspend"))
    res = cli("dlq", "replay", "g-suspend")
    assert res.exit_code == 0 and "replayed 2 of 2" in res.stdout
    wait_for(lambda: len(ok_entries(r, "g-suspend")) >= before + 2, timeout=30, what="the replayed pair handled")
    replayed = ok_entries(r, "g-suspend")[before:]
    assert [(e["key"], e["seq"], e["offset"]) for e in replayed] == [("a", 1, 3), ("a", 2, 4)]

    again = cli_json("dlq", "replay", "g-suspend")
    assert (again["stored"], again["duplicates"]) == (0, 2)
    mq = MessageQueue("t-suspend", "broker-a", replayed[0]["queue"])
    assert int(r.get(keys.queue_next(mq.tag))) == 5
    st = cli_json("status", "g-suspend", "t-suspend")
    assert st["lag"] == 0 and len(ok_entries(r, "g-suspend")) == before + 2


def refused_fenced(port: int) -> float:
    import urllib.request

    raw = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(raw) for s in f.samples
               if s.name == "mqorder_commits_refused_total" and s.labels.get("reason") == "FENCED")


def test_forced_offset_reset_fences_the_running_owner_and_consumption_restarts_from_the_new_offset(
    cluster: Cluster, r: redis.Redis
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=1)
    port = free_port()
    w1 = cluster.start_worker("w1", MQORDER_METRICS_PORT=str(port))
    mq = MessageQueue("t-order", "broker-a", 0)
    state = keys.sub_state(mq.tag, "g-order")
    for seq in (1, 2, 3):
        p.send_orderly("t-order", body("a", seq), sharding_key="a")
    wait_for(lambda: int(r.hget(state, "offset") or 0) == 3, timeout=30, what="offsets 0..2 committed")

    refused = cli("offsets", "reset", "g-order", "t-order", "--to", "1")
    assert refused.exit_code == 1 and f"are live ({w1.hostname})" in refused.stderr
    assert int(r.hget(state, "offset")) == 3  # nothing changed

    r.hset("ctl:g-order", "sleep_ms", 500)
    p.send_orderly_batch("t-order", [("a", body("a", seq)) for seq in range(4, 10)])  # offsets 3..8
    wait_for(lambda: any(e["offset"] == 4 for e in ledger(r, "g-order")), timeout=30, what="offset 4 handled")
    epoch_before = int(r.hget(state, "epoch"))
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(int(r.hget(state, "offset") or 0))
            stop.wait(0.01)

    reply = cli_json("offsets", "reset", "g-order", "t-order", "--to", "1", "--force")
    sampler = threading.Thread(target=sample)
    sampler.start()
    r.hset("ctl:g-order", "sleep_ms", 0)
    row = reply["queues"][0]
    assert (row["new_offset"], row["owner"]) == (1, w1.hostname) and row["epoch"] > epoch_before
    try:
        wait_for(lambda: any(e["offset"] == 8 and e["epoch"] > row["epoch"] for e in ledger(r, "g-order")),
                 timeout=30, what="the redelivery from offset 1 reaching offset 8")
        wait_for(lambda: int(r.hget(state, "offset")) == 9, timeout=10, what="offset 9 committed")
    finally:
        stop.set()
        sampler.join()
    after = [e for e in ledger(r, "g-order") if e["epoch"] > row["epoch"]]
    # Consumption restarted from the new offset, in order, under a newer epoch ...
    assert [e["offset"] for e in after] == list(range(1, 9)) and all(e["ok"] for e in after)
    # ... and the stale run's commit of its old progress never landed: the committed offset went
    # from 1 up to 9, never past what the new run had handled.
    assert samples[0] >= 1 and samples == sorted(samples) and samples[-1] <= 9
    wait_for(lambda: refused_fenced(port) >= 1, timeout=10, what="the stale run's refused commit counted")
    st = cli_json("status", "g-order", "t-order")
    assert st["queues"][0]["committed"] == 9 and st["queues"][0]["owner"] == w1.hostname

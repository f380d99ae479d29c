"""Prometheus metrics, scraped over HTTP from real workers (prefork, 2 processes) and from the
cluster exporter, and parsed with ``prometheus_client.parser``: every figure is compared with what
the listeners recorded in their ledger or with what the test sent."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from mqorder import Producer, keys
from mqorder.consumer.hooks import global_hooks
from mqorder.errors import ConfigError
from mqorder.metrics import names
from mqorder.metrics import worker as worker_metrics
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.topics import TopicManager
from tests.support import ROOT, Cluster, body, ledger, wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> Samples:
    raw = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(raw)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls), _ in samples.items() if n == name]


def ok_calls(r: redis.Redis, group: str, client: str | None = None) -> int:
    return sum(1 for e in ledger(r, group) if e["ok"] and (client is None or e["client"] == client))


def worker_with_metrics(cluster: Cluster, name: str, pool: str = "prefork", **extra: str) -> int:
    port = free_port()
    cluster.start_worker(name, pool=pool, MQORDER_METRICS_PORT=str(port), **extra)
    wait_for(lambda: _answers(port), timeout=30, what=f"{name}'s metrics endpoint")
    return port


def _answers(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False


@pytest.fixture
def exporter(cluster: Cluster) -> Iterator[int]:
    """``mqorder exporter --port P`` as an operator runs it: the real CLI, in its own process."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mqorder.cli", "exporter", "--port", str(port), "--addr", "127.0.0.1"],
        env=cluster.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _answers(port), timeout=30, what="the exporter's endpoint")
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=15)[0].decode()
    assert proc.returncode == 0, out  # SIGTERM is a clean stop
    assert "on http://127.0.0.1:" in out


# -- the worker endpoint ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_worker_endpoints_count_every_call_of_both_prefork_children_and_both_workers(
    cluster: Cluster, r: redis.Redis
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=8)
    fast_locks = {"MQORDER_LOCK_INTERVAL_MS": "1000"}
    ports = {name: worker_with_metrics(cluster, name, **fast_locks) for name in ("w1", "w2")}
    keys_ = [f"order-{i}" for i in range(100)]
    for seq in (1, 2, 3, 4):
        p.send_orderly_batch("t-order", [(k, body(k, seq)) for k in keys_])
    wait_for(lambda: ok_calls(r, "g-order") >= 400, timeout=120, what="400 messages handled")

    pids = {}
    for name, port in ports.items():
        host = cluster.workers[name].hostname
        m = scrape(port)
        handled = ok_calls(r, "g-order", host)
        assert handled > 0
        # The worker's own count equals what its listeners recorded, summed over its pool children.
        assert total(m, "mqorder_consumed_messages_total", group="g-order", result="ok") == handled
        assert total(m, "mqorder_consumed_messages_total", result="suspended") == 0
        calls = total(m, "mqorder_consume_duration_seconds_count", group="g-order", topic="t-order")
        assert calls == handled  # one message per call (consume_message_batch_max_size 1)
        assert total(m, "mqorder_consume_duration_seconds_bucket", group="g-order", le="+Inf") == calls
        assert total(m, "mqorder_consume_duration_seconds_sum", group="g-order") > 0
        runs = {s["verb"] for s in series(m, "mqorder_consume_request_runs_total")}
        assert runs and runs <= {"IDLE", "REQUEUE", "HANDOVER", "DISPATCH", "STALE", "BUSY"}
        assert total(m, "mqorder_commits_refused_total") == 0
        assert total(m, "mqorder_requests_waiting_for_slot") >= 0  # the prefork capacity signal
        pids[name] = {e["pid"] for e in ledger(r, "g-order") if e["client"] == host}
    assert max(len(v) for v in pids.values()) == 2  # the sums really spanned two pool children
    assert total(scrape(ports["w1"]), "mqorder_consumed_messages_total") + total(
        scrape(ports["w2"]), "mqorder_consumed_messages_total") == 400

    # Locks: the 8 queues of t-order and the queue of %RETRY%g-conc (the retry topic the workers
    # create for the concurrent listener of tests.listeners) between the two workers, as of their
    # last lock_all; the first assignment and w2's arrival moved locks (a new epoch each).
    held = 8 + p.describe_topic("%RETRY%g-conc").queue_count
    assert held == 9
    wait_for(lambda: sum(total(scrape(pt), "mqorder_locks_held") for pt in ports.values()) == held,
             timeout=30, what=f"{held} locks held in all")
    assert sum(total(scrape(pt), "mqorder_lock_takeovers_total") for pt in ports.values()) >= 8
    # Drained: every lingering request gives its slot back within MQORDER_CONSUME_LINGER_MS.
    wait_for(lambda: all(total(scrape(pt), "mqorder_lingering_slots") == 0 for pt in ports.values()),
             timeout=30, what="no lingering slot")


@pytest.mark.e2e
def test_suspended_and_dead_lettered_messages_are_counted_and_the_exporter_sees_the_dlq(
    cluster: Cluster, r: redis.Redis, exporter: int
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-suspend", queues=1)  # max_reconsume_times=2 for this listener
    r.hset("ctl:g-suspend", mapping={"suspend:a:2": 1, "suspend:b:1": 99})
    port = worker_with_metrics(cluster, "w1")
    for k, seq in [("a", 1), ("a", 2), ("b", 1), ("c", 1)]:
        p.send_orderly("t-suspend", body(k, seq), sharding_key="one-queue")
    wait_for(lambda: any(e["key"] == "c" and e["ok"] for e in ledger(r, "g-suspend")), timeout=60, what="c handled")

    m = scrape(port)
    result = {res: total(m, "mqorder_consumed_messages_total", group="g-suspend", result=res)
              for res in ("ok", "suspended", "dlq")}
    # a1 ok; a2 suspended once, then ok; b1 suspended at reconsume 0 and 1, dead-lettered at 2; c1 ok.
    assert result == {"ok": 3, "suspended": 3, "dlq": 1}
    assert total(m, "mqorder_consume_duration_seconds_count", group="g-suspend") == 7
    assert total(m, "mqorder_consume_request_runs_total", group="g-suspend", verb="REQUEUE") >= 3

    def drained() -> Samples | None:
        e = scrape(exporter)
        return e if total(e, "mqorder_queue_lag", group="g-suspend") == 0 else None

    e = wait_for(drained, timeout=30, what="g-suspend drained in the exporter")
    assert total(e, "mqorder_dlq_messages", group="g-suspend") == 1
    assert total(e, "mqorder_queue_committed_offset", group="g-suspend", topic="t-suspend") == 4
    assert total(e, "mqorder_clients_live", group="g-suspend") == 1


@pytest.mark.e2e
def test_a_refused_commit_is_counted_after_a_forced_takeover(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-excl", queues=1)
    r.hset("ctl:g-excl", "sleep_ms", 1500)
    port = worker_with_metrics(cluster, "w1")
    host = cluster.workers["w1"].hostname
    mq = MessageQueue("t-excl", p.brokers.default_name, 0)
    locks = RebalanceLockManager(p.brokers)
    p.send_orderly("t-excl", body("k", 1), sharding_key="k")
    wait_for(lambda: locks.lock_entry("g-excl", mq).running, timeout=30, what="a run holding the queue")
    epoch = locks.lock_entry("g-excl", mq).epoch
    # Another client takes the queue while the listener call sleeps (a pause past the lease).
    assert locks.assign("g-excl", [(mq, "intruder", "tok")], dead_clients=[host])[mq] in ("MOVED", "DISPATCH")

    def refused() -> Samples | None:
        # The refusal is counted at the refused commit, the run's end a moment later (after_run):
        # a scrape between the two saw the one without the other (a CI failure).
        m = scrape(port)
        ended = total(m, "mqorder_consume_request_runs_total", group="g-excl", verb="FENCED")
        return m if total(m, "mqorder_commits_refused_total") and ended else None

    m = wait_for(refused, timeout=30, what="the refused commit and the run it ended")
    # Said on a failure (one unexplained failure once, its output lost): every run and refusal the
    # worker counted, and the queue's state.
    counted = {ls: v for (n, ls), v in m.items() if n in ("mqorder_commits_refused_total",
                                                          "mqorder_consume_request_runs_total")}
    seen = f"counted {counted}; state {r.hgetall(keys.sub_state(mq.tag, 'g-excl'))}; ok calls {ok_calls(r, 'g-excl')}"
    assert total(m, "mqorder_commits_refused_total", group="g-excl", topic="t-excl", reason="FENCED") == 1, seen
    assert total(m, "mqorder_consume_request_runs_total", group="g-excl", verb="FENCED") == 1, seen
    assert ok_calls(r, "g-excl") == 1, seen  # the call itself returned SUCCESS...
    assert r.hget(keys.sub_state(mq.tag, "g-excl"), "offset") in (None, b"0"), seen  # ...but committed nothing

    out = subprocess.run([sys.executable, "-m", "mqorder.cli", "exporter", "--once"], env=cluster.env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    e = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(out.stdout) for s in f.samples}
    assert total(e, "mqorder_queue_epoch", group="g-excl", queue="0") > epoch
    assert [s["owner"] for s in series(e, "mqorder_queue_owner_info") if s["group"] == "g-excl"] == ["intruder"]
    assert total(e, "mqorder_queue_lag", group="g-excl") == 1


@pytest.mark.e2e
def test_a_killed_pool_child_no_longer_counts_as_lingering(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-excl", queues=1)
    port = worker_with_metrics(cluster, "w1", MQORDER_CONSUME_LINGER_MS="8000")
    p.send_orderly("t-excl", body("k", 1), sharding_key="k")
    wait_for(lambda: total(scrape(port), "mqorder_lingering_slots") == 1, timeout=30,
             what="the drained request lingering")
    children = psutil.Process(cluster.workers["w1"].pid).children()
    assert len(children) == 2
    for c in children:
        os.kill(c.pid, signal.SIGKILL)
    psutil.wait_procs(children, timeout=10)
    # Its gauge file says 1 forever; the scrape marks the dead pid (mark_process_dead) first.
    wait_for(lambda: total(scrape(port), "mqorder_lingering_slots") == 0, timeout=10, what="the dead child reaped")
    m = scrape(port)
    assert total(m, "mqorder_consumed_messages_total", group="g-excl", result="ok") == 1  # totals stay
    assert cluster.workers["w1"].alive()


@pytest.mark.e2e
def test_a_threads_pool_worker_counts_in_its_own_process(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    port = worker_with_metrics(cluster, "w1", pool="threads")
    for i in range(30):
        p.send_orderly("t-order", body(f"k{i}", 1), sharding_key=f"k{i}")
    wait_for(lambda: ok_calls(r, "g-order") == 30, timeout=60, what="30 messages handled")
    m = scrape(port)
    assert total(m, "mqorder_consumed_messages_total", group="g-order", result="ok") == 30
    assert total(m, "mqorder_consume_duration_seconds_count", group="g-order") == 30
    assert series(m, "mqorder_requests_waiting_for_slot") == []  # no prefork capacity signal to read
    wait_for(lambda: total(scrape(port), "mqorder_lingering_slots") == 0, timeout=30, what="no lingering slot")
    assert total(scrape(port), "mqorder_consume_request_runs_total", group="g-order", verb="IDLE") >= 1  # ended


# -- the exporter -----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_exporter_shows_lag_before_consumption_and_none_after_drain(
    cluster: Cluster, r: redis.Redis, exporter: int
) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=4)
    TopicManager(p.brokers).subscribe("g-order", "t-order", MessageModel.CLUSTERING)  # as a worker does
    for i in range(100):
        p.send_orderly("t-order", body(f"k{i}", 1), sharding_key=f"k{i}")

    before = scrape(exporter)
    assert total(before, "mqorder_up") == 1
    max_offsets = {dict(ls)["queue"]: v for (n, ls), v in before.items() if n == "mqorder_queue_max_offset"}
    assert sorted(max_offsets) == ["0", "1", "2", "3"] and sum(max_offsets.values()) == 100
    for q, mx in max_offsets.items():
        assert total(before, "mqorder_queue_lag", group="g-order", queue=q) == mx > 0
        assert total(before, "mqorder_queue_committed_offset", group="g-order", queue=q) == 0
    assert total(before, "mqorder_clients_live", group="g-order") == 0
    assert series(before, "mqorder_queue_owner_info") == []

    cluster.start_worker("w1")
    cluster.start_worker("w2")
    wait_for(lambda: ok_calls(r, "g-order") >= 100, timeout=120, what="100 messages handled")

    def drained() -> Samples | None:
        e = scrape(exporter)
        return e if total(e, "mqorder_queue_lag", group="g-order") == 0 else None

    after = wait_for(drained, timeout=30, what="lag 0")
    for q, mx in max_offsets.items():
        assert total(after, "mqorder_queue_committed_offset", group="g-order", topic="t-order", queue=q) == mx
        assert total(after, "mqorder_queue_epoch", group="g-order", queue=q) >= 1
    assert total(after, "mqorder_clients_live", group="g-order") == 2
    assert total(after, "mqorder_dlq_messages", group="g-order") == 0

    def owners() -> list[dict[str, str]]:
        return [s for s in series(scrape(exporter), "mqorder_queue_owner_info") if s["group"] == "g-order"]

    # w1 may have drained everything before w2 joined: the queues move to w2 by its rebalance.
    hosts = {w.hostname for w in cluster.workers.values()}
    wait_for(lambda: {s["owner"] for s in owners()} == hosts, timeout=30, what="both workers owning queues")
    assert sorted(s["queue"] for s in owners()) == ["0", "1", "2", "3"]  # one live owner per queue


def test_the_exporter_stops_on_sigterm_with_an_idle_connection_open(cluster: Cluster) -> None:
    """A connection that never sends its request (a TCP health probe, a half-open scraper) must
    not keep the exporter from stopping, nor other scrapes from being served: SIGTERM ends it
    within seconds, exit status 0."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mqorder.cli", "exporter", "--port", str(port), "--addr", "127.0.0.1"],
        env=cluster.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: _answers(port), timeout=30, what="the exporter's endpoint")
        idle = socket.create_connection(("127.0.0.1", port))
        assert _answers(port)  # another scraper is still served beside it
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=10)[0].decode()
        idle.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out


def test_exporter_once_reports_an_unreachable_redis_as_down() -> None:
    env = {**os.environ, "MQORDER_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    out = subprocess.run([sys.executable, "-m", "mqorder.cli", "exporter", "--once"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    samples = {s.name: s.value for f in text_string_to_metric_families(out.stdout) for s in f.samples}
    assert samples["mqorder_up"] == 0
    assert not any(n.startswith("mqorder_queue_") for n in samples)


# -- settings, a busy port, metrics off --------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "65536", "-1", "abc", "80.5", "9100x", "٣"])
def test_a_bad_metrics_port_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=r"MQORDER_METRICS_PORT: must be a TCP port from 1 to 65535, or unset"):
        load_settings(metrics_port=value)


def test_metrics_port_is_off_by_default_and_when_empty() -> None:
    assert load_settings().metrics_port is None
    assert load_settings(metrics_port="").metrics_port is None
    assert load_settings(metrics_port=" 9100 ").metrics_port == 9100
    with pytest.raises(ConfigError, match="MQORDER_METRICS_ADDR"):
        load_settings(metrics_addr="not an address")


@pytest.mark.e2e
def test_a_worker_with_a_bad_metrics_port_stops_at_start_with_a_clear_error(cluster: Cluster) -> None:
    w = cluster.start_worker("w1", wait=False, MQORDER_METRICS_PORT="70000")
    wait_for(lambda: not w.alive(), timeout=60, what="the worker to exit")
    assert w.returncode() != 0
    log = Path(w.logfile or "").read_text()
    assert "MQORDER_METRICS_PORT: must be a TCP port from 1 to 65535" in log and "70000" in log


@pytest.mark.e2e
def test_a_metrics_port_in_use_is_logged_and_the_worker_still_consumes(cluster: Cluster, r: redis.Redis) -> None:
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=2)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        w = cluster.start_worker("w1", MQORDER_METRICS_PORT=str(port))
        for i in range(20):
            p.send_orderly("t-order", body(f"k{i}", 1), sharding_key=f"k{i}")
        wait_for(lambda: ok_calls(r, "g-order") == 20, timeout=60, what="20 messages handled")
    log = Path(w.logfile or "").read_text()
    assert re.search(rf"cannot serve worker metrics on 0\.0\.0\.0:{port} \(.*in use.*\); this worker goes on", log)


def test_with_metrics_off_nothing_is_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    before = list(global_hooks())
    assert worker_metrics.start(load_settings()) is None
    assert global_hooks() == before and worker_metrics._active is None
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    worker_metrics.after_run("g", MessageQueue("t", "broker-a", 0), None)  # the task's call: a no-op


def test_a_scrape_reads_past_a_metrics_file_a_child_has_not_sized_yet(tmp_path: Path) -> None:
    """A child creates its file and sizes it a moment later (prometheus/client_python#1199): a
    scrape in between read it at 0 bytes and answered HTTP 500 (once in CI). Now it is left out."""
    from types import SimpleNamespace

    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from prometheus_client.multiprocess import MultiProcessCollector

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(mmap_key("mqorder_runs", "mqorder_runs_total", ["verb"], ["FENCED"], "h"), 1.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()  # created, not yet sized (or its child killed right then)
    with pytest.raises(Exception, match="buffer"):  # the library's own collector fails whole
        list(MultiProcessCollector(None, str(tmp_path)).collect())

    main = SimpleNamespace(path=str(tmp_path), collect_main=lambda: iter(()))
    got = {(s.name, tuple(s.labels.items())): s.value
           for m in worker_metrics._WorkerCollector(main).collect() for s in m.samples}  # type: ignore[arg-type]
    assert got == {("mqorder_runs_total", (("verb", "FENCED"),)): 1.0}


def test_every_metric_is_documented_with_its_labels() -> None:
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    for spec in (*names.WORKER, *names.EXPORTER):
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{spec.name}`")), None)
        assert row is not None, f"{spec.name} is not in docs/METRICS.md"
        for label in spec.labels:
            assert f"`{label}`" in row, f"{spec.name}: label {label} missing from its row"

"""Issue 28's stuck-key figures of ``mqorder exporter`` against a real redis-server, with the
Celery-free engine consuming in process (the e2e tests in ``test_metrics`` run the same engine in
real workers): a blocked head message makes ``head_age`` and ``stalled`` grow and shows its
reconsume count, all three go to 0 once it is released; a key-ordered lane shows its parked
messages and the age of its lowest unfinished offset."""

from __future__ import annotations

import gzip
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from mqorder import ConsumeOrderlyStatus, Producer
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.listener import ListenerSpec
from mqorder.consumer.run_types import Outcome
from mqorder.metrics import names
from mqorder.metrics.exporter import collector_for
from mqorder.metrics.exposition import serve
from mqorder.metrics.hook import KeyWatch, LingerWatch, MetricsHook
from mqorder.model import MessageModel
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import Settings
from mqorder.store.topics import TopicManager
from tests.engine_support import MQ, drain
from tests.support import ROOT, Cluster, body, wait_for
from tests.test_metrics import ok_calls, total, worker_with_metrics
from tests.test_metrics import scrape as metrics_of

S = ConsumeOrderlyStatus
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LANE = {"group": "g", "topic": "t", "broker": "broker-a", "queue": "0"}


def scrape(settings: Settings) -> Samples:
    """One scrape of the exporter's collector, as ``mqorder exporter`` serves it, parsed by
    prometheus-client's parser."""
    collector = collector_for(settings)
    try:
        text = collector.scrape()
    finally:
        collector.brokers.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def lane(samples: Samples, name: str) -> float | None:
    return samples.get((name, tuple(sorted(LANE.items()))))


def runs(eng: ConsumerEngine, spec: ListenerSpec, n: int, token: str = "tok0") -> tuple[list[Outcome], str]:
    """Up to ``n`` runs of the queue, each re-dispatched as the Celery task would (no sleep: the
    suspend time is what the test waits out, or not)."""
    outs = []
    for _ in range(n):
        out = request_class(spec)(eng, spec, "g", MQ, token).run()
        outs.append(out)
        if not out.needs_dispatch or out.target != "c1":
            break
        token = out.token
    return outs, token


def test_a_blocked_head_grows_head_age_and_stalled_then_both_go_to_zero(env, settings) -> None:
    p, eng = env
    TopicManager(eng.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="order-1")
    release = {"on": False}

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 1 and not release["on"]:
            raise RuntimeError("payment service down")
        return S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", suspend_current_queue_time_millis=10)
    time.sleep(0.02)  # the head's age is measured in ms: let one pass
    caught_up = scrape(settings)
    assert lane(caught_up, "mqorder_queue_lag") == 3
    assert lane(caught_up, "mqorder_queue_head_age_seconds") > 0  # never consumed: waits since stored

    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    _, token = runs(eng, spec, 3)  # offset 0 committed, offset 1 raises three times
    first = scrape(settings)
    assert lane(first, "mqorder_queue_committed_offset") == 1
    assert lane(first, "mqorder_queue_head_retries") == 3
    age1, stalled1 = lane(first, "mqorder_queue_head_age_seconds"), lane(first, "mqorder_queue_stalled_seconds")
    assert age1 > 0 and stalled1 > 0
    assert lane(first, "mqorder_queue_keys_suspended") is None  # queue mode: no key-mode series
    time.sleep(0.3)
    later = scrape(settings)
    assert lane(later, "mqorder_queue_head_age_seconds") >= age1 + 0.25
    assert lane(later, "mqorder_queue_stalled_seconds") >= stalled1 + 0.25

    release["on"] = True
    runs(eng, spec, 5, token)
    done = scrape(settings)
    assert lane(done, "mqorder_queue_lag") == 0
    for name in ("mqorder_queue_head_age_seconds", "mqorder_queue_stalled_seconds", "mqorder_queue_head_retries"):
        assert lane(done, name) == 0, name


# -- worker metrics: the hook the worker registers, on a private registry -----------------------------


def worker_hook(max_reconsume: int = 16, **kw) -> tuple[MetricsHook, CollectorRegistry]:
    """The ``MetricsHook`` a worker registers (``mqorder.metrics.worker``), its metrics on a private
    registry instead of the multiprocess files (the e2e test covers those)."""
    reg = CollectorRegistry()

    def metric(cls, spec, **extra):
        return cls(spec.family, spec.help, spec.labels, registry=reg, **extra)

    hook = MetricsHook(
        metric(Counter, names.CONSUMED), metric(Histogram, names.CONSUME_DURATION),
        metric(Counter, names.COMMITS_REFUSED), LingerWatch(Gauge("linger", "l", registry=reg)), lambda g, t: max_reconsume,
        metric(Histogram, names.MESSAGE_LATENCY, buckets=names.MESSAGE_LATENCY_BUCKETS),
        metric(Counter, names.REDELIVERIES), KeyWatch(metric(Gauge, names.KEYS_SUSPENDED)), **kw,
    )
    return hook, reg


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_latency_is_observed_at_every_call_from_the_born_time(env) -> None:
    p, eng = env
    for i in range(4):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    time.sleep(0.2)  # the messages wait before anybody consumes them
    hook, reg = worker_hook()
    calls = {"n": 0}

    def listener(msgs, ctx):
        calls["n"] += 1
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT if calls["n"] == 2 else S.SUCCESS  # offset 1 fails once

    drain(eng, ListenerSpec(listener, "t", "g", hooks=[hook], suspend_current_queue_time_millis=10))
    assert calls["n"] == 5
    gt = {"group": "g", "topic": "t"}
    assert value(reg, "mqorder_message_latency_seconds_count", **gt) == 5  # the retry of offset 1 too
    assert value(reg, "mqorder_message_latency_seconds_sum", **gt) >= 5 * 0.2
    assert value(reg, "mqorder_message_latency_seconds_bucket", le="0.1", **gt) == 0


def test_a_suspended_key_shows_in_the_worker_and_the_exporter_until_it_succeeds(env, settings) -> None:
    p, eng = env
    TopicManager(eng.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    for i, key in enumerate(["a", "b", "a", "c", "b"]):
        p.send_orderly("t", f"{key}:{i}".encode(), sharding_key=key)
    hook, reg = worker_hook(key_mode=lambda g, t: True)
    blocked = {"a": True}

    def listener(msgs, ctx):
        key = msgs[0].body.decode().split(":")[0]
        return S.SUSPEND_CURRENT_QUEUE_A_MOMENT if blocked.get(key) else S.SUCCESS

    spec = ListenerSpec(listener, "t", "g", ordering="key", hooks=[hook], suspend_current_queue_time_millis=1500)
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", "tok0")])
    outs, token = runs(eng, spec, 1)
    suspended_at = time.monotonic()
    assert outs[-1].verb == "REQUEUE"  # only key a is left, suspended for 1.5 s: the slot goes back
    assert value(reg, "mqorder_keys_suspended", group="g", topic="t") == 1
    # What the worker's after_run does next: the run requeues itself, its stuck key stays counted
    # (the gauge once dropped it here and read 0 nearly all the time; found by a review).
    hook.run_ended("g", "t", MQ.key, outs[-1].verb.value)
    assert value(reg, "mqorder_keys_suspended", group="g", topic="t") == 1
    e = scrape(settings)
    assert lane(e, "mqorder_queue_committed_offset") == 0  # a's first message is the lowest unfinished
    assert lane(e, "mqorder_queue_keys_suspended") == 1  # one message parked (batch size 1)
    assert lane(e, "mqorder_queue_head_retries") == 1
    assert lane(e, "mqorder_queue_oldest_unfinished_age_seconds") > 0
    assert lane(e, "mqorder_queue_oldest_unfinished_age_seconds") == lane(e, "mqorder_queue_head_age_seconds")

    blocked["a"] = False
    # The next run keeps key a suspended until its time (the commit's 'held'), then it succeeds.
    outs, token = runs(eng, spec, 1, token)
    assert outs[-1].verb == "REQUEUE" and outs[-1].consumed == 0
    time.sleep(max(0.0, suspended_at + 1.6 - time.monotonic()))
    assert runs(eng, spec, 5, token)[0][-1].verb == "IDLE"
    assert value(reg, "mqorder_keys_suspended", group="g", topic="t") == 0
    e = scrape(settings)
    assert lane(e, "mqorder_queue_lag") == 0
    assert lane(e, "mqorder_queue_keys_suspended") == 0
    assert lane(e, "mqorder_queue_oldest_unfinished_age_seconds") == 0


@pytest.mark.parametrize("status", ["ROLLBACK", "SUSPEND_CURRENT_QUEUE_A_MOMENT"])
def test_key_mode_dead_letters_are_counted_as_dlq_whatever_the_status(env, status: str) -> None:
    """Key mode sends a ROLLBACK through the reconsume count and the DLQ as it does a SUSPEND.
    Once the hook counted a ROLLBACK's dead letters as suspended (4 suspended, 0 dlq here) and kept
    their keys in ``mqorder_keys_suspended``."""
    from mqorder import keys
    from mqorder.model import MessageQueue

    p, eng = env
    for k in ("a", "b"):
        p.send_orderly("t", k.encode(), sharding_key=k)
    hook, reg = worker_hook(max_reconsume=1, key_mode=lambda g, t: True)
    spec = ListenerSpec(lambda msgs, ctx: getattr(S, status), "t", "g", ordering="key", hooks=[hook],
                        max_reconsume_times=1, suspend_current_queue_time_millis=10)
    token = "tok0"
    RebalanceLockManager(eng.brokers).assign("g", [(MQ, "c1", token)])
    for _ in range(50):
        out = request_class(spec)(eng, spec, "g", MQ, token).run()
        if not out.needs_dispatch or out.target != "c1":
            break
        time.sleep(out.countdown)
        token = out.token
    dlq = MessageQueue(keys.dlq_topic("g"), "broker-a", 0)
    assert eng.brokers.meta.xlen(keys.queue_log(dlq.tag)) == 2  # one call, one retry, then the DLQ
    gt = {"group": "g", "topic": "t"}
    assert value(reg, "mqorder_consumed_messages_total", result="suspended", **gt) == 2
    assert value(reg, "mqorder_consumed_messages_total", result="dlq", **gt) == 2
    assert value(reg, "mqorder_keys_suspended", **gt) == 0


def test_redeliveries_are_counted_when_a_run_loses_its_queue_before_committing(env) -> None:
    p, eng = env
    for i in range(3):
        p.send_orderly("t", str(i).encode(), sharding_key="k")
    hook, reg = worker_hook()
    locks = RebalanceLockManager(eng.brokers)

    def listener(msgs, ctx):
        if msgs[0].queue_offset == 1:  # another client takes the queue mid-run (a pause past the lease)
            locks.assign("g", [(MQ, "c2", "other")], dead_clients=["c1"])
        return S.SUCCESS

    drain(eng, ListenerSpec(listener, "t", "g", hooks=[hook]))
    assert value(reg, "mqorder_commits_refused_total", group="g", topic="t", reason="FENCED") == 1
    # Offsets 0..2 were handed out, none committed: c2 reads them again.
    assert value(reg, "mqorder_redeliveries_total", group="g", topic="t") == 3


@pytest.mark.e2e
def test_a_real_worker_exports_latency_and_the_exporter_cli_the_stuck_head(cluster: Cluster, r: redis.Redis) -> None:
    """The latency histogram through a real prefork worker's endpoint (multiprocess files summed by
    its main process), and the stuck-head series from the real ``mqorder exporter --once``."""
    p = Producer(cluster.url)
    p.create_topic("t-order", queues=1)
    r.hset("ctl:g-order", "fail:stuck", 1)  # tests.listeners: key "stuck" always suspends (1 s each)
    port = worker_with_metrics(cluster, "w1")
    for i in range(6):
        p.send_orderly("t-order", body(f"k{i}", 1), sharding_key=f"k{i}")
    p.send_orderly("t-order", body("stuck", 1), sharding_key="stuck")
    wait_for(lambda: ok_calls(r, "g-order") >= 6, timeout=60, what="the six keys before it handled")

    def suspended_once() -> Samples | None:
        m = metrics_of(port)
        return m if total(m, "mqorder_consumed_messages_total", group="g-order", result="suspended") >= 1 else None

    m = wait_for(suspended_once, timeout=30, what="the stuck message suspended")
    # One observation per message per call: the six, and the stuck one at each of its calls.
    # (A retry may be between its latency observation and its duration one at the scrape: + 1.)
    calls = total(m, "mqorder_consume_duration_seconds_count", group="g-order", topic="t-order")
    observed = total(m, "mqorder_message_latency_seconds_count", group="g-order", topic="t-order")
    assert calls >= 7 and calls <= observed <= calls + 1
    assert total(m, "mqorder_message_latency_seconds_bucket", group="g-order", le="+Inf") == observed
    assert total(m, "mqorder_redeliveries_total") == 0  # no run lost its queue

    out = subprocess.run([sys.executable, "-m", "mqorder.cli", "exporter", "--once"], env=cluster.env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    e = {(s.name, tuple(sorted(s.labels.items()))): s.value
         for f in text_string_to_metric_families(out.stdout) for s in f.samples}
    lane_ = (("broker", "broker-a"), ("group", "g-order"), ("queue", "0"), ("topic", "t-order"))
    assert e[("mqorder_queue_committed_offset", lane_)] == 6
    assert e[("mqorder_queue_head_retries", lane_)] >= 1
    assert e[("mqorder_queue_head_age_seconds", lane_)] > 0
    assert e[("mqorder_queue_stalled_seconds", lane_)] > 0
    assert ("mqorder_queue_keys_suspended", lane_) not in e  # queue order: no key-mode series


def test_the_exporter_endpoint_serves_text_gzipped_on_request_and_404_elsewhere(env, settings) -> None:
    p, eng = env
    TopicManager(eng.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    p.send_orderly("t", b"x", sharding_key="k")
    collector = collector_for(settings)
    server = serve("127.0.0.1", 0, collector.scrape)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        plain = urllib.request.urlopen(f"{base}/metrics", timeout=10)
        assert plain.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = plain.read().decode()
        zipped = urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers={"Accept-Encoding": "gzip"}),
                                        timeout=10)
        assert zipped.headers["Content-Encoding"] == "gzip"
        unzipped = gzip.decompress(zipped.read()).decode()
        for body in (text, unzipped):
            samples = {s.name: s for f in text_string_to_metric_families(body) for s in f.samples}
            assert samples["mqorder_up"].value == 1 and samples["mqorder_queue_lag"].value == 1
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{base}/nothing", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
        collector.brokers.close()


def test_one_unreadable_broker_loses_only_its_own_queues_series(settings) -> None:
    """A second broker that does not answer (here: nothing listens on its port) used to empty the
    whole scrape (``mqorder_up`` 0 and no series at all), blinding the lag alerts of every healthy
    broker. Its queues are left out now, named by ``mqorder_broker_up``."""
    from mqorder.settings import load_settings
    from mqorder.store.brokers import BrokerRegistry
    from tests.test_metrics import free_port

    two = load_settings(redis_url=settings.redis_url, brokers={"broker-b": f"redis://127.0.0.1:{free_port()}/0"})
    brokers = BrokerRegistry(two.redis_url, two.brokers)
    try:
        topics = TopicManager(brokers)
        topics.create_topic("ta", queues=2)
        topics.create_topic("tb", queues=2, brokers=["broker-b"])  # a route: written on broker-a
        for t in ("ta", "tb"):
            topics.subscribe("g", t, MessageModel.CLUSTERING)
    finally:
        brokers.close()
    p = Producer(settings=settings)
    p.send_orderly("ta", b"x", sharding_key="k")
    p.close()

    samples = scrape(two)
    assert samples[("mqorder_up", ())] == 0
    assert samples[("mqorder_broker_up", (("broker", "broker-a"),))] == 1
    assert samples[("mqorder_broker_up", (("broker", "broker-b"),))] == 0
    lags: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == "mqorder_queue_lag":
            lags[dict(ls)["topic"]] = lags.get(dict(ls)["topic"], 0) + v
    assert lags == {"ta": 1}  # broker-a's two queues, none of broker-b's
    assert {dict(ls)["broker"] for (n, ls) in samples if n == "mqorder_queue_max_offset"} == {"broker-a"}
    assert samples[("mqorder_clients_live", (("group", "g"),))] == 0


def test_broadcast_lanes_of_clients_that_died_without_leaving_are_not_exported(settings) -> None:
    """A broadcast client killed outright keeps its subscription (``%BC%<client>``) and a backlog
    nobody will consume: exporting it would keep the stalled and head-age alerts firing for ever."""
    from mqorder import keys
    from mqorder.rebalance.membership import ClientRegistry, Subscription

    p = Producer(settings=settings)
    p.create_topic("bt", queues=1)
    topics = TopicManager(p.brokers, settings.retention_defaults)
    topics.subscribe("bg", "bt", MessageModel.BROADCASTING)
    for client in ("alive", "gone"):
        topics.add_sub("bt", keys.broadcast_sub("bg", client))
    ClientRegistry(p.brokers.meta, settings.heartbeat_timeout_ms).register(
        "alive", [Subscription("bg", "bt", MessageModel.BROADCASTING)])
    p.send_orderly("bt", b"x", sharding_key="k")
    groups = {dict(labels).get("group") for (name, labels) in scrape(settings) if name == "mqorder_queue_lag"}
    assert keys.broadcast_sub("bg", "alive") in groups
    assert keys.broadcast_sub("bg", "gone") not in groups
    p.close()


def test_the_exporters_lag_leaves_out_what_retention_deleted(settings: Settings) -> None:
    """A group without consumers whose 5 messages retention deleted: the exporter's lag stayed 5 for
    good (mqorder status said 0), so MqorderNoLiveConsumer never resolved (found by a review)."""
    from mqorder.retention.trimmer import RetentionTrimmer
    from mqorder.store.brokers import BrokerRegistry

    p = Producer(settings=settings)
    p.create_topic("t", queues=1, retention_policy="time", retention_ms=1000)
    b = BrokerRegistry(settings.redis_url)
    try:
        TopicManager(b).subscribe("g", "t", MessageModel.CLUSTERING)
        for i in range(5):
            p.send_orderly("t", str(i).encode(), sharding_key="k")
        assert lane(scrape(settings), "mqorder_queue_lag") == 5
        time.sleep(1.2)
        assert RetentionTrimmer(b, settings).run().trimmed == 5
        assert lane(scrape(settings), "mqorder_queue_lag") == 0
        p.send_orderly("t", b"5", sharding_key="k")
        assert lane(scrape(settings), "mqorder_queue_lag") == 1
    finally:
        p.close()
        b.close()

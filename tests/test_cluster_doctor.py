"""``mqorder doctor`` on a Redis Cluster, against real clusters (``ClusterDeployment``): a healthy
3-primary + 3-replica one, a 3-primary one with no replica, then that one with a primary killed.
Also the hint for a plain ``redis://`` URL that reaches a cluster node, and the reverse mistake."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from mqorder import keys
from mqorder.admin.doctor_cluster import cluster_findings, parse_cluster_nodes, probe_cluster, split_queue
from mqorder.admin.findings import Finding, Verdict
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.cluster_urls import cluster_mode_hint
from mqorder.store.topics import TopicManager
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def healthy() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3, replicas_per_master=1) as d:
        yield d


@pytest.fixture
def bare() -> Iterator[ClusterDeployment]:
    """Three primaries, no replica: this test's own, as it may kill one."""
    with ClusterDeployment(masters=3) as d:
        yield d


@pytest.fixture
def routes(redis_url: str) -> Iterator[redis.Redis]:
    """Topic routes of broker-a on a plain Redis: two topics, 8 + 3 queues, with subscriptions."""
    brokers = BrokerRegistry(redis_url)
    topics = TopicManager(brokers)
    topics.create_topic("orders", 8)
    topics.create_topic("payments", 3)
    topics.add_sub("orders", "billing")
    topics.add_sub("orders", "shipping%BC%c1")
    yield brokers.meta
    brokers.close()


def findings(url: str, routes: Any = None) -> dict[str, list[Finding]]:
    probe = probe_cluster(url)
    try:
        by: dict[str, list[Finding]] = {}
        for f in cluster_findings(probe, "broker-a", routes):
            by.setdefault(f.check, []).append(f)
        return by
    finally:
        probe.close()


def verdicts(by: dict[str, list[Finding]]) -> dict[str, list[str]]:
    return {check: [f.verdict.value for f in fs] for check, fs in by.items()}


def test_a_healthy_cluster_is_ok_in_every_cluster_check(healthy: ClusterDeployment, routes: redis.Redis) -> None:
    by = findings(healthy.url(), routes)
    assert verdicts(by) == {check: ["OK"] for check in (
        "cluster state", "slot coverage", "replicas", "cluster nodes", "cluster version", "queue slots")}, by
    assert by["slot coverage"][0].data == {"assigned": 16384, "unserved": 0, "primaries": 3, "unserved_by": {}}
    assert "6 nodes (3 primaries, 3 replicas)" in by["cluster nodes"][0].detail
    assert set(by["replicas"][0].data.values()) == {1}
    qs = by["queue slots"][0]
    assert (qs.data["queues"], qs.data["topics"]) == (11, 2), qs
    assert sum(qs.data["queues_per_primary"].values()) == 11
    primaries = {f"127.0.0.1:{healthy.master_of_slot(s).port}" for s in (0, 8000, 16383)}
    assert set(qs.data["queues_per_primary"]) <= primaries


def test_a_primary_without_replica_is_a_warning_naming_it_and_the_fix(bare: ClusterDeployment) -> None:
    by = findings(bare.url())
    warned = by["replicas"]
    assert [f.verdict for f in warned] == [Verdict.WARN] * 3
    primaries = {f"127.0.0.1:{n.port}" for n in bare.nodes}
    assert {f.data["primary"] for f in warned} == primaries
    for f in warned:
        assert "unavailable until it returns" in f.detail
        assert "--cluster-slave --cluster-master-id" in f.fix and f.data["primary"] in f.fix
    # Nothing else is wrong with it; with no topic route yet the schema check has nothing to check.
    assert {c: v for c, v in verdicts(by).items() if c != "replicas"} == {
        c: ["OK"] for c in ("cluster state", "slot coverage", "cluster nodes", "cluster version", "queue slots")}
    assert by["queue slots"][0].data["queues"] == 0


def _marked_fail(d: ClusterDeployment, addr: str, timeout: float = 15.0) -> None:
    live = next(n for n in d.nodes if f"127.0.0.1:{n.port}" != addr)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raw = d.client(live).execute_command("CLUSTER", "NODES").decode()
        if any(n.addr == addr and n.failed for n in parse_cluster_nodes(raw)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{addr} not marked fail within {timeout} s")


def test_a_killed_primary_fails_slot_coverage_and_names_the_node(bare: ClusterDeployment) -> None:
    victim = bare.master_of_slot(8000)
    addr = f"127.0.0.1:{victim.port}"
    bare.kill(victim)
    for moment in ("unreachable", "marked fail"):  # at once, and once the cluster agrees it is down
        if moment == "marked fail":
            _marked_fail(bare, addr)
        by = findings(bare.url())
        (cov,) = by["slot coverage"]
        assert cov.verdict is Verdict.FAIL and addr in cov.detail, (moment, cov)
        assert list(cov.data["unserved_by"]) == [addr] and cov.data["unserved"] > 5000
        (node,) = by["cluster nodes"]
        assert node.verdict is Verdict.FAIL and addr in node.detail, (moment, node)
        if moment == "marked fail":
            assert "marked fail by the cluster" in cov.detail and "marked fail" in node.detail
        # The live primaries are still OK in state and version; the dead one is simply not counted.
        assert [f.verdict for f in by["cluster version"]] == [Verdict.OK]
        assert "on the 2 nodes that answered" in by["cluster state"][0].detail


def test_a_cluster_url_at_a_plain_redis_is_a_failure_saying_so(redis_server: RedisServer) -> None:
    by = findings(f"redis+cluster://127.0.0.1:{redis_server.port}")
    (f,) = by["cluster"]
    assert f.verdict is Verdict.FAIL and "not a Redis Cluster" in f.detail and "redis://host:port/0" in f.fix


def test_no_listed_node_answering_is_one_failure_naming_them() -> None:
    ports = (free_port(), free_port())
    by = findings(f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}")
    assert list(by) == ["cluster"]
    (f,) = by["cluster"]
    assert f.verdict is Verdict.FAIL and all(f"127.0.0.1:{p}" in f.detail for p in ports)


def test_every_queue_key_shares_the_queues_slot_and_a_key_without_the_tag_is_caught() -> None:
    tag = keys.queue_tag("orders", "broker-a", 5)
    assert split_queue(tag, ["billing", "g%BC%c1"]) is None
    # The check can fail: the same keys without braces hash by their whole name, to many slots.
    split = split_queue(tag.strip("{}"), ["billing"])
    assert split is not None and len(split) > 1


def test_a_plain_url_at_a_cluster_node_gets_the_cluster_url_as_a_hint(healthy: ClusterDeployment,
                                                                      redis_server: RedisServer) -> None:
    node = healthy.nodes[0]
    c = redis.Redis(host="127.0.0.1", port=node.port)
    try:
        hint = cluster_mode_hint(c)
    finally:
        c.close()
    assert hint is not None and "cluster_enabled:1" in hint and f"127.0.0.1:{node.port}" in hint
    primaries = sorted(f"127.0.0.1:{healthy.master_of_slot(s).port}" for s in (0, 8000, 16383))
    assert f"redis+cluster://[user:password@]{','.join(primaries)}/" in hint
    plain = redis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        assert cluster_mode_hint(plain) is None
    finally:
        plain.close()


def test_the_runtime_guards_read_every_primary_not_one(healthy: ClusterDeployment) -> None:
    """redis-py sends INFO and CONFIG GET of a RedisCluster to one node: a non-default shard with
    an evicting policy passed the worker's and producer's check, and a full one never refused a
    send (found by a review). doctor checked every node; now the runtime guards do too."""
    from mqorder.errors import EvictionPolicyError
    from mqorder.store.brokers import Broker
    from mqorder.store.capacity import check_eviction_policy, read_memory

    b = Broker("broker-a", healthy.url())
    default = b.client.get_default_node()
    other = next(m for m in healthy.masters_serving() if m.port != default.port)
    try:
        healthy.client(other).config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
            check_eviction_policy(b, allow=False)
        healthy.client(other).config_set("maxmemory-policy", "noeviction")
        assert check_eviction_policy(b, allow=False) == "noeviction"
        healthy.client(other).config_set("maxmemory", 512 * 1024 * 1024)
        assert read_memory(b.client).maxmemory == 512 * 1024 * 1024  # the only shard with a limit
    finally:
        healthy.client(other).config_set("maxmemory-policy", "noeviction")
        healthy.client(other).config_set("maxmemory", 0)
        b.close()

"""The ``cluster`` bench section's accounting: what its meter counts on a real redis-server, and
that its figures catch a command sent to every shard per message."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from bench.cluster import NodeMeter
from bench.cluster_report import command_fanout, command_ratios, cpu_ratios, markdown
from mqorder.testing.embedded import RedisServer


def test_meter_counts_client_round_trips_and_commands_but_not_its_own() -> None:
    with RedisServer() as srv:
        meter = NodeMeter([srv])
        c = redis.Redis.from_url(srv.url)
        try:
            c.ping()  # connected before the window: a new connection's CLIENT SETINFO is not the test's
            meter.start()
            for _ in range(5):
                c.get("a")
            pipe = c.pipeline(transaction=False)
            for _ in range(20):
                pipe.get("a")
            pipe.execute()
            c.eval("redis.call('set', 'b', 1) return redis.call('get', 'b')", 0)
            (node,) = meter.stop()
        finally:
            c.close()
            meter.close()
    assert node["reads"] == 5 + 1 + 1  # a pipeline is one read, however many commands it carries
    assert node["calls"] == {"get": 26, "eval": 1, "set": 1}  # a script's own commands count; INFO does not
    assert node["cpu_s"] > 0


def _run(i: int, kind: str, per_node: list[tuple[int, float, dict[str, int]]]) -> dict[str, Any]:
    """A results row of ``bench.cluster.drain_once`` with 300 messages: (messages, CPU s, calls) per node."""
    nodes = [{"port": 7000 + j, "queues": 1, "messages": m, "cpu_s": cpu, "reads": 10, "calls": calls,
              "commands": sum(calls.values())} for j, (m, cpu, calls) in enumerate(per_node)]
    return {"run": i, "kind": kind, "messages": 300, "seconds": 1.0, "rate": 300.0, "produce_rate": 100.0,
            "worker_cpu_s": 0.003, "nodes": nodes, "produce_nodes": nodes}


def test_a_command_on_every_shard_per_message_breaks_the_commands_target() -> None:
    single = _run(0, "single", [(300, 0.0003, {"evalsha": 30, "get": 30})])
    routed = _run(0, "cluster", [(100, 0.0001, {"evalsha": 10, "get": 10})] * 3)
    # The same plus one GET per message of the whole topic on every shard.
    broadcast = _run(0, "cluster", [(100, 0.0002, {"evalsha": 10, "get": 310})] * 3)
    ok = {"masters": 3, "runs": {"single": [single], "cluster": [routed]}}
    bad = {"masters": 3, "runs": {"single": [single], "cluster": [broadcast]}}
    assert command_ratios(ok) == [pytest.approx(1.0)] and cpu_ratios(ok) == [pytest.approx(1.0)]
    assert command_ratios(bad)[0] > 10
    assert command_fanout(bad)["get"][2] > 3 * 0.9  # ~ one GET per message on each of the 3 shards
    assert cpu_ratios(bad) == [pytest.approx(2.0)]


def test_section_renders_the_verdicts_it_judges() -> None:
    single = _run(0, "single", [(300, 0.0003, {"evalsha": 30})])
    costly = _run(0, "cluster", [(100, 0.00015, {"evalsha": 10})] * 3)
    for r in (single, costly):
        r["idle"], r["idle_s"] = r["nodes"], 2.0
    text = "\n".join(markdown({"masters": 3, "messages": 300, "concurrency": 2, "queues": 16, "poll_s": 0.02,
                               "runs": {"single": [single], "cluster": [costly]}}))
    assert "median **1.50x** (target ≤ 1.2x: **NOT met**)" in text
    assert "median **1.00x** (target ≤ 1.2x: **met**)" in text
    assert "| 12 (projected) |" in text

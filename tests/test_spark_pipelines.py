"""The Spark Declarative Pipelines example (``examples/pipelines/orders``) run with
``spark-pipelines run`` of the installed pyspark, against the tests' Spark Connect server, then
audited from what Redis holds: every order event once in the sink topic, re-keyed by customer, each
order's events in the order they were sent (the source's key order, kept end to end).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from mqorder import Producer
from tests.spark_cluster import ConnectServer, spark_env, spark_home
from tests.spark_support import stored

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pipelines" / "orders"
ORDERS, EVENTS, CUSTOMERS = 24, 5, 7


def _send_events(p: Producer, first_ts: int) -> tuple[int, list[dict]]:
    """Every order's events ``seq`` 1..EVENTS, orders interleaved at random, ``ts`` increasing."""
    rng = random.Random(first_ts)
    pending = {f"o{i}": 1 for i in range(ORDERS)}
    sent, ts = [], first_ts
    while pending:
        order = rng.choice(sorted(pending))
        ts += 1
        event = {"order_id": order, "customer": f"c{int(order[1:]) % CUSTOMERS}", "seq": pending[order],
                 "amount": float(rng.randint(1, 200)), "ts": ts}
        sent.append(event)
        pending[order] += 1
        if pending[order] > EVENTS:
            del pending[order]
    p.send_orderly_batch("orders", [(e["order_id"], json.dumps(e).encode()) for e in sent])
    return ts, sent


def test_the_orders_pipeline_rekeys_by_customer_in_order_exactly_once(connect_server: ConnectServer, redis_url: str,
                                                                     tmp_path: Path) -> None:
    with Producer(redis_url) as p:
        p.create_topic("orders", queues=3)
        p.create_topic("orders-by-customer", queues=4)
        _, sent = _send_events(p, 1_000)
    # The example as it is, with a spec of this test's (its storage, its Redis, smaller micro-batches).
    shutil.copytree(EXAMPLE / "transformations", tmp_path / "transformations")
    spec = yaml.safe_load((EXAMPLE / "spark-pipeline.yml").read_text())
    spec["storage"] = (tmp_path / "storage").as_uri()
    spec["configuration"].update({"mqorder.redisUrl": redis_url, "mqorder.maxOffsetsPerTrigger": "50"})
    (tmp_path / "spark-pipeline.yml").write_text(yaml.safe_dump(spec))
    res = subprocess.run([str(spark_home() / "bin" / "spark-pipelines"), "run", "--spec",
                          str(tmp_path / "spark-pipeline.yml"), "--remote", connect_server.url],
                         env=spark_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]

    source = {(q, off): json.loads(body) for q, msgs in stored(redis_url, "orders").items()
              for off, _, _, body in msgs}
    per_customer: dict[str, list[int]] = defaultdict(list)
    per_order: dict[str, list[int]] = defaultdict(list)
    for _, msgs in sorted(stored(redis_url, "orders-by-customer").items()):
        for _, key, _, body in msgs:
            e = json.loads(body)
            src = source[(e["source"]["queue"], e["source"]["offset"])]
            assert {k: e[k] for k in src} == src and key == e["customer"]  # enriched, re-keyed
            assert e["amount_band"] == ("large" if e["amount"] >= 100 else "medium" if e["amount"] >= 20 else "small")
            per_customer[key].append(e["ts"])
            per_order[e["order_id"]].append(e["seq"])
    assert sum(len(v) for v in per_order.values()) == len(sent) == ORDERS * EVENTS  # nothing lost or twice
    assert all(seqs == list(range(1, EVENTS + 1)) for seqs in per_order.values())  # each order in order
    # Re-keyed: each customer holds exactly its orders' events (in ts order within a micro-batch;
    # across micro-batches, the source queues' offsets, not ts, decide what came first).
    expected: dict[str, list[int]] = defaultdict(list)
    for e in sent:
        expected[e["customer"]].append(e["ts"])
    assert {c: sorted(ts) for c, ts in per_customer.items()} == {c: sorted(ts) for c, ts in expected.items()}
    assert len(per_customer) == CUSTOMERS

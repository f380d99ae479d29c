"""The monitoring stack for real: Debian's ``prometheus`` binary scrapes ``mqorder exporter`` and two
prefork workers' metrics endpoints (real redis-server, real Celery workers), evaluates the shipped
alert rules, and the test reads everything back through Prometheus's HTTP API, as Grafana and
Alertmanager would.

A listener blocks one key (``fail:<key>`` in ``ctl:g-order``: it suspends that message at every
call, and ``MQORDER_MAX_RECONSUME_TIMES=-1`` keeps it out of the DLQ). The test proves that the
head age and the stalled time grow for exactly that queue, that ``MqorderQueueStalled`` fires for
exactly that queue and resolves once the key is released, and that every query of the Grafana
dashboard returns data.

The rules Prometheus loads are ``deploy/prometheus/alerts.yml`` with one documented change
(``scaled_rules``): ``MqorderQueueStalled``'s threshold and ``for:`` go from minutes to seconds
(``> 300`` becomes ``> 3``, ``1m`` becomes ``2s``), everything else as shipped. The dashboard's
``$__rate_interval`` becomes ``5m``, a window that spans the whole test, so rates and quantiles
see every message consumed since the workers started.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from mqorder import Producer
from mqorder.metrics import dashboard
from tests.support import ROOT, Cluster, body, wait_for
from tests.test_alert_rules import RULES, prometheus_tool
from tests.test_dashboard import substituted
from tests.test_metrics import free_port, scrape

GROUP, TOPIC, STUCK_KEY = "g-order", "t-order", "stuck"
#: MqorderQueueStalled, scaled from minutes to seconds for the test (see the module docstring).
STALLED_ALERT, STALLED_THRESHOLD, STALLED_FOR = "MqorderQueueStalled", ("> 300", "> 3"), "2s"

pytestmark = pytest.mark.e2e


def scaled_rules(source: Path, dest: Path) -> None:
    """``alerts.yml`` with ``MqorderQueueStalled`` scaled to seconds: the one transformation the
    test makes. A rule whose literal moved fails here, not silently unscaled."""
    doc = yaml.safe_load(source.read_text())
    rule = next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == STALLED_ALERT)
    before, after = STALLED_THRESHOLD
    assert rule["expr"].count(before) == 1, f"{STALLED_ALERT}: {before!r} not in {rule['expr']!r}"
    rule["expr"] = rule["expr"].replace(before, after)
    rule["for"] = STALLED_FOR
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))


class Prometheus:
    """A ``prometheus`` server on a free loopback port, its data in a temporary directory."""

    def __init__(self, tmp: Path, exporter: int, workers: list[int]) -> None:
        self.port = free_port()
        self.tmp = tmp
        scaled_rules(RULES, tmp / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(tmp / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "mqorder-exporter", "static_configs": [{"targets": [f"127.0.0.1:{exporter}"]}]},
                {"job_name": "mqorder-workers",
                 "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in workers]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [prometheus_tool("prometheus"), f"--config.file={self.tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        wait_for(self.ready, timeout=30, what=f"prometheus ready on :{self.port} (log: {self.log})")
        return self

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant query: each series' queue label (or its whole label set) -> value."""
        return {r["metric"].get("queue", json.dumps(r["metric"], sort_keys=True)): float(r["value"][1])
                for r in self.api("query", query=expr)["result"]}

    def alerts(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]


def start_exporter(cluster: Cluster) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mqorder.cli", "exporter", "--port", str(port), "--addr", "127.0.0.1"],
        env=cluster.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    return port, proc


def answers(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False


@pytest.fixture
def stack(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[Prometheus, Producer]]:
    """Two prefork workers with metrics endpoints, the exporter, and Prometheus scraping all three."""
    cluster.client.hset(f"ctl:{GROUP}", f"fail:{STUCK_KEY}", 1)
    producer = Producer(cluster.url)
    producer.create_topic(TOPIC, queues=4)
    ports = [free_port(), free_port()]
    workers = [cluster.start_worker(name, wait=False, MQORDER_METRICS_PORT=str(port), MQORDER_MAX_RECONSUME_TIMES="-1",
                                    MQORDER_LOCK_INTERVAL_MS="1000")
               for name, port in zip(("w1", "w2"), ports, strict=True)]
    exporter, exporter_proc = start_exporter(cluster)
    prometheus = Prometheus(tmp_path, exporter, ports)
    try:
        for w in workers:
            w.wait_registered(cluster.client, timeout=60)
        for port in (*ports, exporter):
            wait_for(lambda p=port: answers(p), timeout=30, what=f"metrics on :{port}")
        prometheus.start()
        yield prometheus, producer
    finally:
        prometheus.stop()
        exporter_proc.send_signal(signal.SIGTERM)
        exporter_proc.wait(timeout=20)
        producer.close()


def test_a_blocked_key_stalls_one_queue_fires_the_alert_resolves_and_every_panel_has_data(
    stack: tuple[Prometheus, Producer], r: redis.Redis,
) -> None:
    prom, producer = stack
    def targets_up() -> list[str]:
        targets = prom.api("targets")["activeTargets"]
        return sorted(t["labels"]["job"] for t in targets) if all(t["health"] == "up" for t in targets) else []

    jobs = wait_for(lambda: len(targets_up()) == 3 and targets_up(), timeout=30, what="every scrape target up")
    assert jobs == ["mqorder-exporter", "mqorder-workers", "mqorder-workers"]

    stuck = str(producer.send_orderly(TOPIC, body(STUCK_KEY, 1), sharding_key=STUCK_KEY).message_queue.queue_id)
    keys = [f"order-{i}" for i in range(40)]
    for seq in (1, 2, 3):
        producer.send_orderly_batch(TOPIC, [(k, body(k, seq)) for k in keys])
    lag = f'mqorder_queue_lag{{group="{GROUP}"}} > 0'
    wait_for(lambda: set(prom.query(lag)) == {stuck}, timeout=60,
             what=f"every queue but the stuck one ({stuck}) drained, seen by Prometheus")

    # Head age and stalled time grow, for exactly that queue.
    stalled = f'mqorder_queue_stalled_seconds{{group="{GROUP}"}} > 0'
    head_age = f'mqorder_queue_head_age_seconds{{group="{GROUP}"}} > 0'
    first = wait_for(lambda: (s := prom.query(stalled)).get(stuck, 0) > 1 and s, timeout=30, what="stalled > 1 s")
    assert set(first) == {stuck}
    first_age = prom.query(head_age)
    assert set(first_age) == {stuck}
    later = wait_for(lambda: (s := prom.query(stalled)).get(stuck, 0) > first[stuck] + 2 and s, timeout=30,
                     what="the stalled time growing")
    assert set(later) == {stuck}
    assert prom.query(head_age)[stuck] > first_age[stuck] + 2
    assert prom.query(f'mqorder_queue_head_retries{{group="{GROUP}",queue="{stuck}"}}')[stuck] >= 1

    # The (scaled) MqorderQueueStalled alert fires, for that queue alone.
    def firing() -> list[dict[str, Any]]:
        alerts = prom.alerts(STALLED_ALERT)
        return alerts if any(a["state"] == "firing" for a in alerts) else []

    alerts = wait_for(firing, timeout=30, what=f"{STALLED_ALERT} firing")
    assert [(a["labels"]["group"], a["labels"]["topic"], a["labels"]["queue"], a["labels"]["severity"])
            for a in alerts] == [(GROUP, TOPIC, stuck, "critical")]
    assert f"queue {TOPIC}:" in alerts[0]["annotations"]["summary"]
    assert f"mqorder status {GROUP} {TOPIC}" in alerts[0]["annotations"]["description"]

    # Every panel of the dashboard has data while the queue is stuck.
    empty = []
    for title, expr in dashboard.queries(dashboard.build()):
        values = prom.query(substituted(expr, group=GROUP, rate_interval="5m"))
        if not any(math.isfinite(v) for v in values.values()):
            empty.append(f"{title}: {expr} -> {values}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    # Released: the queue commits, stalled goes back to 0 and the alert resolves.
    r.hdel(f"ctl:{GROUP}", f"fail:{STUCK_KEY}")
    wait_for(lambda: not prom.query(lag) and not prom.query(stalled), timeout=60, what="the stuck queue drained")
    wait_for(lambda: not prom.alerts(STALLED_ALERT), timeout=30, what=f"{STALLED_ALERT} resolved")
    rules = [rule for g in prom.api("rules")["groups"] for rule in g["rules"] if rule["name"] == STALLED_ALERT]
    assert [rule["state"] for rule in rules] == ["inactive"]
    handled_stuck = [line for line in r.lrange(f"ledger:{GROUP}", 0, -1) if line.startswith(f"{STUCK_KEY}|".encode())]
    assert handled_stuck[-1].endswith(b"|S")  # the blocked message itself was finally handled

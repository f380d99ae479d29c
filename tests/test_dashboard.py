"""The Grafana dashboard (``deploy/grafana/dashboards/mqorder.json``) and its provisioning.

The committed JSON must be exactly what ``mqorder.metrics.dashboard`` builds (so nobody edits the
file and loses it at the next build), every query must be PromQL that Prometheus accepts (checked
offline: ``promtool check rules`` on a rules file made of the queries), and every metric it reads
must be one mqorder exports. That each query also returns data against a real Prometheus, exporter
and workers is tests/test_prometheus_stack.py's job.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mqorder.metrics import dashboard, names
from tests.support import ROOT
from tests.test_alert_rules import prometheus_tool

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "mqorder.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
#: What a query may use besides PromQL: the dashboard's variable and Grafana's rate window.
VARIABLES = {"${group:regex}", "$__rate_interval"}


def committed() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def grafana_regex(value: str) -> str:
    """Grafana's ``${var:regex}`` format of a single value (its ``regexEscape``)."""
    return re.sub(r"[\\^$*+?.()|[\]{}/]", lambda m: "\\" + m.group(0), value)


def substituted(expr: str, group: str = "g-order", rate_interval: str = "15s") -> str:
    """A query as Grafana sends it: ``${group:regex}`` and ``$__rate_interval`` replaced."""
    return expr.replace("$__rate_interval", rate_interval).replace("${group:regex}", grafana_regex(group))


def test_the_committed_json_is_the_generated_one() -> None:
    assert DASHBOARD.read_text() == dashboard.render(), (
        "deploy/grafana/dashboards/mqorder.json differs from mqorder.metrics.dashboard: regenerate it with "
        "`python -m mqorder.metrics.dashboard > deploy/grafana/dashboards/mqorder.json`"
    )


def test_panels_have_unique_ids_queries_and_do_not_overlap() -> None:
    panels = committed()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    taken: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert set(re.findall(r"\$\{\w+:\w+\}|\$\w+", t["expr"])) <= VARIABLES, (p["title"], t["expr"])


def test_every_group_panel_filters_on_the_group_variable() -> None:
    variables = {v["name"]: v for v in committed()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["group"]["definition"] == "label_values(mqorder_clients_live, group)"
    # The exporter's liveness and the workers' takeover counter have no group label; the rest do.
    ungrouped = {"mqorder_up", "mqorder_lock_takeovers_total"}
    for title, expr in dashboard.queries(committed()):
        if not set(re.findall(r"mqorder_\w+", expr)) <= ungrouped:
            assert "{group=~`${group:regex}(%BC%.+)?`}" in expr, (title, expr)  # broadcasting lanes too


def test_every_metric_read_is_one_mqorder_exports() -> None:
    exported = {s.name for s in (*names.WORKER, *names.EXPORTER)}
    exported |= {f"{s.name}_{part}" for s in names.WORKER if s.kind == "histogram" for part in ("bucket", "sum", "count")}
    used = {m for _, expr in dashboard.queries(committed()) for m in re.findall(r"mqorder_\w+", expr)}
    assert used - exported == set()
    # Issue 28's panels: lag in messages and seconds, throughput, latency, stalled, DLQ, owners, takeovers.
    for metric in ("mqorder_queue_lag", "mqorder_queue_head_age_seconds", "mqorder_consumed_messages_total",
                   "mqorder_message_latency_seconds_bucket", "mqorder_queue_stalled_seconds", "mqorder_dlq_messages",
                   "mqorder_queue_owner_info", "mqorder_queue_epoch"):
        assert metric in used, metric


def test_every_query_is_promql_that_prometheus_accepts(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": substituted(expr)}
        for i, (_, expr) in enumerate(dashboard.queries(committed()))
    ]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("bad", ["sum(mqorder_queue_lag{group=\"${group:regex}\"}", "rate(mqorder_queue_lag)"])
def test_the_promql_check_refuses_a_broken_query(tmp_path: Path, bad: str) -> None:
    """The check above is not vacuous: promtool rejects an unbalanced query and a rate of no range."""
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [{"record": "d:q", "expr": substituted(bad)}]}]}))
    done = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode != 0


def test_the_group_matcher_selects_exactly_the_group_and_its_broadcast_lanes(tmp_path: Path) -> None:
    """Group names may hold ``.`` and ``|``: ``$group`` in a regex matcher, not escaped by Grafana for a
    single value, made group ``a|b`` show group ``a``'s series too, and ``a.b`` group ``aXb``'s.
    Evaluated by Prometheus's own engine (``promtool test rules``) on series of neighbouring names."""
    groups = ["a|b", "a", "b", "a.b", "aXb", "a.b%BC%w1@h", "a.bc", "g-order"]
    expr = dashboard.G
    cases = {"a|b": ["a|b"], "a.b": ["a.b", "a.b%BC%w1@h"], "a": ["a"], "g-order": ["g-order"]}
    tests = [{"interval": "1m",
              "input_series": [{"series": f'mqorder_queue_lag{{group="{g}"}}', "values": "1"} for g in groups],
              "promql_expr_test": [
                  {"expr": f"count by (group) (mqorder_queue_lag{substituted(expr, group=name)})", "eval_time": "0m",
                   "exp_samples": [{"labels": f'{{group="{g}"}}', "value": 1} for g in want]}
                  for name, want in cases.items()]}]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": []}))
    (tmp_path / "matcher_test.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "tests": tests}))
    done = subprocess.run([prometheus_tool("promtool"), "test", "rules", "matcher_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_loads_the_dashboard_folder_from_the_compose_prometheus() -> None:
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(s["type"], s["url"], s["isDefault"]) for s in sources] == [("prometheus", "http://prometheus:9090", True)]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "mqorder.yml").read_text())["providers"]
    assert [(p["type"], p["options"]["path"]) for p in providers] == [("file", "/etc/grafana/dashboards")]

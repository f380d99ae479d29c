"""The mqorder Grafana dashboard, built from code: ``python -m mqorder.metrics.dashboard``.

Why code and not a JSON file edited in Grafana's UI: every query names its metrics through the
specs of ``mqorder.metrics.names`` (a renamed metric breaks the build, not a panel at 3 a.m.),
the layout is computed, and the committed ``deploy/grafana/dashboards/mqorder.json`` is this
module's output byte for byte (``tests/test_dashboard.py``), so a review reads a Python diff.
Regenerate after a change::

    python -m mqorder.metrics.dashboard > deploy/grafana/dashboards/mqorder.json

One dashboard answers issue 28's "is it stuck, and on what?" for one consumer group at a time
(the ``group`` template variable): how far behind (messages and seconds), how fast it moves,
end-to-end latency, which queues are stalled and why (head retries), dead letters, who owns each
queue at which fencing epoch, and takeovers. Queries use only ``${group:regex}``, ``$__rate_interval``
and the ``$datasource`` variable, so a test can run each of them against a real Prometheus.
Plain dicts, no Grafana SDK: the JSON model is stable and small enough to write directly.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from mqorder.metrics import names

UID = "mqorder-groups"
TITLE = "mqorder: consumer groups"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
#: Grafana's grid is 24 columns wide; panel heights are in grid rows (30 px).
WIDTH = 24

Panel = dict[str, Any]

# -- query helpers ------------------------------------------------------------------------------

#: The group's series: a broadcasting group's per-queue series are labelled with each client's
#: lane, ``<group>%BC%<client>`` (``mqorder.metrics.exporter``): matched too, or its panels were empty.
#: ``${group:regex}``: Grafana escapes a single-valued variable for a regex only in this format, and
#: group names may hold ``.`` and ``|`` (RocketMQ's charset), so ``$group`` of ``a|b`` also showed
#: group ``a``. Backquotes: PromQL takes the escaped value (``a\|b``) as it is, where a double-quoted
#: string refuses ``\|`` as an unknown escape.
G = '{group=~`${group:regex}(%BC%.+)?`}'
RATE = "[$__rate_interval]"
QUEUE_LEGEND = "{{topic}}:{{broker}}:{{queue}}"


def _bucket(spec: names.MetricSpec) -> str:
    assert spec.kind == "histogram", spec.name
    return f"{spec.name}_bucket"


def _quantile(q: float, spec: names.MetricSpec, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({_bucket(spec)}{G}{RATE})))"


def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> dict[str, Any]:
    """One Prometheus query of a panel (``refId`` is filled in by the panel)."""
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        t |= {"instant": True, "range": False}
    if table:
        t["format"] = "table"
    return t


# -- panel helpers ------------------------------------------------------------------------------


def _panel(kind: str, title: str, description: str, targets: list[dict[str, Any]], unit: str,
           **extra: Any) -> Panel:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "targets": targets, "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, **extra,
    }


def stat(title: str, description: str, expr: str, unit: str = "short", *,
         thresholds: tuple[float, float] | None = None) -> Panel:
    """A single figure, green / orange / red past ``thresholds``."""
    panel = _panel("stat", title, description, [target(expr)], unit,
                   options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "background", "graphMode": "area", "textMode": "auto"})
    if thresholds:
        steps = [{"color": "green", "value": None}, {"color": "orange", "value": thresholds[0]},
                 {"color": "red", "value": thresholds[1]}]
        panel["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": steps}
    return panel


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str = "short") -> Panel:
    return _panel("timeseries", title, description, targets, unit,
                  options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                           "tooltip": {"mode": "multi", "sort": "desc"}})


def table(title: str, description: str, targets: list[dict[str, Any]]) -> Panel:
    """Instant queries merged on their common labels (one row per queue)."""
    return _panel("table", title, description, targets, "short",
                  transformations=[{"id": "merge", "options": {}},
                                   {"id": "organize", "options": {"excludeByName": {"Time": True}}}])


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


# -- the dashboard ------------------------------------------------------------------------------


def panels() -> list[tuple[Panel, int, int]]:
    """Every panel with its width and height, in reading order (rows flow left to right)."""
    n = names
    by_queue = "topic, broker, queue"
    return [
        (row("Is it stuck?"), WIDTH, 1),
        (stat("Backlog", "Messages of the group not committed yet, all queues (mqorder_queue_lag).",
              f"sum({n.QUEUE_LAG.name}{G})"), 4, 4),
        (stat("Oldest waiting message", "Age of the oldest uncommitted message over the group's queues: "
              "the group's lag in time (MqorderQueueHeadOld fires past 15 minutes).",
              f"max({n.QUEUE_HEAD_AGE.name}{G})", "s", thresholds=(300, 900)), 4, 4),
        (stat("Stalled queues", "Queues with a backlog whose committed offset has not moved for over a "
              "minute (mqorder_queue_stalled_seconds > 60; a busy queue is a few ms behind at any scrape); "
              "MqorderQueueStalled fires after 5 minutes.",
              f"sum({n.QUEUE_STALLED.name}{G} > bool 60)", thresholds=(1, 1)), 4, 4),
        (stat("Dead letters", "Messages in %DLQ%<group> (`mqorder dlq list GROUP`).",
              f"sum({n.DLQ_MESSAGES.name}{G})", thresholds=(1, 100)), 4, 4),
        (stat("Live workers", "Consumer clients with a live heartbeat subscribed to the group.",
              f"sum({n.CLIENTS_LIVE.name}{G})"), 4, 4),
        (stat("Exporter up", "1 if the exporter read Redis at its last scrape (mqorder_up).",
              f"min({n.UP.name})"), 4, 4),

        (row("How far behind"), WIDTH, 1),
        (timeseries("Lag (messages) by queue", "Max offset - committed offset, per queue.",
                    [target(f"sum by ({by_queue}) ({n.QUEUE_LAG.name}{G})", QUEUE_LEGEND)]), 12, 8),
        (timeseries("Lag (seconds): head age by queue",
                    "How long each queue's oldest uncommitted message has waited (0 when caught up).",
                    [target(f"max by ({by_queue}) ({n.QUEUE_HEAD_AGE.name}{G})", QUEUE_LEGEND)], "s"), 12, 8),

        (row("How fast it moves"), WIDTH, 1),
        (timeseries("Throughput", "Produced (max offsets of the group's queues), committed (the group's "
                    "offsets, from the exporter) and handed to listeners by result (from the workers: ok, "
                    "suspended, dlq).",
                    [target(f"sum by (topic) (rate({n.QUEUE_MAX_OFFSET.name}{RATE}) and on (topic, broker, queue) "
                            f"{n.QUEUE_LAG.name}{G})", "produced {{topic}}"),
                     target(f"sum by (topic) (rate({n.QUEUE_COMMITTED_OFFSET.name}{G}{RATE}))", "committed {{topic}}"),
                     target(f"sum by (topic, result) (rate({n.CONSUMED.name}{G}{RATE}))", "{{result}} {{topic}}")],
                    "ops"), 12, 8),
        (timeseries("End-to-end latency", "From a message's born time (producer clock) to the start of each "
                    "listener call of it (retries included): percentiles over all workers.",
                    [target(_quantile(q, n.MESSAGE_LATENCY), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
                    "s"), 12, 8),
        (timeseries("Listener call time", "Time of one listener call (mqorder_consume_duration_seconds).",
                    [target(_quantile(q, n.CONSUME_DURATION), f"p{round(q * 100)}") for q in (0.5, 0.99)],
                    "s"), 12, 8),
        (timeseries("ConsumeRequest runs by outcome", "Runs that reached the engine, by verb: IDLE "
                    "(drained), REQUEUE (suspend or time budget), HANDOVER / DISPATCH, FENCED, STALE / BUSY.",
                    [target(f"sum by (verb) (rate({n.RUNS.name}{G}{RATE}))", "{{verb}}")], "ops"), 12, 8),

        (row("Stalled queues, and why"), WIDTH, 1),
        (timeseries("Stalled time by queue", "How long each queue has had a backlog without a commit (0 "
                    "when it moves or is caught up).",
                    [target(f"max by ({by_queue}) ({n.QUEUE_STALLED.name}{G})", QUEUE_LEGEND)], "s"), 12, 8),
        (timeseries("Head retries by queue", "Reconsume count of each queue's head message: above 0, the "
                    "listener keeps suspending it (a poison message or a failing dependency).",
                    [target(f"max by ({by_queue}) ({n.QUEUE_HEAD_RETRIES.name}{G})", QUEUE_LEGEND)]), 12, 8),

        (row("Dead letters and ownership"), WIDTH, 1),
        (timeseries("Dead letters over time", "Messages stored in %DLQ%<group>.",
                    [target(f"sum({n.DLQ_MESSAGES.name}{G})", "DLQ")]), 8, 8),
        (timeseries("Takeovers", "Queues of the group that changed owner (a new fencing epoch each), and "
                    "all locks moved by the workers' rebalances (every group).",
                    [target(f"sum by (topic) (changes({n.QUEUE_EPOCH.name}{G}{RATE}))", "{{topic}}"),
                     target(f"sum(increase({n.LOCK_TAKEOVERS.name}{RATE}))", "all groups (workers)")]), 8, 8),
        (timeseries("Live workers over time", "Consumer clients with a live heartbeat subscribed to the group.",
                    [target(f"sum({n.CLIENTS_LIVE.name}{G})", "clients")]), 8, 8),
        (table("Owners and epochs", "Who holds each queue's lock now, at which fencing epoch, and whether "
               "a ConsumeRequest runs on it. No owner: nobody holds a live lock.",
               [target(f"max by ({by_queue}, owner) ({n.QUEUE_OWNER.name}{G})", instant=True, table=True),
                target(f"max by ({by_queue}) ({n.QUEUE_EPOCH.name}{G})", instant=True, table=True),
                target(f"max by ({by_queue}) ({n.QUEUE_RUNNING.name}{G})", instant=True, table=True)]), WIDTH, 8),
    ]


def _layout(items: list[tuple[Panel, int, int]]) -> list[Panel]:
    """Place panels left to right, wrapping at 24 columns; ids in reading order."""
    out, x, y, line_height = [], 0, 0, 0
    for i, (panel, w, h) in enumerate(items, start=1):
        if x + w > WIDTH:
            x, y, line_height = 0, y + line_height, 0
        out.append({"id": i, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel})
        x, line_height = x + w, max(line_height, h)
    return out


def template_variables() -> list[dict[str, Any]]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "group", "label": "Consumer group", "type": "query", "datasource": DATASOURCE,
         "query": {"query": f"label_values({names.CLIENTS_LIVE.name}, group)", "refId": "groups"},
         "definition": f"label_values({names.CLIENTS_LIVE.name}, group)",
         "current": {}, "hide": 0, "refresh": 2, "sort": 1, "multi": False, "includeAll": False},
    ]


def build() -> dict[str, Any]:
    """The dashboard's JSON model (Grafana 10/11, schemaVersion 39)."""
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Per consumer group: lag in messages and seconds, throughput, end-to-end latency, "
                       "stalled queues, dead letters, owners, epochs and takeovers (docs/ALERTS.md).",
        "tags": ["mqorder"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {"list": template_variables()},
        "annotations": {"list": []},
        "links": [],
        "panels": _layout(panels()),
    }


def render() -> str:
    """The committed file's exact text."""
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of ``dashboard``, template variables left in."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


if __name__ == "__main__":
    sys.stdout.write(render())

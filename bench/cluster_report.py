"""The ``cluster`` section of RESULTS.md and the figures its targets judge (``bench.cluster``'s runs).

Per run and store: the drain's rate, and per node its CPU, command calls and reads (requests read
from clients: a pipeline or a packed round trip is one read, so reads per message is the client
round trips per message as the server saw them). From these:

* Redis CPU per message, summed over the nodes, cluster / single node per run (run i of both back
  to back): the target;
* per command, calls per message summed over the shards / the single node's: a command sent to
  every shard for each message would show ~3x; routed by slot, ~1x (the fan-out target);
* per shard, its share of the commands against its share of the messages;
* the projection: a shard saturates at one core, so a shard serves 1e6 / (its CPU µs per message)
  messages a second, and N shards N times that if the queues spread evenly.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.cluster import KINDS, LABELS
from bench.common import measured_note, summarize
from bench.targets import threshold

#: Commands below this many calls per message on both sides are left out of the fan-out check.
FANOUT_MIN_CALLS = 0.005
#: Shard counts of the projection.
PROJECTED_SHARDS = (1, 3, 6, 12)


def _sum(run: dict[str, Any], field: str, phase: str = "nodes") -> float:
    return float(sum(n[field] for n in run[phase]))


def cpu_us(run: dict[str, Any], phase: str = "nodes") -> float:
    """Redis CPU µs per message, summed over the store's nodes."""
    return _sum(run, "cpu_s", phase) / run["messages"] * 1e6


def per_msg(run: dict[str, Any], field: str, phase: str = "nodes") -> float:
    return _sum(run, field, phase) / run["messages"]


def _runs(res: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return list((res.get("runs") or {}).get(kind) or [])


def _ratios(res: dict[str, Any], kind: str, figure: Callable[[dict[str, Any]], float]) -> list[float]:
    """``figure`` of ``kind`` / the single node's, per run (the drains of a run one after the other)."""
    single = {r["run"]: figure(r) for r in _runs(res, "single")}
    return [figure(r) / single[r["run"]] for r in _runs(res, kind) if single.get(r["run"])]


def cpu_ratios(res: dict[str, Any], kind: str = "cluster") -> list[float]:
    """Redis CPU per message of ``kind`` (summed over its nodes) / the single node's, per run."""
    return _ratios(res, kind, cpu_us)


def command_ratios(res: dict[str, Any], kind: str = "cluster") -> list[float]:
    """Commands per message of ``kind`` (summed over its nodes) / the single node's, per run."""
    return _ratios(res, kind, lambda r: per_msg(r, "commands"))


def _calls_per_msg(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per command: calls per message summed over the nodes, median over runs (0 in a run without it)."""
    per_run: dict[str, list[float]] = {}
    for i, r in enumerate(runs):
        for n in r["nodes"]:
            for cmd, c in n["calls"].items():
                per_run.setdefault(cmd, [0.0] * len(runs))[i] += c / r["messages"]
    return {cmd: statistics.median(v) for cmd, v in per_run.items()}


def command_fanout(res: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Per command run at least ``FANOUT_MIN_CALLS`` times per message on either side: (single node's
    calls per message, the cluster's summed over shards, their ratio), medians over runs; a command
    the single node never ran has ratio inf."""
    single, cluster = _calls_per_msg(_runs(res, "single")), _calls_per_msg(_runs(res, "cluster"))
    out = {}
    for cmd in sorted(set(single) | set(cluster)):
        s, c = single.get(cmd, 0.0), cluster.get(cmd, 0.0)
        if max(s, c) >= FANOUT_MIN_CALLS:
            out[cmd] = (s, c, c / s if s else float("inf"))
    return out


def _shard_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in _runs(res, "cluster"):
        msgs, cmds, reads = r["messages"], _sum(r, "commands"), _sum(r, "reads")
        for i, n in enumerate(r["nodes"]):
            own = max(1, n["messages"])
            rows.append([str(r["run"]), f"{i} (:{n['port']})", str(n["queues"]), f"{n['messages'] / msgs:.0%}",
                         f"{n['commands'] / cmds:.0%}", f"{n['reads'] / reads:.0%}",
                         f"{n['commands'] / own:.3f}", f"{n['cpu_s'] / own * 1e6:.2f} µs",
                         f"{n['cpu_s'] / r['seconds']:.0%}"])
    return rows


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows),
            ""]


def _drain_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k in KINDS:
        rr = _runs(res, k)
        if not rr:
            continue
        ratios = cpu_ratios(res, k) if k != "single" else []
        rows.append([LABELS[k], summarize(r["rate"] for r in rr).fmt(0, "msg/s"),
                     summarize(cpu_us(r) for r in rr).fmt(2, "µs"),
                     f"{_median(ratios):.2f}x" if ratios else "1",
                     summarize(per_msg(r, "commands") for r in rr).fmt(3),
                     summarize(per_msg(r, "reads") for r in rr).fmt(4),
                     summarize(max(n["cpu_s"] for n in r["nodes"]) / r["seconds"] * 100 for r in rr).fmt(0, "%"),
                     summarize(r["worker_cpu_s"] / r["messages"] * 1e6 for r in rr).fmt(1, "µs")])
    return rows


def _produce_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k in KINDS:
        rr = _runs(res, k)
        if rr:
            rows.append([LABELS[k], summarize(r["produce_rate"] for r in rr).fmt(0, "msg/s"),
                         summarize(cpu_us(r, "produce_nodes") for r in rr).fmt(2, "µs"),
                         summarize(per_msg(r, "commands", "produce_nodes") for r in rr).fmt(3),
                         summarize(per_msg(r, "reads", "produce_nodes") for r in rr).fmt(4)])
    return rows


def _projection(res: dict[str, Any]) -> list[str]:
    """Projected Redis-bound ceilings for N shards, from the CPU per message measured."""
    single = [cpu_us(r) for r in _runs(res, "single")]
    one = [cpu_us(r) for r in _runs(res, "cluster1")]
    cl = _runs(res, "cluster")
    if not cl:
        return []
    mean = _median([cpu_us(r) for r in cl])
    worst = _median([max(n["cpu_s"] / max(1, n["messages"]) for n in r["nodes"]) * 1e6 for r in cl])
    rows = []
    if single:
        rows.append(["1, plain redis-server (no cluster mode)", f"{_median(single):.2f} µs", f"{1e6 / _median(single):,.0f}",
                     ""])
    if one:
        rows.append(["1, one-node cluster (measured)", f"{_median(one):.2f} µs", f"{1e6 / _median(one):,.0f}", ""])
    for n in PROJECTED_SHARDS:
        rows.append([f"{n} (projected)", f"{mean:.2f} µs", f"{n * 1e6 / mean:,.0f}", f"{n * 1e6 / worst:,.0f}"])
    worker_us = _median([r["worker_cpu_s"] / r["messages"] * 1e6 for r in cl])
    out = ["Projected Redis-bound throughput for N shards:", ""]
    out += _table(["shards", "Redis CPU per message (3-shard median)", "projected ceiling, msg/s (queues spread "
                  "evenly)", "if every shard were the costliest measured"], rows)
    out += [f"A shard saturates at one core: it serves 1,000,000 / (its CPU µs per message) messages a second, and N "
            "shards N times that when a topic's queues spread evenly over them (16 queues over 3 shards by hash "
            "slot split as the per-shard table shows; more queues per topic even it out). The CPU per message is "
            "the 3-shard cluster's (Redis CPU summed over the shards / messages); the last column uses the "
            f"costliest shard's CPU per message of its own queues ({worst:.2f} µs, median over runs). Two caveats "
            "make this a projection, not a measurement: a saturated Redis reads more requests per event-loop turn, "
            "so its CPU per message at one core is usually *lower* than at the loads measured here; and the "
            f"workers must scale with it (they used {worker_us:.1f} µs of CPU per message here, so 1,000,000 "
            f"msg/s needs about {worker_us:.0f} worker cores).", ""]
    return out


def markdown(res: dict[str, Any]) -> list[str]:
    """The section of RESULTS.md."""
    out = [f"## Redis Cluster: single node vs a {res.get('masters', 3)}-shard cluster (issue 26)", ""]
    if not res or not _runs(res, "cluster"):
        return out
    out += measured_note(res)
    out += _table(["drain, consume batch 32", "messages/s", "Redis CPU per message (all nodes)", "CPU vs single node",
                   "commands per message", "reads per message (client round trips)", "busiest node busy",
                   "worker CPU per message"], _drain_rows(res))
    ratios = cpu_ratios(res)
    limit = threshold("cluster_redis_cpu")
    med = _median(ratios)
    verdict = "met" if med <= limit else "NOT met"
    one = cpu_ratios(res, "cluster1")
    out += [f"Redis CPU per message, {res.get('masters', 3)}-shard cluster (sum over shards) / single node, per run: "
            f"{', '.join(f'{x:.2f}x' for x in ratios)}; median **{med:.2f}x** (target ≤ {limit:.1f}x: **{verdict}**)."
            + (f" The one-node cluster (every slot on one node: Redis's cluster mode and mqorder's cluster path, "
               f"without sharding): {', '.join(f'{x:.2f}x' for x in one)}, median {_median(one):.2f}x; what lies "
               "between the two is the cost of spreading the queues over shards." if one else ""), ""]
    out += _idle_lines(res)
    out += [f"2 stock workers prefork -c {res['concurrency']}, consume batch 32, pull 32, drain a "
            f"{res['messages']:,}-message backlog over {res['queues']} queues and 2,000 keys (no-op listener), "
            "measured as in the throughput section, on fresh workers each run; the stores run side by side and are "
            "drained in turn, run by run, the order rotating. Celery's broker is a plain redis-server of its own for "
            "every store (kombu cannot use a cluster), so the store's nodes serve mqorder alone. Per node: CPU from "
            "`INFO cpu` (user + system), commands from `INFO commandstats` (commands run inside scripts included), "
            "reads from `INFO stats` `total_reads_processed` (one per request or pipeline read from a client: the "
            "round trips as the server saw them), all reset before the drain; the benchmark's own lag poll (a GET "
            f"and an HGET per queue every {res['poll_s'] * 1000:.0f} ms, one pipeline per node) is taken out of the "
            "counts, not of the CPU. \"Busiest node busy\": the CPU of the busiest node over the drain's wall "
            "time. Medians of runs (min–max).", ""]
    out += ["Per shard (each run's topic is new, so its 16 queues fall on the shards anew):", ""]
    out += _table(["run", "shard", "queues", "share of messages", "share of commands", "share of reads",
                   "commands per message of its queues", "CPU per message of its queues", "busy"], _shard_rows(res))
    out += _fanout_lines(res)
    out += _projection(res)
    out += ["This machine has 2 cores shared by the shards, both workers (2 pool processes each), Celery's broker "
            "and the driver, so the cluster's measured throughput is bound by the workers and the machine's CPU, "
            "not by the shards: no shard was near one core (the busy columns). The figures that carry over to a "
            "real cluster are the per-message ones.", ""]
    out += ["Producing the backlog (`send_orderly_batch` in chunks of 10,000, one client, before each drain):", ""]
    out += _table(["store", "send rate", "Redis CPU per message (all nodes)", "commands per message",
                   "reads per message"], _produce_rows(res))
    return out


def _idle_lines(res: dict[str, Any]) -> list[str]:
    parts = []
    for k in KINDS:
        rr = [r for r in _runs(res, k) if r.get("idle")]
        if not rr:
            continue
        idle = _median([sum(n["cpu_s"] for n in r["idle"]) / r["idle_s"] * 1000 for r in rr])
        share = _median([sum(n["cpu_s"] for n in r["idle"]) / r["idle_s"] * r["seconds"] / _sum(r, "cpu_s")
                         for r in rr])
        parts.append(f"{LABELS[k]} {idle:.1f} ms/s ({share:.0%} of its drain's Redis CPU)")
    if not parts:
        return []
    return [f"Redis CPU with the workers idle (subscribed, no messages; {rr[0]['idle_s']:.0f} s before each measured "
            f"backlog), all nodes: {'; '.join(parts)}. The cluster's share includes its nodes' cluster bus and "
            "cron; it is in the per-message figures above, as it is in production at this load.", ""]


def _fanout_lines(res: dict[str, Any]) -> list[str]:
    fan = command_fanout(res)
    ratios = command_ratios(res)
    if not fan or not ratios:
        return []
    rows = [[f"`{cmd.upper()}`", f"{s:.4f}", f"{c:.4f}", f"{c - s:+.4f}", "only on the cluster" if s == 0 else
             f"{c / s:.2f}x"] for cmd, (s, c, _) in sorted(fan.items(), key=lambda kv: -kv[1][1])]
    limit = threshold("cluster_commands")
    med = _median(ratios)
    more = [cmd.upper() for cmd, (s, c, ratio) in fan.items() if ratio > 1.5]
    fewer = [cmd.upper() for cmd, (s, c, ratio) in fan.items() if ratio < 0.5]
    out = ["Commands per message, single node vs the cluster summed over its shards (medians of runs; commands run "
           f"at least {FANOUT_MIN_CALLS} times per message on either side). A command sent to every shard for each "
           f"message would add {res.get('masters', 3) - 1} calls per message; routed by its key's slot, it keeps its "
           "count:", ""]
    out += _table(["command", "single node, per message", "cluster (sum over shards), per message", "difference",
                   "cluster / single"], rows)
    out += [f"All commands, cluster / single node, per run: {', '.join(f'{x:.2f}x' for x in ratios)}; median "
            f"**{med:.2f}x** (target ≤ {limit:.1f}x: **{'met' if med <= limit else 'NOT met'}**)."
            + (f" Commands whose count grows by more than 1.5x: {', '.join(f'`{c}`' for c in more)} (the difference "
               "column says how many calls per message that is)." if more else "")
            + (f" Commands the cluster runs less than half as often: {', '.join(f'`{c}`' for c in fewer)}." if fewer
               else ""), "",
            "On a Redis Cluster store a lingering read watches its own queue only (one blocking read cannot span "
            "the slots of several queues), so no client adopts idle queues and the \"queue went idle\" nudges (an `XADD` to the client's nudge stream when a run ends without lingering) are not sent: "
            "the cluster's runs do that much less work.", ""]
    return out

"""Writes ``docs/RELIABILITY.md`` from the checker's results (never typed by hand).

The figures of every scenario are also kept, as JSON, in a comment at the end of the file, so a
run of some scenarios (``--scenario NAME``) updates their rows and keeps the others.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from chaos.checker import BEAT_OUTAGE_MAX_GAP, DUP_WINDOW, FSYNC_WINDOW, POISON_SLACK, Result
from chaos.failover_checks import REDIS_FAILOVER_TARGET, REPLICATION_WINDOW
from chaos.listeners import GROUP

DOC = Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md"
MARK = "chaos-results:"
ORDER = ["kill", "kill-rabbitmq", "sigstop", "sigstop-lease", "sigstop-child", "kill-child", "redis-always", "redis-everysec", "churn",
         "lost-tasks", "lost-tasks-rabbitmq", "poison", "beat", "all"]
#: The Sentinel rows, then the Redis Cluster rows, come last, after every single-Redis row (sorted
#: by name), in this order.
LAST = ["sentinel-failover", "sentinel-pause", "sentinel-async", "sentinel-missed-grant",
        "cluster-kill", "cluster-failover", "cluster-reshard"]


def engine_version() -> str:
    """The commit the engine was run from, ``+dirty`` if ``mqorder/`` had uncommitted changes."""
    root = DOC.parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "mqorder"], cwd=root,
                               timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


def compact(r: Result, *, title: str, env: dict[str, str], quick: bool, seconds: float,
            engine: str = "", sentinel: dict[str, str] | None = None,
            cluster: dict[str, str] | None = None) -> dict[str, Any]:
    """What the report shows of one result (lists cut to a few examples). ``sentinel``,
    ``cluster``: the settings of a Sentinel scenario's deployment (``SentinelSpec.describe``) or of
    a cluster scenario's (``ClusterSpec.describe``)."""
    return {
        "scenario": r.scenario, "title": title, "env": env, "fsync": r.fsync, "quick": quick, "engine": engine,
        **({"sentinel": sentinel} if sentinel is not None else {}),
        **({"cluster": cluster} if cluster is not None else {}),
        "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(seconds),
        "produced": r.produced, "unknown_sends": r.unknown_sends, "handled": r.handled,
        "faults": r.faults, "fault_kinds": r.fault_kinds,
        "violations": len(r.violations), "violation_examples": r.violations[:3],
        "lost": len(r.lost), "lost_examples": r.lost[:3], "lost_fsync": len(r.lost_fsync),
        "fsync_gaps": r.fsync_gaps,
        "duplicates": r.duplicates, "dup_redeliveries": r.dup_redeliveries, "dup_copies": r.dup_copies,
        "dup_unexplained": len(r.dup_unexplained), "dup_max_per_fault_queue": r.dup_max_per_fault_queue,
        "dup_by_fault": r.dup_by_fault,
        "overlaps": r.overlaps, "overlaps_allowed": r.overlaps_allowed,
        "overlaps_forbidden": len(r.overlaps_forbidden),
        "stale_calls": r.stale_calls, "stale_saw_stale_epoch": r.stale_saw_stale_epoch,
        "stale_asked_before_replaced": r.stale_asked_before_replaced,
        "stale_commit_refused": r.stale_commit_refused, "stale_refused_own_run": r.stale_refused_own_run,
        "refusals": r.refusals, "calls_after_refusal": len(r.calls_after_refusal),
        "failovers": len(r.failovers), "failover_max": r.failover_max, "failover_p99": r.failover_p99,
        "failover_values": sorted(r.failovers),
        "sigstop_takeovers": r.takeovers_after_sigstop,
        "epoch_double_owner": len(r.epoch_double_owner), "offset_backward": len(r.offset_backward),
        "max_stall": r.max_stall, "redis_recovery": r.redis_recovery, "tasks_stolen": r.tasks_stolen, "long_stalls": r.long_stalls[:12], "long_stall_count": len(r.long_stalls),
        "lost_task_recovery": sorted(r.lost_task_recovery), "child_kill_recovery": sorted(r.child_kill_recovery), "crashes": r.crashes, "poison": r.poison, "beat": r.beat, "notes": r.notes[:5],
        "problems": r.problems, "passed": r.passed,
        **_failover_fields(r),
    }


def group_title(title: str, r: Result, group: str = "") -> str:
    """The title of a row of a run with several consumer groups (``groups-kill``), which has a row
    per group: the scenario's own row holds the chaos group's figures and the verdict of every
    group (the others' problems are its own too, ``checker.merge_groups``); ``<scenario>/<group>``
    rows hold another group's figures. A run of the chaos group alone keeps its title."""
    if group:
        return f"{title}; this row: group {group}'s calls"
    if r.groups:
        return f"{title}; this row: group {GROUP}'s calls, failing if any group's check failed"
    return title


def _failover_fields(r: Result) -> dict[str, Any]:
    """The Redis failover figures, only in the results of runs that had some (older results and
    single-Redis rows carry none)."""
    if not (r.redis_failover_events or r.lost_replication or r.fence or r.same_epoch_overlaps):
        return {"same_epoch_overlaps": r.same_epoch_overlaps, "unknown_by_reason": r.unknown_by_reason}
    return {
        "same_epoch_overlaps": r.same_epoch_overlaps, "failover_overlaps": r.failover_overlaps,
        "unknown_by_reason": r.unknown_by_reason, "lost_replication": len(r.lost_replication),
        "lost_replication_examples": r.lost_replication[:3], "replication_gaps": r.replication_gaps,
        "dup_failover": r.dup_failover, "redis_failover_events": r.redis_failover_events,
        "redis_failovers": sorted(r.redis_failovers), "redis_failover_p99": r.redis_failover_p99,
        "redis_pause_takeovers": sorted(r.redis_pause_takeovers), "fence": r.fence,
    }


def _load(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    m = re.search(r"<!-- " + MARK + r" (.*?) -->", path.read_text(), re.S)
    if not m:
        return {}
    try:
        return json.loads(m.group(1))
    except json.JSONDecodeError:
        return {}


def _many(values: list[float]) -> str:
    """A list of seconds: all of them when short, else min / median / max."""
    v = sorted(values)
    if len(v) <= 24:
        return ", ".join(f"{t:.2f}" for t in v)
    return f"{len(v)} values, min {v[0]:.2f}, median {v[len(v) // 2]:.2f}, max {v[-1]:.2f}"


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _p99(t: list[float]) -> float:
    """Nearest-rank p99 of a non-empty list (the checker's ``Result.pct``)."""
    return sorted(t)[max(0, -(-99 * len(t) // 100) - 1)]


def _row(d: dict[str, Any]) -> str:
    fo_max, fo_p99 = _s(d["failover_max"]), _s(d["failover_p99"])
    if d["failovers"] == 0 and d["sigstop_takeovers"]:
        t = d["sigstop_takeovers"]
        fo_max = f"{max(t):.2f}†"
        fo_p99 = f"{_p99(t):.2f}†"
    redis_fo = d.get("redis_failovers") or d.get("redis_pause_takeovers")
    if d["failovers"] == 0 and redis_fo:
        fo_max, fo_p99 = f"{max(redis_fo):.2f}‡", f"{_p99(redis_fo):.2f}‡"
    windowed = str(d["lost_fsync"])
    if d.get("lost_replication"):
        windowed = f"{d['lost_fsync'] + d['lost_replication']} (replication)"
    dups = f"{d['duplicates']} ({d['dup_redeliveries']} r / {d['dup_copies']} c / {d['dup_unexplained']} u)"
    overl = f"{d['overlaps']} ({d['overlaps_forbidden']} forbidden)"
    name = d["scenario"] + (" (quick)" if d["quick"] else "")
    return (
        f"| {name} | {d['produced']:,} | {d['handled']:,} | {d['faults']} | {d['violations']} | {d['lost']} | "
        f"{windowed} | {dups} | {d['dup_max_per_fault_queue']} | {overl} | {fo_max} | {fo_p99} | "
        f"{'pass' if d['passed'] else '**FAIL**'} |"
    )


def _refusals(d: dict[str, Any]) -> str:
    """The refusal records of a result (a result written before they existed had log lines)."""
    if "refusals" not in d:
        return f"'commit refused' log lines: {d.get('refused_log_lines', 0)}"
    by = ", ".join(f"{k} {n}" for k, n in d["refusals"].items()) or "none"
    own = d.get("stale_refused_own_run")
    return (f"refused commits recorded by the engine's hook: {by}"
            + (f"; stale calls whose own run was refused: {own}" if own is not None else ""))


def _redis_failover(d: dict[str, Any]) -> list[str]:
    """The lines of a Sentinel (or cluster failover) scenario: each failover, the losses and
    redeliveries it explains, the fence."""
    out = []
    cluster = bool(d.get("cluster"))
    for i, e in enumerate(d.get("redis_failover_events") or []):
        never = f"; **never resumed**: queues {e['never']}" if e.get("never") else ""
        who = "the cluster's promoted replica served the shard's slots" if cluster else "Sentinel's new primary answered"
        out.append(f"- {e['kind']} {i + 1} of {e['node']}: {who} after {_s(e['promoted_s'])} s, "
                   f"the first acknowledged send after {_s(e['send_resumed_s'])} s, and all {e['queues']} queues "
                   f"{'of the shard ' if cluster else ''}had a listener call again within "
                   f"{_s(e['resumed_max_s'])} s{never}")
    if d.get("redis_failovers"):
        out.append(f"- consumption resumed after a kill of the primary, per queue per kill: {_many(d['redis_failovers'])} s "
                   f"(p99 {_s(d.get('redis_failover_p99'))} s, target {REDIS_FAILOVER_TARGET:.0f} s)")
    if d.get("redis_pause_takeovers"):
        out.append(f"- consumption resumed after a SIGSTOP of the primary, per queue: {_many(d['redis_pause_takeovers'])} s")
    if d.get("lost_replication") is not None:
        out.append(f"- acknowledged sends lost in a failover's loss window: {d['lost_replication']} (key gaps they left: "
                   f"{d.get('replication_gaps', 0)}); redeliveries of messages handled in a loss window (their "
                   f"commits lost with the primary): {d.get('dup_failover', 0)}; overlapping pairs of two epochs "
                   f"right after a failover: {d.get('failover_overlaps', 0)}; at one epoch: "
                   f"{d.get('same_epoch_overlaps', 0)}")
    f = d.get("fence") or {}
    if f:
        ref = ", ".join(f"{k} {n}" for k, n in f.get("refusals_after", {}).items()) or "none"
        line = (f"- fence: {f['new_epochs']} epochs first used on a queue after a promotion, "
                f"{f['below_count']} of them at or below an epoch used before the failover; epochs used by two "
                f"clients: {len(f.get('two_clients', []))}; refusals after the first failover: {ref}")
        if f.get("lost_grants"):
            line += (f"; lock grants the promoted replica lacked: {f['lost_grants']}, back in the lock table after "
                     f"the promotion: {len(f.get('reappeared', []))} (so no commit under them could pass the fence, "
                     f"which compares the caller's epoch with the table's), commits refused FENCED at a lost epoch: "
                     f"{f['lost_holders_fenced']}, listener calls under a lost epoch after the promotion: "
                     f"{f['lost_holder_calls']}; the replica also lacked the commits of {f['lost_commits']} queue(s) "
                     f"and {f['lost_appends']} appended message(s)")
            if not f["lost_holders_fenced"]:
                line += (" (a run cut by the failover ends at its first Redis error and starts again through "
                         "`begin.lua`, which judges the lock on the new primary: the lost holders' old commits were "
                         "never sent)")
        out.append(line)
    return out


def _details(d: dict[str, Any]) -> list[str]:
    env = ", ".join(f"`{k}={v}`" for k, v in d["env"].items()) or "defaults"
    topology = d.get("sentinel") or d.get("cluster")
    if topology:
        # Sorted: a result reloaded from the JSON comment has its keys sorted, a fresh one not.
        env = ", ".join(f"{k} {v}" for k, v in sorted(topology.items())) + ("; " + env if d["env"] else "")
    kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(d["fault_kinds"].items()))
    out = [
        f"### {d['scenario']}: {d['title']}",
        "",
        f"- run {d['date']}, {d['seconds']} s{' (quick)' if d['quick'] else ''}, engine "
        f"`{d.get('engine') or 'unknown'}`; `appendfsync {d['fsync']}`; "
        f"settings: {env}",
        f"- faults: {kinds or 'none'}; sends that raised (unknown, retried): {d['unknown_sends']}"
        + (f" ({', '.join(f'{k} {n}' for k, n in d['unknown_by_reason'].items())})" if d.get("unknown_by_reason")
           else "")
        + (f"; ConsumeRequest tasks taken from the broker: {d['tasks_stolen']}" if d.get("tasks_stolen") else ""),
        *([f"- seconds from a queue's last lost task to its next listener call: {_many(d['lost_task_recovery'])}"]
          if d.get("lost_task_recovery") else []),
        *([f"- seconds from its pool processes' kill to each queue's next listener call: "
           f"{_many(d['child_kill_recovery'])}"] if d.get("child_kill_recovery") else []),
        f"- duplicates: {d['dup_redeliveries']} redeliveries after a fault (at most {d['dup_max_per_fault_queue']} "
        f"on one queue after one fault), {d['dup_copies']} second stored copies of sends that raised, "
        f"{d['dup_unexplained']} unexplained"
        + (f"; redeliveries per fault: {', '.join(f'{k}: {v}' for k, v in d['dup_by_fault'].items())}"
           if d.get("dup_by_fault") else ""),
        f"- overlapping listener calls on one queue: {d['overlaps']} pairs, {d['overlaps_allowed']} under a stale "
        f"epoch whose commit was refused, {d['overlaps_forbidden']} forbidden; stale calls (started after a newer "
        f"epoch was in use): {d['stale_calls']}, of which {d['stale_saw_stale_epoch']} saw `ctx.still_owner()` "
        f"False"
        + (f" ({d['stale_asked_before_replaced']} saw True, asked before the queue was known to be replaced)"
           if d.get("stale_asked_before_replaced") else "")
        + f" and {d['stale_commit_refused']} had their commit refused; {_refusals(d)}"
        + (f"; listener calls of a run after its refusal: {d['calls_after_refusal']}" if "calls_after_refusal" in d
           else ""),
        f"- epochs held by two clients: {d['epoch_double_owner']}; committed offset going backward: "
        f"{d['offset_backward']}; longest pause of any queue: {d['max_stall']} s",
    ]
    if d.get("redis_recovery"):
        out.append(f"- after each Redis restart, every queue had a listener call again within: "
                   f"{', '.join(str(t) for t in d['redis_recovery'])} s")
    for c in d.get("crashes", []):
        out.append(f"- **worker crash (not injected)**: {c}")
    if d["failovers"]:
        out.append(f"- failover after kill -9: {d['failovers']} queue takeovers, max {_s(d['failover_max'])} s, "
                   f"p99 {_s(d['failover_p99'])} s; all (s): {_many(d.get('failover_values', []))}")
    if d["sigstop_takeovers"]:
        out.append(f"- takeover after SIGSTOP: {', '.join(f'{t:.2f}' for t in d['sigstop_takeovers'])} s")
    out += _redis_failover(d)
    if d["lost_fsync"] or d["fsync_gaps"]:
        out.append(f"- lost within the last {FSYNC_WINDOW:.0f} s before a Redis kill (everysec): {d['lost_fsync']}; "
                   f"key gaps they left: {d['fsync_gaps']}")
    for p in d["poison"]:
        out.append(f"- poison {p['id']} (queue {p['queue']} offset {p['offset']}): {p['attempts']} attempts, "
                   f"in DLQ: {'yes' if p['in_dlq'] else '**no**'}, queue blocked {p['blocked_s']} s "
                   f"(bound {p['bound_s']} s)")
    if d["beat"]:
        b = d["beat"]
        out.append(f"- beat down {b['outage_s']} s: {b['handled_during_outage']:,} listener calls meanwhile, longest "
                   f"queue gap {b['max_gap_during_outage_s']} s, {b['epoch_changes_during_outage']} epoch changes; "
                   f"rebalances sent per beat process (first, restarted, second...): {b['rebalances_sent_per_beat']}")
    if d.get("long_stalls"):
        out.append(f"- queue pauses over 5 s ({d['long_stall_count']}), with the last event before each:")
        out += [f"  - {x}" for x in d["long_stalls"]]
    for n in d["notes"]:
        out.append(f"- note: {n}")
    for p in d["problems"]:
        out.append(f"- **problem**: {p}")
    for v in d["violation_examples"]:
        out.append(f"- violation: {v}")
    for v in d["lost_examples"]:
        out.append(f"- lost: {v}")
    for v in d.get("lost_replication_examples", []):
        out.append(f"- lost in a replication window: {v}")
    out.append("")
    return out


def _failures(results: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    failed = [n for n in names if not results[n]["passed"]]
    if not failed:
        return []
    out = ["**Failed checks** (details below):", ""]
    for n in failed:
        for p in results[n]["problems"]:
            out.append(f"- {n}: {p[:400]}")
    return [*out, ""]


def render(results: dict[str, dict[str, Any]]) -> str:
    names = ([n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER + LAST)
             + [n for n in LAST if n in results])
    lines = [
        "# Reliability: the chaos suite",
        "",
        "Generated by `make chaos` (`python -m chaos`); do not edit by hand. Each scenario starts its own",
        "`redis-server` (AOF on), 3 prefork worker processes (`-c 2`), beat and a producer sending ~300 msg/s",
        "with `send_orderly` over 300 keys into 12 queues, injects its faults, drains, and hands the ledger to",
        "the checker (`chaos/checker.py`). The listener (`chaos/listeners.py`) appends one JSON record per",
        "message (key, sequence, queue, offset, epoch, client, pid, start and end time, status,",
        "`ctx.still_owner()`, run id) to a ledger kept in a second Redis that no fault touches; its",
        "`consume_refused` hook records every refused commit the same way, and each beat records the tasks",
        "it publishes. The checker proves everything from these records (`chaos/records.py`), never from a",
        "log line; the producer keeps its acknowledgements in memory.",
        "",
        "The `sentinel-*` rows replace that one `redis-server` with a Sentinel deployment",
        "(`chaos/topology.py`): a primary and two replicas, each with AOF on, watched by three Sentinels",
        "(`down-after-milliseconds` 2000); workers, beat, traffic and the checker's samples all reach it",
        "through its `redis+sentinel://` URL (Celery's broker too, through kombu's Sentinel transport), and",
        "the ledger stays on a plain Redis that no fault touches.",
        "",
        "The `cluster-*` rows replace it with a Redis Cluster (`chaos/cluster_topology.py`): 3 masters",
        "(with one replica each in `cluster-failover`), AOF on, `cluster-node-timeout` 2000, reached through",
        "a `redis+cluster://` URL; the 12 queues are spread over the shards by their hash tags. Celery's",
        "broker cannot be a cluster, so it is the ledger's plain Redis (another database). `cluster-failover`",
        "kills a shard's master (its failover is judged as the Sentinel ones are, over the queues that",
        "shard served; with one replica per master, the promoted master has none until the killed node",
        "rejoins as its replica, so sends waiting for one replica are refused on that shard until then);",
        "`cluster-reshard` migrates the slots of live queues between masters while they are consumed",
        "(`chaos/cluster_faults.py`).",
        "",
        "The `groups-kill` rows run three consumer groups in each worker (`CHAOS_GROUPS=1`): the chaos",
        "group, `chaos-b` on the chaos topic too (the two share each queue's log stream) and `chaos-c` on a",
        "topic of its own, with a producer of its own at a third of the rate. Each group's listener records",
        "its calls apart, and each group is checked alike from its own records (its calls, refusals,",
        "lock-table samples, its topic's acks, the queues it owned at each kill). The `groups-kill` row is",
        "the chaos group's figures and fails if any group's check failed; the `groups-kill/<group>` rows",
        "are the other groups' figures.",
        "",
        "| scenario | messages (acked) | handled | faults | order violations | lost | lost in fsync / replication window | "
        "duplicates (redelivered / copies / unexplained) | max dups per queue per fault | overlapping calls | "
        "failover max s | failover p99 s | result |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---|",
        *(_row(results[n]) for n in names),
        "",
        *_failures(results, names),
        "† takeover after SIGSTOP (no kill in that scenario). Failover: for each queue a killed worker owned",
        "(read from the lock table right before `kill -9`), the time from the kill to the start of the first",
        "listener call on that queue by another process; p99 is the nearest-rank percentile over every such",
        "queue of every kill in the scenario (with fewer than 100 samples it is the maximum).",
        "‡ consumption resumed after a kill (or SIGSTOP) of the Redis primary: for every queue, the time",
        "from the fault to its first listener call of a message acknowledged after it (stored on the new",
        "primary only) or by a run that had made no call before it.",
        "",
        "## What is checked",
        "",
        "- **Order violation**: a key whose seq n+1 was handled before seq n ever was (this includes gaps),",
        "  or a ConsumeRequest run handing out an offset not above the previous one. Must be 0.",
        "- **Lost**: an acknowledged send never handled (a poison message: never in the DLQ). Must be 0;",
        f"  with `appendfsync everysec`, losses within the last {FSYNC_WINDOW:.0f} s of acknowledged sends before a "
        "Redis kill are counted apart.",
        f"- **Duplicates** must follow a fault (start within {DUP_WINDOW:.0f} s after it ends) and number at most "
        "one pull batch (32) per queue per fault; a second stored copy of a send that raised is a *copy*.",
        "- **Overlapping calls** on one queue by two processes are allowed only when the stale call (the lower",
        "  epoch; at one epoch, the older run) had its commit refused (a `FENCED` refusal record for its",
        "  queue and epoch, or `SUPERSEDED` on its queue after its start for a run replaced at the same",
        "  epoch) and saw `ctx.still_owner()` return False, or True to a question asked before the queue was",
        "  known to have a newer owner (its first call, or the first lock-table sample showing the newer",
        "  epoch): Redis answers somewhere between the question and its return, and a process paused in",
        "  between reads, after the pause, an answer that was right when given. Every stale call (one",
        "  started after a newer epoch of its queue was in use) must have seen False and had its commit",
        "  refused; a run whose commit was refused never starts another listener call.",
        "- No epoch of a queue ever held by two clients (the lock table sampled every 0.2 s), committed",
        "  offsets never backward (outside an everysec Redis restart).",
        f"- Poison: in `%DLQ%chaos` after 1 + 3 attempts, its queue blocked at most 3 × 1 s + {POISON_SLACK:.0f} s.",
        "- **Redis failover** (`chaos/failover_checks.py`): an acknowledged send may be lost only inside a",
        f"  loss window: acknowledged within {REPLICATION_WINDOW:.0f} s before the primary was lost when sends do "
        "not wait for a",
        "  replica, or since the promoted replica went stale (it was paused); such losses and the key gaps",
        "  they leave are counted apart, every other loss fails the run. No epoch of a queue is ever used by",
        "  two clients, and an epoch first used after a promotion is above every epoch used before the",
        "  failover; a lock grant the promoted replica lacked never comes back, and its holder's commit is",
        "  refused. Two epochs overlapping after a failover fall under the overlap rule above (the stale call",
        "  refused and told so); overlapping calls at one epoch are counted and, in the `sentinel-*` rows",
        "  and `cluster-failover`, fail the run. Redeliveries of messages handled in a loss window are",
        "  counted apart from the one-batch bound. Consumption must resume on every queue after each failover",
        f"  (`sentinel-failover`, `sentinel-async`, `cluster-failover`: p99 at most {REDIS_FAILOVER_TARGET:.0f} s;",
        "  on a cluster, over the queues of the killed master's shard).",
        f"- Beat: while beat is down past the lease no queue goes {BEAT_OUTAGE_MAX_GAP:.0f} s without a call and no",
        "  epoch changes (workers renew their own leases); a restarted beat publishes rebalances again",
        "  (counted from each beat's publish records); two beats at once never double-assign.",
        "",
        "## Scenarios",
        "",
    ]
    for n in names:
        lines += _details(results[n])
    lines += [
        f"Machine: {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores shared with other jobs.",
        "",
        f"<!-- {MARK} {json.dumps(results, sort_keys=True)} -->",
        "",
    ]
    return "\n".join(lines)


def write(new: dict[str, dict[str, Any]], path: Path = DOC) -> Path:
    results = _load(path)
    results.update(new)
    path.write_text(render(results))
    return path

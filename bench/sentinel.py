"""Redis Sentinel: what going through the Sentinels costs, and how long a failover of the primary
stops consumption.

* **Drain through Sentinel vs direct**: one Sentinel deployment (a primary, two replicas, three
  Sentinels); the same drain as the throughput section (``bench.mqorder_drain``) runs with workers
  given the ``redis+sentinel://`` URL (Celery's broker too, through kombu's Sentinel transport) and
  with workers given the primary's own ``redis://`` URL: the same redis-server, replicating to the
  same replicas, in the same run, interleaved run by run on fresh workers. The ratio is the price
  of the Sentinel client (primary discovery per new connection, the ``WAIT`` for one replica before
  a new lock epoch is used) at full speed.
* **Failover**: three stock workers on the Sentinel URL consume a 16-queue topic under steady
  traffic (``send_orderly``, 500 msg/s, through the Sentinels as well). Each round waits for a
  steady state (every queue locked by its assignee, all three workers owning queues), then
  ``kill -9``s the primary. The replicas' state is read right after the kill (the one promoted
  serves exactly that), the new primary's every 10 ms once Sentinel names it: a queue has resumed
  when its committed offset moves past what the promoted replica held, the commit that follows
  the first listener call under the new primary. The killed node then comes back as a replica and
  the next round begins.

    python -m bench.run --only sentinel
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis

from bench import failover
from bench.common import Config, log, measured_note, mq_env, percentile, queues_of, start_mq_workers, summarize
from bench.failover import _states, _steady
from bench.mqorder_drain import DrainSpec, drain
from mqorder import Producer
from mqorder.store.connect import connect
from mqorder.testing.sentinel import SentinelDeployment

KINDS = ("sentinel", "direct")
LABELS = {"sentinel": "workers given the `redis+sentinel://` URL",
          "direct": "workers given the primary's `redis://` URL"}
#: Sentinel's ``down-after-milliseconds`` here (as in the chaos suite's Sentinel scenarios): how
#: long the primary must be silent before a Sentinel calls it down. The failover cannot be shorter.
DOWN_AFTER_MS = 2000


def deployment() -> SentinelDeployment:
    return SentinelDeployment(replicas=2, sentinels=3, down_after_ms=DOWN_AFTER_MS)


# -- drain through Sentinel vs direct -------------------------------------------------------------------


def drains(cfg: Config, *, messages: int, runs: int, concurrency: int) -> dict[str, list[dict[str, Any]]]:
    """The two drains, interleaved run by run (the order alternating), on one deployment."""
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    with deployment() as d:
        primary = d.primary()
        for run in range(runs):
            for kind in KINDS if run % 2 == 0 else KINDS[::-1]:
                log(f"sentinel: drain run {run}, {LABELS[kind]}")
                url = d.url() if kind == "sentinel" else primary.url
                (res,) = drain(cfg, DrainSpec(tag=f"sn-{kind}-{run}", concurrency=concurrency, batch_max=32,
                                              plan=[(16, messages)], warmup=min(5000, messages)),
                               server=primary, worker_url=url)
                res["run"] = run
                out[kind].append(res)
    return out


# -- failover of the primary ----------------------------------------------------------------------------


class Traffic(failover.Traffic):
    """``bench.failover``'s paced sender, through the Sentinels."""

    def __init__(self, url: str, topic: str, rate: float, n_keys: int) -> None:
        super().__init__(url, topic, rate, n_keys, name="bench-sentinel-traffic")


def _steady_through(r: redis.Redis, group: str, mqs: list[Any], hostnames: list[str], timeout: float) -> None:
    """``bench.failover``'s steady state, read through the Sentinels: right after a failover the
    client's first commands may still meet the old primary's dead connections."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _steady(r, group, mqs, hostnames, max(1.0, deadline - time.monotonic()))
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def failover(cfg: Config, *, kills: int, concurrency: int, rate: float = 500.0, workers: int = 3,
             queues: int = 16, n_keys: int = 2000, timeout: float = 60.0) -> list[dict[str, Any]]:
    """``kills`` rounds of kill -9 of the primary; one dict per kill."""
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        d = st.enter_context(deployment())
        url = d.url()
        topic, group = "sfo", "g-sfo"
        p = Producer(url)
        p.create_topic(topic, queues=queues)
        p.close()
        env = mq_env(url, topic=topic, group=group)
        names = [f"sfo{i}" for i in range(workers)]
        log(f"sentinel failover: {workers} worker(s) -c {concurrency} on {url}, traffic {rate:.0f} msg/s")
        ws = start_mq_workers(st, d.primary().url, names, env, concurrency, cfg.logdir / "sentinel_failover")
        traffic = Traffic(url, topic, rate, n_keys)
        traffic.start()
        st.callback(traffic.stop)
        mqs = queues_of(topic, queues)
        follow = connect(url, socket_timeout=5, socket_connect_timeout=5)
        st.callback(follow.close)
        for k in range(kills):
            _steady_through(follow, group, mqs, [w.hostname for w in ws], timeout)
            old = d.primary()
            t_kill = time.perf_counter()
            old.kill()
            t_dead = time.perf_counter()  # kill() returns once the process is gone: no ack comes from it after
            held = {}
            for node in d.nodes:
                if node is old:
                    continue
                c = d.direct_client(node)
                held[node.port] = _states(c, group, mqs)
                c.close()
            new = d.node(d.wait_failover(old.port, timeout))
            promoted = time.perf_counter() - t_kill
            base = held[new.port]
            resumed: dict[int, float] = {}
            c = d.direct_client(new)
            deadline = time.monotonic() + timeout
            while len(resumed) < len(mqs) and time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):
                    now = _states(c, group, mqs)
                    t = time.perf_counter() - t_kill
                    for i, (_, offset, _) in enumerate(now):
                        if offset > base[i][1]:
                            resumed.setdefault(i, t)
                time.sleep(0.01)
            c.close()
            sent = traffic.first_ok_after(t_dead)
            ok = len(resumed) == len(mqs)
            res = {
                "kill": k, "ok": ok, "promoted_s": promoted,
                "send_resumed_s": (sent - t_kill) if sent is not None else float("inf"),
                "all_resumed_s": max(resumed.values()) if ok else float("inf"),
                "first_resumed_s": min(resumed.values()) if resumed else float("inf"),
                "queues_s": sorted(resumed.values()),
            }
            log(f"sentinel failover kill {k}: new primary after {promoted:.2f}s, sends after "
                f"{res['send_resumed_s']:.2f}s, every queue consuming again after {res['all_resumed_s']:.2f}s")
            out.append(res)
            d.restart_as_replica(old)
            d.wait_replicas_online(2, timeout)
        log(f"sentinel failover: traffic sent {traffic.sent:,} messages, {traffic.errors} send errors")
    return out


def run(cfg: Config, *, messages: int, runs: int, concurrency: int, kills: int) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": messages, "concurrency": concurrency, "down_after_ms": DOWN_AFTER_MS,
                           "drain": drains(cfg, messages=messages, runs=runs, concurrency=concurrency)}
    out["failover"] = failover(cfg, kills=kills, concurrency=concurrency)
    return out


# -- RESULTS.md -----------------------------------------------------------------------------------------


def _ratios(res: dict[str, Any]) -> list[float]:
    """Sentinel / direct per run (the pair measured back to back)."""
    by_run = {r["run"]: r["rate"] for r in res["drain"].get("direct") or []}
    return [r["rate"] / by_run[r["run"]] for r in res["drain"].get("sentinel") or [] if by_run.get(r["run"])]


def markdown(res: dict[str, Any]) -> list[str]:
    """The section of RESULTS.md."""
    out = ["## Redis Sentinel: drain through the Sentinels, failover of the primary", ""]
    if not res:
        return out
    out += measured_note(res)
    dr = res.get("drain") or {}
    rows = [[LABELS[k], summarize(r["rate"] for r in dr[k]).fmt(0, "msg/s"),
             summarize(r["worker_cpu_s"] / r["messages"] * 1e6 for r in dr[k]).fmt(1, "µs"),
             summarize(r["redis_cpu_s"] / r["messages"] * 1e6 for r in dr[k]).fmt(1, "µs")]
            for k in KINDS if dr.get(k)]
    ratios = _ratios(res)
    out += ["| drain, consume batch 32 | messages/s | worker CPU per message | primary's CPU per message |",
            "|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in rows), ""]
    if ratios:
        verdict = (" The runs disagree on which is faster: at this size the cost of the Sentinel path is below "
                   "this machine's run-to-run noise." if min(ratios) < 1 < max(ratios) else "")
        out += [f"Through Sentinel / direct, per run (the two drains of a run back to back): "
                f"{', '.join(f'{x:.2f}x' for x in ratios)}; median **{summarize(ratios).median:.2f}x**.{verdict}", ""]
    out += [f"One Sentinel deployment (a primary, two replicas, three Sentinels on loopback); 2 stock workers "
            f"prefork -c {res['concurrency']} drain a {res['messages']:,}-message backlog over 16 queues and 2,000 "
            "keys, measured as in the throughput section, on fresh workers each run; both kinds of run use the "
            "same primary (replicating to both replicas), interleaved run by run, the order alternating. Only "
            "the workers' `MQORDER_REDIS_URL` differs, and with it Celery's broker (kombu's Sentinel transport, "
            "or plain Redis) and the default `MQORDER_LOCK_WAIT_REPLICAS` (1 behind Sentinel, 0 on a plain "
            "URL). Medians of runs (min–max).", ""]
    fo = res.get("failover") or []
    if not fo:
        return out
    allq = [x for k in fo for x in k["queues_s"]]

    def spread(name: str, xs: list[float]) -> list[str]:
        return [name, f"{percentile(xs, 50):.2f} s", f"{percentile(xs, 99):.2f} s", f"{min(xs):.2f}–{max(xs):.2f} s",
                str(len(xs))]

    out += ["| after kill -9 of the primary | p50 | p99 | min–max | samples |", "|---|---|---|---|---|"]
    for r in (spread("Sentinel's new primary answers as one", [k["promoted_s"] for k in fo]),
              spread("first acknowledged send", [k["send_resumed_s"] for k in fo]),
              spread("first queue consuming again", [k["first_resumed_s"] for k in fo]),
              spread("every queue consuming again (the figure, per kill)", [k["all_resumed_s"] for k in fo]),
              spread("each queue consuming again (per queue, all kills)", allq)):
        out.append("| " + " | ".join(r) + " |")
    out += ["", f"3 stock workers -c {res['concurrency']} on the `redis+sentinel://` URL (Celery's broker too), stock "
            "settings, 16 queues, `send_orderly` at 500 msg/s through the Sentinels; Sentinel's "
            f"`down-after-milliseconds` {res['down_after_ms']} (the primary must be silent that long before a "
            "Sentinel calls it down: the floor of every figure), `failover-timeout` 4000. Each kill: `kill -9` of "
            "the primary at a steady state; a queue is consuming again when its committed offset on the new "
            "primary moves past what the promoted replica held (the commit that follows the first listener "
            "call there), polled every 10 ms; the killed node then rejoins as a replica before the next kill. "
            "Between the new primary and the queues lie the workers' reconnections: a ConsumeRequest retries "
            "Redis after 0.25, 0.5, 1, 2 s...; Celery's consumer reconnects to its broker after 2 s, then 4 s "
            "more, so a queue that needs a new ConsumeRequest task waits for it.", ""]
    out += ["| kill | new primary (s) | first send (s) | first queue (s) | every queue (s) |", "|---|---|---|---|---|"]
    out += [f"| {k['kill']} | {k['promoted_s']:.2f} | {k['send_resumed_s']:.2f} | {k['first_resumed_s']:.2f} | "
            f"{k['all_resumed_s']:.2f} |" for k in fo]
    out.append("")
    return out

"""mqorder drain throughput: stock workers, bench no-op listener, pre-produced backlog.

One worker set serves several measured runs (``BENCH_LANES``): the workers start idle, subscribed
to topics that do not exist yet. For each run the backlog is written (``send_orderly_batch``) to a
new topic nobody owns yet, so nothing is consumed while producing; then the clock starts and one
rebalance from here assigns the queues and dispatches the ConsumeRequests ("told to start
consuming"); the clock stops when the group's summed lag (``MessageLog.lag``) is 0.

Per run it also reads Redis ``INFO commandstats`` (reset at the start) and the workers' Celery
task totals, which give the per-message cost of the consume path.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from bench.common import (
    Config,
    celery_task_totals,
    client,
    commandstats,
    ctl_app,
    kick,
    log,
    mq_env,
    produce_backlog,
    queues_of,
    redis_server,
    start_mq_workers,
    total_lag,
    wait_lag_zero,
)
from bench.listeners import lane_names
from mqorder import keys
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog

CONSUME_TASK = "mqorder.consume_request"


@dataclass
class DrainSpec:
    tag: str
    workers: int = 2
    concurrency: int = 1
    batch_max: int = 32
    pull: int = 32
    queues: int = 16
    messages: int = 200_000
    keys: int = 2_000
    runs: int = 3


def drain(cfg: Config, spec: DrainSpec, *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run ``spec.runs`` drains on one set of workers; one dict per run."""
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        srv = redis_server(st)
        r = client(srv.url)
        st.callback(r.close)
        topic, group = f"drain-{spec.tag}", f"g-{spec.tag}"
        env = mq_env(
            srv.url, topic=topic, group=group, lanes=spec.runs,
            MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE=str(spec.batch_max),
            MQORDER_PULL_BATCH_SIZE=str(spec.pull),
            # No periodic rebalance during a run: the run's own kick is the only one.
            MQORDER_REBALANCE_INTERVAL="3600",
        )
        names = [f"{spec.tag}-w{i}" for i in range(spec.workers)]
        log(f"drain {spec.tag}: starting {spec.workers} worker(s) -c {spec.concurrency}")
        ws = start_mq_workers(st, srv.url, names, env, spec.concurrency, cfg.logdir / spec.tag)
        hostnames = [w.hostname for w in ws]
        app = ctl_app(srv.url)
        st.callback(app.close)
        brokers = BrokerRegistry(srv.url)
        st.callback(brokers.close)
        mlog = MessageLog(brokers)
        for run, (t, g) in enumerate(lane_names(topic, group, spec.runs)):
            produce_s = produce_backlog(srv.url, t, spec.queues, spec.messages, spec.keys)
            mqs = queues_of(t, spec.queues)
            tasks_before = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0)
            time.sleep(0.3)  # let the producer's CPU burst settle
            before = total_lag(r, g, mqs)
            if before != spec.messages:
                raise RuntimeError(f"drain {spec.tag} run {run}: {spec.messages - before} messages were consumed "
                                   "before the clock started (a rebalance ran early)")
            r.config_resetstat()
            t0 = time.perf_counter()
            kick(srv.url, app)
            t1 = wait_lag_zero(r, g, mqs, timeout, alive=lambda: all(w.alive() for w in ws))
            secs = t1 - t0
            cs = commandstats(r)
            lag = sum(mlog.lag(g, mq) for mq in mqs)
            time.sleep(0.3)  # the last runs flush their stats as they finish
            tasks = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0) - tasks_before
            stats = {k.decode(): float(v) for k, v in r.hgetall(keys.stats(g)).items()}
            ok = int(sum(v for k, v in stats.items() if k.endswith("|ok")))
            calls = int(sum(v for k, v in stats.items() if k.endswith("|rt_n")))
            res = {
                "run": run, "messages": spec.messages, "seconds": secs, "rate": spec.messages / secs,
                "produce_s": produce_s, "lag_after": lag, "consumed_ok": ok, "listener_calls": calls,
                "consume_tasks": tasks, "evalsha": cs.get("evalsha", 0), "xrange": cs.get("xrange", 0),
                "commands_total": sum(cs.values()), "commandstats": cs,
            }
            log(f"drain {spec.tag} run {run}: {spec.messages} msgs in {secs:.2f}s = {res['rate']:,.0f} msg/s "
                f"(tasks {tasks}, evalsha {res['evalsha']}, xrange {res['xrange']}, listener calls {calls})")
            results.append(res)
            # Free the run's log memory; its queues stay owned and idle.
            pipe = r.pipeline(transaction=False)
            for mq in mqs:
                pipe.unlink(keys.queue_log(mq.tag))
            pipe.execute()
    return results

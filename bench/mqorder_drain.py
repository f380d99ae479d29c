"""mqorder drain throughput: stock workers, bench no-op listener, pre-produced backlog.

One worker set serves several measured runs (``BENCH_LANES``): the workers start idle, subscribed
to topics that do not exist yet. For each run the backlog is written (``send_orderly_batch``) to a
new *write-only* topic (RocketMQ's topic permission), which nobody consumes; then the clock
starts, the topic is opened for reading and one rebalance from here assigns the queues and
dispatches the ConsumeRequests ("told to start consuming"); the clock stops when the group's
summed lag (``MessageLog.lag``) is 0.

Per run it also reads Redis ``INFO commandstats`` (reset at the start) and the workers' Celery
task totals, which give the per-message cost of the consume path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import (
    Config,
    broker_env,
    celery_broker_url,
    celery_task_totals,
    client,
    commandstats,
    cpu_s,
    ctl_app,
    kick,
    log,
    mq_env,
    produce_backlog,
    queues_of,
    redis_and_client,
    server_pid,
    start_mq_workers,
    total_lag,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import lane_names
from mqorder import keys
from mqorder.consumer.stats import ConsumerStatsManager
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog
from mqorder.testing.embedded import RedisServer

CONSUME_TASK = "mqorder.consume_request"


@dataclass
class DrainSpec:
    tag: str
    workers: int = 2
    concurrency: int = 1
    #: Celery pool of the workers (``-P``).
    pool: str = "prefork"
    batch_max: int = 32
    pull: int = 32
    keys: int = 2_000
    #: One measured run per entry: (queues of the run's topic, messages in its backlog).
    plan: list[tuple[int, int]] = field(default_factory=lambda: [(16, 200_000)] * 3)
    #: Messages of an unmeasured warm-up run first (16 queues); 0 for none.
    warmup: int = 5_000
    #: More ``MQORDER_*`` settings for the workers (e.g. retention on or off).
    env: dict[str, str] = field(default_factory=dict)
    #: Celery's broker: ``redis`` (the run's redis-server) or ``rabbitmq`` (a vhost of the run's own).
    celery_broker: str = "redis"


def drain(cfg: Config, spec: DrainSpec, *, timeout: float = 600.0,
          pair: Callable[[], dict[str, Any]] | None = None, server: RedisServer | None = None,
          worker_url: str | None = None) -> list[dict[str, Any]]:
    """Run the drains of ``spec.plan`` on one set of workers; one dict per measured run.

    ``pair``, if given, is called right before each measured run (after its backlog is written,
    before the clock starts) and its result stored as the run's ``paired``: a baseline measured
    under the same machine conditions (the raw ceiling, on its own redis-server).

    ``server``: a redis-server started (and stopped) by the caller instead of one of the run's own
    (the primary of a Sentinel deployment, ``bench.sentinel``); ``worker_url``: the store URL the
    workers get (default the server's; a ``redis+sentinel://`` URL reaches the same primary through
    the Sentinels). The driver (backlog, kick, lag polling) talks to the server directly either way.
    """
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        if server is None:
            srv, r = redis_and_client(st)
        else:
            srv, r = server, client(server.url)
            st.callback(r.close)
        topic, group = f"drain-{spec.tag}", f"g-{spec.tag}"
        plan = ([(16, spec.warmup)] if spec.warmup else []) + list(spec.plan)
        broker = celery_broker_url(st, spec.celery_broker, srv.url)
        env = mq_env(
            worker_url or srv.url, topic=topic, group=group, lanes=len(plan),
            MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE=str(spec.batch_max),
            MQORDER_PULL_BATCH_SIZE=str(spec.pull),
            # No periodic rebalance during a run: the run's own kick is the only one.
            MQORDER_REBALANCE_INTERVAL_MS="3600000",
            **spec.env,
            **broker_env(broker, srv.url),
        )
        names = [f"{spec.tag}-w{i}" for i in range(spec.workers)]
        log(f"drain {spec.tag}: starting {spec.workers} worker(s) -P {spec.pool} -c {spec.concurrency}")
        ws = start_mq_workers(st, srv.url, names, env, spec.concurrency, cfg.logdir / spec.tag, pool=spec.pool)
        hostnames = [w.hostname for w in ws]
        app = ctl_app(broker)
        st.callback(app.close)
        brokers = BrokerRegistry(srv.url)
        st.callback(brokers.close)
        mlog = MessageLog(brokers)
        redis_pid = server_pid(srv)
        for lane, ((t, g), (queues, messages)) in enumerate(zip(lane_names(topic, group, len(plan)), plan,
                                                                  strict=True)):
            run = lane - 1 if spec.warmup else lane
            produce_s = produce_backlog(srv.url, t, queues, messages, spec.keys, hold=True)
            mqs = queues_of(t, queues)
            tasks_before = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0)
            paired = pair() if (pair is not None and run >= 0) else None
            time.sleep(0.3)  # let the producer's (and the paired run's) CPU burst settle
            before = total_lag(r, g, mqs)
            if before != messages:
                raise RuntimeError(f"drain {spec.tag} run {run}: {messages - before} messages were consumed "
                                   "before the clock started (a rebalance ran early)")
            r.config_resetstat()
            cpu_w0, cpu_r0 = tree_cpu_s(w.pid for w in ws), cpu_s(redis_pid)
            t0 = time.perf_counter()
            kick(srv.url, app, t)
            t1 = wait_lag_zero(r, g, mqs, timeout, alive=lambda: all(w.alive() for w in ws))
            secs = t1 - t0
            cpu_w, cpu_r = tree_cpu_s(w.pid for w in ws) - cpu_w0, cpu_s(redis_pid) - cpu_r0
            cs = commandstats(r)
            lag = sum(mlog.lag(g, mq) for mq in mqs)
            time.sleep(0.3)  # the last runs flush their stats as they finish
            tasks = celery_task_totals(app, hostnames).get(CONSUME_TASK, 0) - tasks_before
            stats = ConsumerStatsManager.read(r, g).values()
            ok = int(sum(s.get("ok", 0) for s in stats))
            calls = int(sum(s.get("rt_n", 0) for s in stats))
            res = {
                "run": run, "queues": queues, "workers": spec.workers, "concurrency": spec.concurrency,
                "pool": spec.pool, "celery_broker": spec.celery_broker,
                "batch_max": spec.batch_max, "messages": messages, "seconds": secs, "rate": messages / secs,
                "produce_s": produce_s, "lag_after": lag, "consumed_ok": ok, "listener_calls": calls,
                "consume_tasks": tasks, "evalsha": cs.get("evalsha", {}).get("calls", 0),
                "evalsha_usec": cs.get("evalsha", {}).get("usec", 0), "xrange": cs.get("xrange", {}).get("calls", 0),
                "commands_total": sum(v["calls"] for v in cs.values()), "commandstats": cs,
                "worker_cpu_s": cpu_w, "redis_cpu_s": cpu_r, "paired": paired,
            }
            if paired:
                log(f"drain {spec.tag} run {run}: paired raw ceiling {paired['rate']:,.0f} msg/s")
            log(f"drain {spec.tag} {'warm-up' if run < 0 else f'run {run}'}: {queues} queues, {messages} msgs in {secs:.2f}s = {res['rate']:,.0f} msg/s "
                f"(tasks {tasks}, evalsha {res['evalsha']}, xrange {res['xrange']}, listener calls {calls}, "
                f"worker CPU {cpu_w / messages * 1e6:.1f} µs/msg, redis CPU {cpu_r / messages * 1e6:.1f} µs/msg)")
            if run >= 0:
                results.append(res)
            # Free the run's log memory; its queues stay owned and idle.
            pipe = r.pipeline(transaction=False)
            for mq in mqs:
                pipe.unlink(keys.queue_log(mq.tag))
            pipe.execute()
    return results

"""Redis Cluster vs a single redis-server: the same drain on each, in the same run (issue 26).

* **Drain**: 2 stock workers (prefork, as the throughput section) drain a backlog written with
  ``send_orderly_batch`` over a 16-queue topic and 2,000 keys, no-op listener, consume batch 32,
  on (a) one plain ``redis-server`` and (b) a 3-master Redis Cluster without replicas
  (``mqorder.testing.cluster``, ``redis+cluster://`` URL), on fresh workers each run, interleaved
  run by run with the order alternating. Celery's broker is a plain ``redis-server`` of its own
  for both (kombu cannot use a cluster), so the store's servers serve mqorder alone: their CPU
  is what mqorder costs Redis.
* **Per store node**, across the producer's writes and across the drain: its CPU seconds
  (``INFO cpu``: ``used_cpu_user`` + ``used_cpu_sys``, the whole process in µs, where
  ``/proc/<pid>/stat`` counts 10 ms ticks) and ``INFO commandstats`` (reset before). Divided by the
  messages, the sum over the shards is compared with the single node (issue 26's target: within
  1.2x), and each shard's share of the commands with its share of the messages: a command run on
  every shard per message would make each shard's count ~ all the messages, not its share.
* The driver's lag poll (one ``GET`` + one ``HGET`` per queue every ``POLL_S``, on the node of
  each queue) is counted and taken out of the command counts; its CPU stays in (a bias against
  the cluster, which gets three pipelines per poll instead of one).

    python -m bench.run --only cluster
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from bench.common import (
    Config,
    cpu_s,
    ctl_app,
    kick,
    log,
    mq_env,
    produce_backlog,
    queues_of,
    redis_server,
    server_pid,
    start_mq_workers,
    total_lag,
    tree_cpu_s,
    wait_lag_zero,
)
from bench.listeners import lane_names
from mqorder import keys
from mqorder.model import MessageQueue
from mqorder.store.connect import close, connect
from mqorder.testing.cluster import ClusterDeployment
from mqorder.testing.embedded import RedisServer

KINDS = ("single", "cluster1", "cluster")
MASTERS = 3
LABELS = {"single": "single redis-server", "cluster1": "one-node cluster (cluster mode, every slot on one node)",
          "cluster": f"{MASTERS}-master Redis Cluster"}
QUEUES = 16
KEYS = 2_000
#: Interval of the driver's lag poll during a drain, in seconds.
POLL_S = 0.02
#: Seconds the workers are measured idle (subscribed, no messages) before the measured backlog.
IDLE_S = 2.0
#: Commands that the meter itself sends to each node (not mqorder's): left out of the counts.
METER_COMMANDS = frozenset({"config|resetstat", "info"})


@dataclass
class Store:
    """Where the workers keep mqorder's state: the URL they are given and the servers behind it."""

    kind: str
    url: str
    nodes: list[RedisServer]
    #: Index in ``nodes`` of the node that serves a queue's hash slot.
    shard_of: Callable[[MessageQueue], int]


def cluster_store(d: ClusterDeployment) -> Store:
    masters = d.nodes[: d.masters]
    ports = [n.port for n in masters]

    def shard_of(mq: MessageQueue) -> int:
        return ports.index(d.master_of_slot(key_slot(keys.queue_next(mq.tag).encode())).port)

    return Store("cluster", d.url(), masters, shard_of)


class NodeMeter:
    """CPU seconds, reads and command counts of each node of a store between ``start`` and ``stop``."""

    #: Reads the meter itself causes in a window: ``INFO cpu`` at the start, ``INFO all`` at the end.
    OWN_READS = 2

    def __init__(self, nodes: Sequence[RedisServer]) -> None:
        self.nodes = list(nodes)
        self.clients = [redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=30) for n in self.nodes]
        self.cpu0 = [0.0] * len(self.nodes)

    @staticmethod
    def _cpu(info: dict[str, Any]) -> float:
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def start(self) -> None:
        for c in self.clients:
            c.config_resetstat()  # zeroes commandstats and total_reads_processed
        self.cpu0 = [self._cpu(c.info("cpu")) for c in self.clients]

    def stop(self) -> list[dict[str, Any]]:
        """Per node: port, CPU seconds and reads (client requests read) since ``start``, and
        calls per command (the meter's own left out)."""
        infos = [c.info("all") for c in self.clients]
        out = []
        for node, info, cpu0 in zip(self.nodes, infos, self.cpu0, strict=True):
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_")}
            out.append({"port": node.port, "cpu_s": self._cpu(info) - cpu0,
                        "reads": max(0, int(info["total_reads_processed"]) - self.OWN_READS),
                        "calls": {k: v for k, v in calls.items() if k not in METER_COMMANDS}})
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _queue_sizes(r: redis.Redis, mqs: Sequence[MessageQueue]) -> list[int]:
    pipe = r.pipeline(transaction=False)
    for mq in mqs:
        pipe.get(keys.queue_next(mq.tag))
    return [int(x or 0) for x in pipe.execute()]


def _per_node(nodes: list[dict[str, Any]], store: Store, mqs: Sequence[MessageQueue], sizes: Sequence[int],
              polls: int = 0) -> list[dict[str, Any]]:
    """Each node's queues and messages, and its counts without the driver's ``polls`` lag polls (one
    pipeline, so one read, to each node holding queues; a GET and an HGET per queue)."""
    for i, node in enumerate(nodes):
        mine = [j for j, mq in enumerate(mqs) if store.shard_of(mq) == i]
        node["queues"], node["messages"] = len(mine), sum(sizes[j] for j in mine)
        for cmd in ("get", "hget"):
            if cmd in node["calls"]:
                node["calls"][cmd] = max(0, node["calls"][cmd] - polls * len(mine))
        if mine:
            node["reads"] = max(0, node["reads"] - polls)
        node["commands"] = sum(node["calls"].values())
    return nodes


def drain_once(cfg: Config, store: Store, side: RedisServer, *, tag: str, messages: int, warmup: int,
               concurrency: int, timeout: float = 600.0) -> dict[str, Any]:
    """One measured drain on fresh workers whose store is ``store``: an unmeasured warm-up drain,
    ``IDLE_S`` of the workers idle, the backlog written, then the measured drain."""
    with contextlib.ExitStack() as st:
        r = connect(store.url, socket_timeout=30)
        st.callback(close, r)
        topic, group = f"drain-{tag}", f"g-{tag}"
        env = mq_env(store.url, topic=topic, group=group, lanes=2, MQORDER_CONSUME_MESSAGE_BATCH_MAX_SIZE="32",
                     MQORDER_PULL_BATCH_SIZE="32", MQORDER_REBALANCE_INTERVAL_MS="3600000",
                     MQORDER_CELERY_BROKER_URL=side.url)
        names = [f"{tag}-w{i}" for i in range(2)]
        log(f"cluster: {tag}: 2 workers -c {concurrency} on {LABELS[store.kind]}")
        ws = start_mq_workers(st, store.url, names, env, concurrency, cfg.logdir / tag)
        app = ctl_app(side.url)
        st.callback(app.close)
        meter = NodeMeter(store.nodes)
        st.callback(meter.close)
        side_pid = server_pid(side)
        res: dict[str, Any] = {}
        for lane, (t, g) in enumerate(lane_names(topic, group, 2)):
            n = warmup if lane == 0 else messages
            if lane == 1:
                meter.start()
                time.sleep(IDLE_S)
                res["idle"] = meter.stop()
            meter.start()
            produce_s = produce_backlog(store.url, t, QUEUES, n, KEYS, hold=True)
            produced = meter.stop()
            mqs = queues_of(t, QUEUES)
            sizes = _queue_sizes(r, mqs)
            time.sleep(0.3)  # let the producer's CPU burst settle
            if total_lag(r, g, mqs) != n:
                raise RuntimeError(f"cluster {tag}: messages were consumed before the clock started")
            polls = 1  # wait_lag_zero's last poll, the one that finds the lag 0

            def count() -> None:
                nonlocal polls
                polls += 1

            meter.start()
            cpu_w0, cpu_b0 = tree_cpu_s(w.pid for w in ws), cpu_s(side_pid)
            t0 = time.perf_counter()
            kick(store.url, app, t)
            t1 = wait_lag_zero(r, g, mqs, timeout, interval=POLL_S, on_poll=count,
                               alive=lambda: all(w.alive() for w in ws))
            drained = meter.stop()
            cpu_w, cpu_b = tree_cpu_s(w.pid for w in ws) - cpu_w0, cpu_s(side_pid) - cpu_b0
            secs = t1 - t0
            res.update({
                "kind": store.kind, "messages": n, "queues": QUEUES, "concurrency": concurrency,
                "seconds": secs, "rate": n / secs, "produce_s": produce_s, "produce_rate": n / produce_s,
                "worker_cpu_s": cpu_w, "celery_broker_cpu_s": cpu_b, "polls": polls, "idle_s": IDLE_S,
                "nodes": _per_node(drained, store, mqs, sizes, polls),
                "produce_nodes": _per_node(produced, store, mqs, sizes),
            })
            log(f"cluster: {tag} {'warm-up' if lane == 0 else 'run'}: {n:,} msgs in {secs:.2f} s = "
                f"{res['rate']:,.0f} msg/s; Redis CPU {sum(x['cpu_s'] for x in res['nodes']) / n * 1e6:.2f} µs/msg, "
                f"{sum(x['commands'] for x in res['nodes']) / n:.3f} commands/msg, "
                f"{sum(x['reads'] for x in res['nodes']) / n:.4f} reads/msg (per node: "
                f"{', '.join(str(x['commands']) for x in res['nodes'])} commands); produced at "
                f"{res['produce_rate']:,.0f} msg/s")
            pipe = r.pipeline(transaction=False)  # free the run's log memory
            for mq in mqs:
                pipe.unlink(keys.queue_log(mq.tag))
            pipe.execute()
    return res


def one_node_cluster(st: contextlib.ExitStack) -> Store:
    """A redis-server in cluster mode serving all 16,384 slots alone: Redis's cluster mode without
    sharding, the control that separates what cluster mode costs Redis per command from what
    spreading the queues over shards costs."""
    workdir = Path(tempfile.mkdtemp(prefix="mqorder-bench-cluster1-"))
    st.callback(shutil.rmtree, workdir, ignore_errors=True)
    node = RedisServer(workdir=str(workdir), cluster_bus=True, extra_args=[
        "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf")])
    node.start()
    st.callback(node.stop)
    c = redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=10)
    try:
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 30
        while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"one-node cluster on port {node.port} not ok within 30 s")
            time.sleep(0.05)
    finally:
        c.close()
    return Store("cluster1", f"redis+cluster://127.0.0.1:{node.port}/", [node], lambda mq: 0)


def run(cfg: Config, *, messages: int, runs: int, concurrency: int) -> dict[str, Any]:
    """``runs`` drains on each store, interleaved run by run (the order rotating)."""
    out: dict[str, Any] = {"messages": messages, "concurrency": concurrency, "queues": QUEUES, "masters": MASTERS,
                           "poll_s": POLL_S, "runs": {k: [] for k in KINDS}}
    with contextlib.ExitStack() as st:
        side = redis_server(st)  # Celery's broker, for every store
        single = redis_server(st)
        stores = {"single": Store("single", single.url, [single], lambda mq: 0), "cluster1": one_node_cluster(st),
                  "cluster": cluster_store(st.enter_context(ClusterDeployment(masters=MASTERS)))}
        for i in range(runs):
            for kind in KINDS[i % len(KINDS):] + KINDS[: i % len(KINDS)]:
                res = drain_once(cfg, stores[kind], side, tag=f"cl-{kind}-{i}", messages=messages,
                                 warmup=min(5000, messages), concurrency=concurrency)
                res["run"] = i
                out["runs"][kind].append(res)
    return out

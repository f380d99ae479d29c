"""Rebalance + lock of 1,024 queues over 8 clients, timed around ``RebalanceService.rebalance()``.

Per run, on a flushed redis-server: one topic with 1,024 queues (the per-broker maximum), one
clustering group subscribed to it, 8 fake clients registered with ``ClientRegistry`` (fresh
heartbeats). The timed call computes the allocation and applies it through ``assign.lua``, which
takes all 1,024 locks (new epochs). A second timed call right after measures a rebalance with
nothing to move (every lock kept), and a third after one client left moves its 128 queues.
"""

from __future__ import annotations

import contextlib
import time

from bench.common import Config, log, redis_and_client
from mqorder.model import MessageModel
from mqorder.rebalance.membership import Subscription
from mqorder.rebalance.service import RebalanceService
from mqorder.settings import load_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager


def run(cfg: Config, *, queues: int = 1024, clients: int = 8, runs: int = 5) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"initial": [], "unchanged": [], "one_left": []}
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        settings = load_settings(redis_url=srv.url)
        brokers = BrokerRegistry(srv.url)
        st.callback(brokers.close)
        for run in range(-1, runs):
            r.flushall()
            topics = TopicManager(brokers)
            topics.create_topic("rb", queues)
            topics.subscribe("g-rb", "rb", MessageModel.CLUSTERING)
            svc = RebalanceService(brokers, settings)
            ids = [f"fake-{i}@bench" for i in range(clients)]
            for cid in ids:
                svc.registry.register(cid, [Subscription("g-rb", "rb", MessageModel.CLUSTERING)])
            timings = {}
            for phase in ("initial", "unchanged", "one_left"):
                if phase == "one_left":
                    svc.registry.unregister(ids[-1])
                t0 = time.perf_counter()
                report = svc.rebalance()
                wall = (time.perf_counter() - t0) * 1000
                timings[phase] = {"wall_ms": wall, "took_ms": report.took_ms, "assigned": report.assigned,
                                  "moved": report.moved, "clients": len(report.clients)}
            if timings["initial"]["moved"] != queues:
                raise RuntimeError(f"rebalance locked {timings['initial']['moved']} of {queues} queues")
            if run < 0:
                continue  # warm-up: script load, connections
            for phase, t in timings.items():
                out[phase].append(t)
            log("rebalance run {}: initial {:.1f} ms, unchanged {:.1f} ms, one left {:.1f} ms ({} moved)".format(
                run, timings["initial"]["wall_ms"], timings["unchanged"]["wall_ms"], timings["one_left"]["wall_ms"],
                timings["one_left"]["moved"]))
    return out

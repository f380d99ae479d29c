"""Transactional send rate against ``send_orderly``: the same workload sent one by one with
``send_orderly`` and with ``send_in_transaction`` (an executor that commits at once: phase one,
phase two, nothing else), interleaved run by run on one redis-server.

A transactional send is two script calls (``txn_prepare.lua``, ``txn_end.lua``) where
``send_orderly`` is one. ``python -m bench.run --only transactions``.
"""

from __future__ import annotations

import contextlib
import time

from bench.common import Config, Workload, log, redis_and_client
from mqorder.client.transaction import LocalTransactionState, TransactionProducer
from mqorder.model import MessageModel

VARIANTS = ("send_orderly", "send_in_transaction")


def _commit(msg: object, arg: object) -> LocalTransactionState:
    return LocalTransactionState.COMMIT


def run(cfg: Config, *, messages: int, runs: int = 3, queues: int = 16, n_keys: int = 2000) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        for run_no in range(runs):
            for variant in VARIANTS:
                r.flushall()
                p = TransactionProducer(srv.url)
                p.create_topic("prod", queues=queues)
                p.topics.subscribe("g-prod", "prod", MessageModel.CLUSTERING)
                p.send_in_transaction("prod", b"warm", sharding_key="warm", executor=_commit)  # caches, scripts
                items = Workload(n_keys).items(messages)
                t0 = time.perf_counter()
                if variant == "send_orderly":
                    for key, body in items:
                        p.send_orderly("prod", body, sharding_key=key)
                else:
                    for key, body in items:
                        p.send_in_transaction("prod", body, sharding_key=key, executor=_commit)
                secs = time.perf_counter() - t0
                out[variant].append({"messages": messages, "seconds": secs, "rate": messages / secs})
                p.close()
            log(f"transactions run {run_no}: " + ", ".join(f"{v} {out[v][-1]['rate']:,.0f}/s" for v in VARIANTS))
    return out

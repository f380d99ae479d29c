"""Dedup-window overhead on ``send_orderly``: the same workload sent without a dedup key, with a
key per send (``dedup_key=``) and with keys derived from the message id (``MQORDER_DEDUP_DERIVE=
msg_id``), interleaved run by run on one redis-server so the three rows share the machine's state.

A keyed send does, in the same Lua call, an ``HMGET`` of its key, an ``HSET`` + ``ZADD`` to
remember it, a ``ZRANGEBYSCORE`` to forget expired keys and two ``PEXPIRE``: this section says what
that costs per message. ``python -m bench.run --only dedup``.
"""

from __future__ import annotations

import contextlib
import time

from bench.common import Config, Workload, log, redis_and_client
from mqorder import Producer
from mqorder.model import MessageModel

VARIANTS = ("no_key", "dedup_key", "derive_msg_id")


def run(cfg: Config, *, messages: int, runs: int = 3, queues: int = 16, n_keys: int = 2000) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        for run_no in range(runs):
            for variant in VARIANTS:
                r.flushall()
                p = Producer(srv.url, dedup_derive="msg_id" if variant == "derive_msg_id" else "none")
                p.create_topic("prod", queues=queues)
                p.topics.subscribe("g-prod", "prod", MessageModel.CLUSTERING)
                p.send_orderly("prod", b"warm", sharding_key="warm", dedup_key="warm")  # caches, script load
                items = Workload(n_keys).items(messages)
                keyed = variant == "dedup_key"
                r.config_resetstat()
                t0 = time.perf_counter()
                for i, (key, body) in enumerate(items):
                    p.send_orderly("prod", body, sharding_key=key, dedup_key=f"evt-{i}" if keyed else None)
                secs = time.perf_counter() - t0
                # Redis's own time in the send script: the window's cost without the client's noise.
                usec = float(r.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))
                out[variant].append({"messages": messages, "seconds": secs, "rate": messages / secs,
                                     "redis_usec_per_call": usec})
                p.close()
            log(f"dedup run {run_no}: " + ", ".join(
                f"{v} {out[v][-1]['rate']:,.0f}/s ({out[v][-1]['redis_usec_per_call']:.1f} us in Redis)" for v in VARIANTS))
    return out

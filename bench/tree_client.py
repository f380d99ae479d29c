"""The client side of one configuration of an A/B, run from that configuration's own source tree.

An A/B of two engines (``bench.trickle_cost --spec before=/tmp/tree-HEAD --spec after=.``) must
send with each tree's producer too: ``send.lua`` is a third of a trickling message's Redis time,
and a producer from this tree would charge the after-tree's send path to both sides. So every
configuration gets one of these processes, its working directory and ``PYTHONPATH`` that tree
(run with ``runpy`` from ``python -c``, so the tree comes first on ``sys.path``, not ``bench/``,
whose ``concurrent.py`` would shadow the standard library's), driven by JSON lines on stdin; each request is answered by
one JSON line on stdout (``{"error": ...}`` when it failed). It imports mqorder, celery and the
standard library only, so it runs against any tree that has a ``Producer``.

Requests (``op``):

* ``create``: ``topic``, ``queues``, ``perm`` ("rw", or "w": a backlog nobody consumes yet).
* ``paced``: ``topic``, ``n`` messages at ``rate`` msg/s, one ``send_orderly`` each on a fixed
  schedule (as ``bench.latency.paced``), keys from a seeded sequence over ``keys`` keys (the
  same in every configuration); the body is ``time.time_ns()`` for the latency listener (prefixed
  with ``w`` when ``warmup``). Answers this process's CPU seconds over the sends and the rate.
* ``backlog``: ``topic``, ``n`` messages with ``send_orderly_batch`` in chunks of 10,000.
* ``scripts``: the SHA1 of every script this tree sends, to its name (``EVALSHA <sha>`` in the
  SLOWLOG → ``begin``).
* ``lua_floor``: µs per ``EVALSHA`` of an empty script and of each of ``scripts``' preludes alone.
* ``kick``: open ``topic`` for reading, one rebalance from here, dispatch what it asks for through
  a Celery app on ``broker`` (``bench.common.kick``, with this tree's code).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

from mqorder import Producer

#: ``lua_floor``'s measured rounds per variant (after one unmeasured round).
ROUNDS = 5
WARMUP_PREFIX = b"w"  # bench.listeners.WARMUP_PREFIX, spelled again: bench is not importable here


class Keys:
    """Sharding keys ``key-<k>`` at random over ``n`` keys, seeded (``bench.common.Workload``'s sequence)."""

    def __init__(self, n: int, seed: int = 42) -> None:
        self.n, self.rng = n, random.Random(seed)

    def next(self) -> str:
        return f"key-{self.rng.randrange(self.n)}"


def paced(p: Producer, req: dict[str, Any], keys: Keys) -> dict[str, Any]:
    topic, n, rate = req["topic"], int(req["n"]), float(req["rate"])
    prefix = WARMUP_PREFIX if req.get("warmup") else b""
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        p.send_orderly(topic, prefix + str(time.time_ns()).encode(), sharding_key=keys.next())
    secs = time.perf_counter() - t0
    return {"cpu_s": time.process_time() - cpu0, "seconds": secs, "rate": n / secs}


def backlog(p: Producer, req: dict[str, Any], keys: Keys) -> dict[str, Any]:
    n, chunk = int(req["n"]), 10_000
    t0 = time.perf_counter()
    for c in range(0, n, chunk):
        p.send_orderly_batch(req["topic"], [(keys.next(), b'{"k":0}') for _ in range(min(chunk, n - c))])
    return {"seconds": time.perf_counter() - t0}


def kick(url: str, req: dict[str, Any]) -> dict[str, Any]:
    from celery import Celery

    from mqorder.celery.dispatch import dispatch
    from mqorder.rebalance.service import RebalanceService
    from mqorder.settings import load_settings
    from mqorder.store.brokers import BrokerRegistry

    app = Celery("tree-client", broker=req["broker"], set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True)
    brokers = BrokerRegistry(url)
    try:
        svc = RebalanceService(brokers, load_settings(redis_url=url))
        svc.topics.update_perm(req["topic"], "rw")
        report = svc.rebalance()
        for d in report.dispatches or []:
            dispatch(app, d.sub, d.mq.key, d.token, d.client)
        return {"dispatched": len(report.dispatches or [])}
    finally:
        brokers.close()
        app.close()


def scripts() -> dict[str, Any]:
    import hashlib

    from mqorder.store import scripts as s

    return {"names": {hashlib.sha1(s.source(n).encode()).hexdigest(): n for n in s.NAMES}}


def lua_floor(url: str, req: dict[str, Any]) -> dict[str, Any]:
    """µs per ``EVALSHA`` (Redis's ``commandstats``) of ``return 0`` alone, and of each named script's
    preludes alone (every function it includes defined, then ``return 0``): what a call costs before
    the script's own body runs. Run on a Redis nothing else uses yet.

    A floor: the ``n`` calls of each variant go in ``ROUNDS`` rounds, the variants taking turns
    after one unmeasured round each, and each variant's figure is its cheapest round. Measured one
    after the other in one go, the first variant took the Redis's warm-up and a busy machine's
    pauses (an empty script read 11.8 µs against 7.0 for send.lua's preludes in one CI run)."""
    import redis

    from mqorder.store import scripts as s

    variants = {"": "return 0"}
    for name in req["scripts"]:
        variants[name] = "\n".join(s._read(p) or "" for p in s.include_order(name)) + "\nreturn 0"
    per_round = max(1, int(req.get("n", 2000)) // ROUNDS)
    r = redis.Redis.from_url(url)

    def stat() -> tuple[int, int]:
        v = r.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
        return int(v["calls"]), int(v["usec"])

    best: dict[str, float | None] = {}
    try:
        shas = {name: r.script_load(src) for name, src in variants.items()}
        for rnd in range(ROUNDS + 1):
            for name, sha in shas.items():
                if name in best and best[name] is None:
                    continue
                c0, u0 = stat()
                try:
                    for _ in range(per_round):
                        r.evalsha(sha, 0)
                except redis.ResponseError:  # a prelude that needs KEYS or ARGV at load: not measurable alone
                    best[name] = None
                    continue
                c1, u1 = stat()
                if rnd:  # round 0 warms up
                    us = (u1 - u0) / (c1 - c0)
                    prev = best.get(name)
                    best[name] = us if prev is None else min(prev, us)
    finally:
        r.close()
    return {"empty_us": best.pop(""), "preludes_us": best}


def serve(url: str) -> None:
    p = Producer(url)
    keys: dict[str, Keys] = {}
    try:
        for line in sys.stdin:
            req = json.loads(line)
            try:
                op = req["op"]
                if op == "exit":
                    return
                ks = keys.setdefault(req.get("topic", ""), Keys(int(req.get("keys", 2000))))
                if op == "create":
                    p.create_topic(req["topic"], queues=int(req["queues"]), perm=req.get("perm", "rw"))
                    out: dict[str, Any] = {}
                elif op == "paced":
                    out = paced(p, req, ks)
                elif op == "backlog":
                    out = backlog(p, req, ks)
                elif op == "kick":
                    out = kick(url, req)
                elif op == "scripts":
                    out = scripts()
                elif op == "lua_floor":
                    out = lua_floor(url, req)
                else:
                    out = {"error": f"unknown op {op!r}; use create, paced, backlog, kick, scripts, lua_floor or exit"}
            except Exception as exc:  # noqa: BLE001 - answered to the driver, which raises it
                out = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        p.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/tree_client.py REDIS_URL (requests as JSON lines on stdin)")
    serve(sys.argv[1])

"""Per-message cost of the consume path, taken apart.

* ``decode``: ``codec.decode_entries`` on 32-entry XRANGE replies (µs per message), in process.
* ``engine in-process``: mqorder's own ``ConsumeRequest`` driven directly in this process, no
  Celery, one process, the no-op listener: begin.lua, the consume loop, one commit.lua per pulled
  batch, finish.lua; the ceiling of the engine itself, to compare with the raw reader and with
  the Celery-driven drain.
* ``profile``: the same in-process run under ``cProfile``; the top functions by own time go into
  RESULTS.md as a pointer to the hot path (profiling overhead inflates the absolute numbers).

The Celery-side counts (tasks per message, EVALSHA and XRANGE per pulled batch) come from the
drain runs themselves (``bench.mqorder_drain``).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import time
import uuid
from typing import Any

from bench.common import Config, client, cpu_s, log, produce_backlog, queues_of, redis_and_client, server_pid
from mqorder import ConsumeOrderlyStatus, keys
from mqorder.codec import decode_entries


def _noop(msgs, ctx):
    return ConsumeOrderlyStatus.SUCCESS


def decode_us_per_msg(r: Any, topic: str, batches: int = 400) -> float:
    mq = queues_of(topic, 1)[0]
    entries = r.xrange(keys.queue_log(mq.tag), count=32)
    decode_entries(mq, entries)
    t0 = time.perf_counter()
    for _ in range(batches):
        decode_entries(mq, entries)
    return (time.perf_counter() - t0) / (batches * len(entries)) * 1e6


def engine_pass(url: str, topic: str, queues: int, group: str, batch_max: int,
                profile: cProfile.Profile | None = None) -> tuple[int, float, float]:
    """Drain every queue of ``topic`` for ``group`` with in-process ConsumeRequests."""
    from mqorder.consumer.consume_request import ConsumeRequest
    from mqorder.consumer.engine import ConsumerEngine
    from mqorder.consumer.listener import ListenerSpec
    from mqorder.settings import load_settings

    settings = load_settings(redis_url=url, consume_message_batch_max_size=batch_max)
    spec = ListenerSpec(func=_noop, topic=topic, group=group)
    engine = ConsumerEngine(settings, "inprocess@bench")
    r = client(url)
    n = 0
    try:
        c0 = time.process_time()
        t0 = time.perf_counter()
        for mq in queues_of(topic, queues):
            token = uuid.uuid4().hex
            r.hset(keys.sub_state(mq.tag, group), "pending", token)
            if profile is not None:
                profile.enable()
            outcome = ConsumeRequest(engine, spec, group, mq, token).run()
            if profile is not None:
                profile.disable()
            n += outcome.consumed
        secs = time.perf_counter() - t0
        cpu = time.process_time() - c0
    finally:
        r.close()
        engine.brokers.close()
    return n, secs, cpu


def run(cfg: Config, *, messages: int, runs: int = 3, queues: int = 16,
        profile_messages: int = 50_000) -> dict[str, Any]:
    out: dict[str, Any] = {"engine_b1": [], "engine_b32": []}
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        topic = "cost"
        produce_backlog(srv.url, topic, queues, messages, 2000)
        redis_pid = server_pid(srv)
        out["decode_us_per_msg"] = min(decode_us_per_msg(r, topic) for _ in range(3))
        engine_pass(srv.url, topic, 1, "warmup", 1)  # script load, imports
        for run in range(runs):
            for b in (1, 32):
                rc0 = cpu_s(redis_pid)
                n, secs, cpu = engine_pass(srv.url, topic, queues, f"g-b{b}-{run}", b)
                rcpu = cpu_s(redis_pid) - rc0
                if n != messages:
                    raise RuntimeError(f"in-process engine consumed {n} of {messages}")
                out[f"engine_b{b}"].append({"messages": n, "seconds": secs, "rate": n / secs, "worker_cpu_s": cpu,
                                            "redis_cpu_s": rcpu})
                log(f"engine in-process batch {b} run {run}: {n / secs:,.0f} msg/s (CPU {cpu / n * 1e6:.1f} µs/msg, "
                    f"redis CPU {rcpu / n * 1e6:.1f} µs/msg)")
        # Profile on a smaller topic so the profiler's own overhead stays bearable.
        produce_backlog(srv.url, "costprof", queues, profile_messages, 2000)
        for b in (1, 32):
            prof = cProfile.Profile()
            engine_pass(srv.url, "costprof", queues, f"g-prof-b{b}", b, profile=prof)
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            rows = []
            for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
                rows.append({"function": f"{_short(file)}:{line}({func})", "calls": nc, "tottime_s": tt,
                             "cumtime_s": ct})
            rows.sort(key=lambda x: -x["tottime_s"])
            total = sum(x["tottime_s"] for x in rows)
            out[f"profile_b{b}"] = {"messages": profile_messages, "total_s": total, "top": rows[:15]}
    return out


def _short(path: str) -> str:
    for marker in ("/mqorder/", "/site-packages/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1] if marker != "/mqorder/" else "mqorder/" + path.split(marker, 1)[1]
    return path

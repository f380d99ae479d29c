"""Retention under a steady load: Redis memory stays bounded, and trimming costs consumers little.

*Steady*: one stock worker pair (prefork) consumes a 16-queue topic with ``retention_ms`` 30 s
(time policy, the default pass every ``MQORDER_RETENTION_INTERVAL_MS`` = 5000) while this process
sends 1 KiB bodies at a steady rate (5,000 msg/s) for 5 minutes with ``send_orderly_batch`` every
50 ms. Redis's own ``used_memory`` is sampled every second. The *working set* is what the first
``retention_ms`` of traffic added to ``used_memory`` (nothing can be trimmed before then); the
figure is the highest ``used_memory`` above its starting level afterwards, as a multiple of it.

*Drain*: the no-op drain of the throughput section, with trimming right behind the consumers
(consumed policy, no replay window, a pass every second) against trimming off (no pass during
the run), alternating, on separate worker pairs; the ratio of medians is the cost of trimming.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Config, log, mq_env, queues_of, redis_and_client, start_mq_workers, summarize, total_lag
from bench.mqorder_drain import DrainSpec, drain

BODY = b"x" * 1024
TICK_S = 0.05


def steady(cfg: Config, *, rate: int, seconds: float, retention_ms: int, concurrency: int, queues: int = 16,
           n_keys: int = 2000) -> dict[str, Any]:
    from mqorder import Producer

    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        topic, group = "ret", "g-ret"
        p = Producer(srv.url)
        st.callback(p.close)
        p.create_topic(topic, queues=queues, retention_ms=retention_ms)
        env = mq_env(srv.url, topic=topic, group=group)
        log(f"retention: 2 workers -c {concurrency}, {rate:,} msg/s of {len(BODY)} B for {seconds:.0f}s, "
            f"retention {retention_ms / 1000:.0f}s")
        start_mq_workers(st, srv.url, ["ret-w0", "ret-w1"], env, concurrency, cfg.logdir / "retention")
        mqs = queues_of(topic, queues)
        base = int(r.info("memory")["used_memory"])
        samples: list[tuple[float, int, int]] = []  # (s, used_memory, lag)
        stop = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter() - t0, int(r.info("memory")["used_memory"]), total_lag(r, group, mqs)))
                stop.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        per_tick = max(1, int(rate * TICK_S))
        sent, tick, late = 0, 0, 0
        try:
            while time.perf_counter() - t0 < seconds:
                due = t0 + tick * TICK_S
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                elif wait < -1.0:
                    late += 1
                p.send_orderly_batch(topic, [(f"key-{(sent + i) % n_keys}", BODY) for i in range(per_tick)])
                sent += per_tick
                tick += 1
        finally:
            stop.set()
            sampler.join(5)
        elapsed = time.perf_counter() - t0
        time.sleep(2.0)
        lag_end = total_lag(r, group, mqs)
    ws_at = retention_ms / 1000
    before = [u for s, u, _ in samples if s <= ws_at]
    after = [u for s, u, _ in samples if s > ws_at]
    working_set = (before[-1] - base) if before else 0
    peak_excess = (max(after) - base) if after else 0
    res = {
        "rate": rate, "seconds": seconds, "elapsed_s": elapsed, "sent": sent, "send_rate": sent / elapsed,
        "retention_ms": retention_ms, "body": len(BODY), "queues": queues, "concurrency": concurrency,
        "base_used": base, "working_set": working_set, "peak_excess": peak_excess,
        "ratio": peak_excess / working_set if working_set else None,
        "max_lag": max((lag for _, _, lag in samples), default=0), "lag_end": lag_end, "late_ticks": late,
        "series": [(round(s, 1), u, lag) for s, u, lag in samples],
    }
    log(f"retention: sent {sent:,} ({res['send_rate']:,.0f} msg/s); working set {working_set / 1048576:.0f} MiB, "
        f"peak {peak_excess / 1048576:.0f} MiB above start = {res['ratio'] or 0:.2f}x; max lag {res['max_lag']:,}")
    return res


def drain_cost(cfg: Config, *, messages: int, runs: int, concurrency: int) -> dict[str, Any]:
    """Drain rate with trimming right behind the consumers vs without, alternating."""
    modes = {
        "on": {"MQORDER_RETENTION_POLICY": "consumed", "MQORDER_RETENTION_MIN_MS": "0",
               "MQORDER_RETENTION_INTERVAL_MS": "1000"},
        "off": {"MQORDER_RETENTION_INTERVAL_MS": "3600000"},
    }
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for run in range(runs):
        for mode, env in modes.items():
            spec = DrainSpec(tag=f"ret-{mode}-{run}", concurrency=concurrency, batch_max=32,
                             plan=[(16, messages)], warmup=0, env=env)
            out[mode] += drain(cfg, spec)
    on = summarize(x["rate"] for x in out["on"])
    off = summarize(x["rate"] for x in out["off"])
    log(f"retention drain: trimming on {on.median:,.0f} msg/s vs off {off.median:,.0f} = {on.median / off.median:.2f}x")
    return {"messages": messages, "concurrency": concurrency, **out}


def plot(res: dict[str, Any], path: Path) -> Path | None:
    """``used_memory`` over the steady run, with the working set and the 2x bound marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = res["steady"]
    xs = [t for t, _, _ in s["series"]]
    ys = [(u - s["base_used"]) / 1048576 for _, u, _ in s["series"]]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(xs, ys, lw=1.2, label="Redis used_memory above its start")
    ws = s["working_set"] / 1048576
    ax.axhline(ws, color="tab:green", ls="--", lw=1, label=f"working set ({s['retention_ms'] / 1000:.0f} s of traffic)")
    ax.axhline(2 * ws, color="tab:red", ls=":", lw=1, label="2x working set (bound)")
    ax.axvline(s["retention_ms"] / 1000, color="grey", lw=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title(f"{s['send_rate']:,.0f} msg/s of {s['body']} B, retention {s['retention_ms'] / 1000:.0f} s")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

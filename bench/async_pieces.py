"""The engine pieces of one async key-mode run, in one process, without Celery (issue 31).

    python -m bench.async_pieces --messages 20000 [--profile out.prof]
    python -m bench.async_pieces --ab /tmp/tree-abc --rounds 5   # same-run A/B, interleaved

One prefork child of the keys section's async row, isolated: a ``ConsumerEngine`` drains one queue
(``messages`` messages over ``keys`` keys, as ``bench.keys``'s 2,000 keys over 16 queues) with an
``async def`` listener awaiting ``sleep_ms`` per message, ``key_concurrency`` 16, against a real
redis-server. It prints the CPU the draining thread (the run's dispatcher, which drives the loop)
and the process spent per message: what the worker's children spend per message minus Celery,
so a change to the run can be measured on a shared machine without the noise of 16 processes.
``--ab ROOT`` runs this file in subprocesses alternately on ``ROOT`` (another commit's tree) and on
this tree, and prints the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def one(messages: int, keys: int, sleep_ms: float, kc: int, profile: str) -> dict[str, float]:
    from mqorder import ConsumeOrderlyStatus, Producer
    from mqorder.consumer.engine import ConsumerEngine
    from mqorder.consumer.listener import ListenerSpec
    from mqorder.model import MessageQueue
    from mqorder.rebalance.lock_manager import RebalanceLockManager
    from mqorder.settings import load_settings
    from mqorder.store.log import MessageLog
    from mqorder.testing.embedded import RedisServer

    ok = ConsumeOrderlyStatus.SUCCESS
    pause = sleep_ms / 1000
    done = [0]

    async def listener(msgs, ctx):  # the bench's async_sleeper, without its Redis counter
        if pause:  # (0: no await at all, the engine's own cost alone)
            await asyncio.sleep(pause * len(msgs))
        done[0] += len(msgs)
        return ok

    with contextlib.ExitStack() as st:
        srv = st.enter_context(RedisServer())
        settings = load_settings(redis_url=srv.url)
        p = Producer(settings=settings)
        st.callback(p.close)
        p.create_topic("t", queues=1)
        for i in range(0, messages, 5000):
            p.send_orderly_batch("t", [(f"key-{(i + j) % keys}", b"x" * 64) for j in range(min(5000, messages - i))])
        eng = ConsumerEngine(settings, "c1")
        st.callback(eng.brokers.close)
        spec = ListenerSpec(listener, "t", "g", ordering="key", key_concurrency=kc)
        mq = MessageQueue("t", "broker-a", 0)
        RebalanceLockManager(eng.brokers).assign("g", [(mq, "c1", "tok0")])
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile(time.thread_time)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        if prof:
            prof.enable()
        token = "tok0"
        while done[0] < messages:
            out = eng.run(spec, "g", mq, token)
            if out is None or not out.needs_dispatch:
                break
            time.sleep(out.countdown)
            token = out.token
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        wall, cpu, pcpu = time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0
        committed = MessageLog(eng.brokers).consume_offset("g", mq)
    return {"messages": done[0], "committed": committed, "wall_s": wall, "rate": done[0] / wall,
            "thread_us": cpu / done[0] * 1e6, "process_us": pcpu / done[0] * 1e6, "load1": os.getloadavg()[0]}


def ab(root: str, rounds: int, argv: list[str]) -> None:
    trees = [("before", str(Path(root).resolve())), ("after", str(HERE))]
    rows: dict[str, list[dict[str, float]]] = {k: [] for k, _ in trees}
    for rnd in range(rounds):
        for key, tree in (trees if rnd % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, "-m", "bench.async_pieces", "--json", *argv], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            rows[key].append(res)
            print(f"round {rnd + 1} [{key}]: {res['rate']:,.0f} msg/s, thread {res['thread_us']:.1f} µs/msg, "
                  f"process {res['process_us']:.1f} µs/msg, load1 {res['load1']:.2f}", flush=True)
    base = None
    for key, _ in trees:
        rs = rows[key]
        med = {f: statistics.median(r[f] for r in rs) for f in ("rate", "thread_us", "process_us", "load1")}
        base = base or med
        print(f"[{key}] medians of {len(rs)}: " + ", ".join(
            f"{f} {med[f]:,.1f} ({min(r[f] for r in rs):,.1f}-{max(r[f] for r in rs):,.1f}, "
            f"{med[f] / base[f]:.2f}x)" for f in ("rate", "thread_us", "process_us")) + f", load1 {med['load1']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--keys", type=int, default=125, help="2,000 keys over 16 queues: 125 per queue")
    ap.add_argument("--sleep-ms", type=float, default=10.0)
    ap.add_argument("--key-concurrency", type=int, default=16)
    ap.add_argument("--profile", default="", help="write a cProfile (thread CPU time) of the run here")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ab", default="", help="a baseline tree: A/B against this one")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.ab:
        ab(args.ab, args.rounds, ["--messages", str(args.messages), "--keys", str(args.keys), "--sleep-ms",
                                  str(args.sleep_ms), "--key-concurrency", str(args.key_concurrency)])
        return 0
    res = one(args.messages, args.keys, args.sleep_ms, args.key_concurrency, args.profile)
    print(json.dumps(res) if args.json else res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

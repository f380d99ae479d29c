"""Per-message cost of the trickle path, in process: what one message costs a lingering request.

At a steady trickle (the latency section: 1,000 msg/s over 16 queues, ~62 msg/s per queue) no
queue has a backlog: every message is read by a lingering ConsumeRequest's blocking read, on its
own queue or on one its ``IdleQueueWatch`` adopted (then the run switches to that queue). This pass
drives exactly that, without Celery and without the machine's noise: one ``ConsumerEngine`` in a
thread lingers over ``queues`` queues it owns; this thread sends one message at a time
(``send_orderly``, a seeded random queue per message, so about 1 in ``queues`` lands on the queue
the run is on) and waits until the no-op listener has seen it before sending the next.

Reported per message: the engine thread's CPU (``pthread_getcpuclockid``: user + system of that
thread alone, the producer excluded), the round trips and commands the engine thread sent to Redis
(counted in redis-py's connection), and the wake-ups published (a send the watch missed).

    python -m bench.trickle --messages 5000 --runs 5 [--floor]

``--floor`` interleaves ``floor_pass``: the same sends read by a bare loop making the same round
trip (the worker's floor for this shape), and reports the engine's CPU over it, run by run.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from bench.common import client, log, queues_of, redis_and_client
from mqorder import ConsumeOrderlyStatus, Producer, keys


class _RoundTrips:
    """Counts what one thread sends to Redis: round trips (a command, or a pipeline, sent) and
    commands (a pipeline's each), by wrapping redis-py's connection."""

    def __init__(self) -> None:
        from redis.connection import AbstractConnection

        self.cls = AbstractConnection
        self.thread = 0
        self.trips = self.commands = 0
        self._send, self._pack = AbstractConnection.send_packed_command, AbstractConnection.pack_commands
        me = self

        def send(conn: Any, command: Any, check_health: bool = True) -> None:
            if threading.get_ident() == me.thread:
                me.trips += 1
            return me._send(conn, command, check_health)

        def pack(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            if threading.get_ident() == me.thread:
                me.commands += len(commands) - 1  # send_packed_command counts one
            return me._pack(conn, commands)

        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.pack_commands = pack  # type: ignore[method-assign]
        try:
            from mqorder.store.raw_pipe import ConnectionLease
        except ImportError:  # an engine from before the consume path's own round trips
            self.raw = None
            return
        self.raw, self._raw_trip = ConnectionLease, ConnectionLease.round_trip

        def raw_trip(lease: Any, commands: Any, *args: Any) -> Any:
            if threading.get_ident() == me.thread:
                me.trips += 1
                me.commands += len(commands) - 1
            return me._raw_trip(lease, commands, *args)

        ConnectionLease.round_trip = raw_trip  # type: ignore[method-assign]

    def close(self) -> None:
        self.cls.send_packed_command = self._send  # type: ignore[method-assign]
        self.cls.pack_commands = self._pack  # type: ignore[method-assign]
        if self.raw is not None:
            self.raw.round_trip = self._raw_trip  # type: ignore[method-assign]


def _key_for(queue_id: int, n: int) -> str:
    i = 0
    while zlib.crc32(f"k{i}".encode()) % n != queue_id:
        i += 1
    return f"k{i}"


def trickle_pass(url: str, *, messages: int, queues: int = 8, seed: int = 1) -> dict[str, float]:
    """One pass on a fresh topic; see the module docstring."""
    from mqorder.consumer.engine import ConsumerEngine
    from mqorder.consumer.listener import ListenerSpec
    from mqorder.model import MessageModel
    from mqorder.rebalance.lock_manager import RebalanceLockManager
    from mqorder.settings import load_settings
    from mqorder.store.topics import TopicManager

    topic, sub, me = f"tr{seed}-{time.monotonic_ns()}", "g-trickle", "c1@trickle"
    settings = load_settings(redis_url=url)
    p = Producer(settings=settings)
    p.create_topic(topic, queues=queues)
    # What a worker's registration records: the group consumes the topic, so a send wakes its
    # queues' owner (or rings a lingering request's doorbell). Without it no send reaches the
    # engine's blocking read, which then finds each message only at its next adoption refresh.
    TopicManager(p.brokers).subscribe(sub, topic, MessageModel.CLUSTERING)
    mqs = queues_of(topic, queues)
    r = client(url)
    eng = ConsumerEngine(settings, me)
    r.hset(keys.assignment(sub), mapping={mq.key: me for mq in mqs})
    RebalanceLockManager(eng.brokers).assign(sub, [(mq, me, f"t{mq.queue_id}") for mq in mqs])
    linger = threading.Event()
    linger.set()
    eng.may_linger = linger.is_set
    one = _Pass()
    spec = ListenerSpec(one.listener, topic, sub)
    r.hset(keys.sub_state(mqs[0].tag, sub), mapping={"pending": "t0", "pend_until": 2**62})
    one.start(lambda: eng.run(spec, sub, mqs[0], "t0"))
    try:
        time.sleep(0.3)  # drained queue 0, lingering over all of them
        out = one.drive(p, topic, [_key_for(q, queues) for q in range(queues)], random.Random(seed), messages, r)
    finally:
        linger.clear()
        one.stop()
        p.close()
        r.close()
        eng.brokers.close()
    return out


class _Pass:
    """What both passes share: the no-op listener (a count, and an event set at each call), the
    consuming thread (its CPU is the figure), the round trips counted on it, and the sends."""

    def __init__(self) -> None:
        self.seen = threading.Event()
        self.count = 0
        self.counter = _RoundTrips()
        self.tid = 0
        self._thread: threading.Thread | None = None

    def listener(self, msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
        self.count += len(msgs)
        self.seen.set()
        return ConsumeOrderlyStatus.SUCCESS

    def start(self, body: Callable[[], object]) -> None:
        """Run ``body`` in the consuming thread."""
        def run() -> None:
            self.tid = self.counter.thread = threading.get_ident()
            body()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Wait for the consuming thread (its body told to end) and stop counting."""
        if self._thread is not None:
            self._thread.join(10)
        self.counter.close()

    def drive(self, p: Any, topic: str, key_of: list[str], rng: random.Random, messages: int,
              r: Any) -> dict[str, float]:
        """Send ``messages`` one at a time (a random queue each), each after the listener saw the
        last; the consuming thread's CPU, round trips and commands over them, per message."""
        queues, tid, counter, seen = len(key_of), self.tid, self.counter, self.seen
        clock = time.pthread_getcpuclockid(tid)
        c0, w0, us0 = time.clock_gettime(clock), _wakes(r), _user_sys(tid)
        trips0, cmd0 = counter.trips, counter.commands + counter.trips
        start = self.count
        for i in range(messages):
            seen.clear()
            p.send_orderly(topic, b"x", sharding_key=key_of[rng.randrange(queues)])
            if not seen.wait(5):
                raise TimeoutError(f"message {i} was not handled within 5 s")
        while self.count - start < messages:
            time.sleep(0.001)
        cpu = time.clock_gettime(clock) - c0
        us = [b - a for a, b in zip(us0, _user_sys(tid), strict=True)]
        trips, cmds = counter.trips - trips0, counter.commands + counter.trips - cmd0
        wakes = _wakes(r) - w0
        return {"messages": messages, "engine_cpu_us_per_msg": cpu / messages * 1e6,
                "engine_user_us_per_msg": us[0] / messages * 1e6, "engine_sys_us_per_msg": us[1] / messages * 1e6,
                "engine_round_trips_per_msg": trips / messages, "engine_commands_per_msg": cmds / messages,
                "wakes_per_msg": wakes / messages}


def floor_pass(url: str, *, messages: int, queues: int = 8, seed: int = 1) -> dict[str, float]:
    """The worker's floor for ``trickle_pass``'s shape: the same sends, read by a bare loop.

    One thread blocks on every queue's stream at once and, per message, makes the engine's one
    round trip (a script call with a commit's arguments, the blocking ``XREAD``, an ``HMGET`` of a
    state hash, a script call with a switch's keys and arguments, its candidates packed once as the
    engine's are: ``EVALSHA`` of ``return 0`` for both, on the engine's own connection code,
    ``ConnectionLease``), decodes the entry (``decode_entries``) and calls the same no-op listener. No lock, no fencing, no run object, no bookkeeping: what
    any Python worker pays to be woken for a trickling message and acknowledge it in one round
    trip. ``trickle_pass``'s figure over this one is what the engine's design adds.
    """
    from mqorder.codec import decode_entries
    from mqorder.consumer.context import ConsumeOrderlyContext
    from mqorder.consumer.idle_watch import ReadPlan
    from mqorder.consumer.linger import switch_command
    from mqorder.store.raw_pipe import ConnectionLease, RawPipeline, packed_args

    topic = f"fl{seed}-{time.monotonic_ns()}"
    p = Producer(settings=_settings(url))
    p.create_topic(topic, queues=queues)
    mqs = queues_of(topic, queues)
    r = client(url)
    sha = r.script_load("return 0")
    logs = [keys.queue_log(mq.tag) for mq in mqs]
    by_log = {k.encode(): mq for k, mq in zip(logs, mqs, strict=True)}
    state = keys.sub_state(mqs[0].tag, "g-floor")
    stop = threading.Event()
    one = _Pass()

    def work() -> None:
        lease = ConnectionLease(r)
        last = dict.fromkeys(logs, "0-0")
        # switch.lua's call as the engine makes it, its candidates (the other queues, four keys
        # and an offset each) packed once, as the engine's watch packs its adopted queues.
        others = mqs[1:]
        plan_keys = [k for mq in others for k in (keys.sub_state(mq.tag, "g-floor"), keys.queue_log(mq.tag),
                                                    keys.queue_next(mq.tag), keys.sub_retries(mq.tag, "g-floor"))]
        plan = ReadPlan("g-floor", mqs[0], others, plan_keys, [0] * len(others),
                        [packed_args(tuple(plan_keys[4 * i:4 * i + 4])) for i in range(len(others))],
                        [packed_args((0,)) for _ in others])
        while not stop.is_set():
            pipe = RawPipeline(lease)
            pipe.execute_command("EVALSHA", sha, 3, state, logs[0], logs[-1], "c1", 1, "t0", 0, 60000, 60000,
                                 "0", 0, 0)
            pipe.execute_command("XREAD", "COUNT", 32, "BLOCK", 100, "STREAMS", *logs, *last.values())
            pipe.execute_command("HMGET", state, "owner", "epoch", "pending", "assignee")
            pipe.execute_packed(switch_command(sha, [state, keys.queue_next(mqs[0].tag)], plan, [
                1, 0, 0, "c1", "t0", "switch", "t1", 60000, 60000, "!w", 2000, "c1", "!w", 60000, 60000, 32, "r"]))
            replies = pipe.execute(raise_on_error=True)
            read = replies[1]
            if not read:
                continue
            for stream, entries in (read.items() if isinstance(read, dict) else read):
                last[stream.decode()] = entries[-1][0].decode()
                mq = by_log[stream]
                one.listener(decode_entries(mq, entries), ConsumeOrderlyContext(
                    mq, epoch=1, client_id="c1", group="g-floor", still_owner=bool,
                    suspend_current_queue_time_millis=1000, run_id="r"))
        lease.release()

    one.start(work)
    try:
        time.sleep(0.3)
        out = one.drive(p, topic, [_key_for(q, queues) for q in range(queues)], random.Random(seed), messages, r)
    finally:
        stop.set()
        one.stop()
        p.close()
        r.close()
    return out


def _settings(url: str) -> Any:
    from mqorder.settings import load_settings

    return load_settings(redis_url=url)


def _user_sys(tid: int) -> tuple[float, float]:
    """User and system CPU seconds of one thread of this process (``/proc``, clock ticks)."""
    import os

    native = {t.ident: t.native_id for t in threading.enumerate()}[tid]
    with open(f"/proc/self/task/{native}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _wakes(r: Any) -> int:
    """PUBLISH calls so far (a send that woke somebody: the watch missed the queue)."""
    return int(r.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--floor", action="store_true",
                    help="also run floor_pass (a bare loop of the same round trip), interleaved run by run")
    args = ap.parse_args()
    for name in ("messages", "runs", "queues"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1 (got {getattr(args, name)}): a pass needs a queue, a message "
                     "and a run to measure")
    passes = {"trickle": trickle_pass, **({"floor": floor_pass} if args.floor else {})}
    out: dict[str, list[dict[str, float]]] = {name: [] for name in passes}
    with contextlib.ExitStack() as st:
        srv, _r = redis_and_client(st)
        for fn in passes.values():
            fn(srv.url, messages=200, queues=args.queues, seed=0)  # scripts loaded, imports
        for i in range(args.runs):
            for name, fn in passes.items():
                out[name].append(fn(srv.url, messages=args.messages, queues=args.queues, seed=1 + i))
    for name, res in out.items():
        for one in res:
            log(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in one.items()))
        log(f"{name} medians: " + ", ".join(f"{k} {statistics.median(r[k] for r in res):.2f}" for k in res[0]))
    if args.floor:
        cpu = "engine_cpu_us_per_msg"
        ratios = [e[cpu] / f[cpu] for e, f in zip(out["trickle"], out["floor"], strict=True)]
        log(f"engine / floor CPU per message: median {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}x, run by run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

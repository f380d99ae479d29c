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

    python -m bench.trickle --messages 5000 --runs 5
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import threading
import time
import zlib
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
    seen = threading.Event()
    count = [0]

    def listener(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
        count[0] += len(msgs)
        seen.set()
        return ConsumeOrderlyStatus.SUCCESS

    linger = threading.Event()
    linger.set()
    eng.may_linger = linger.is_set
    spec = ListenerSpec(listener, topic, sub)
    r.hset(keys.sub_state(mqs[0].tag, sub), mapping={"pending": "t0", "pend_until": 2**62})
    result: list[Any] = []
    tid: list[int] = []

    counter = _RoundTrips()

    def work() -> None:
        tid.append(threading.get_ident())
        counter.thread = tid[0]
        result.append(eng.run(spec, sub, mqs[0], "t0"))

    rng = random.Random(seed)
    key_of = [_key_for(q, queues) for q in range(queues)]
    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        time.sleep(0.3)  # drained queue 0, lingering over all of them
        clock = time.pthread_getcpuclockid(tid[0])
        c0, w0, us0 = time.clock_gettime(clock), _wakes(r), _user_sys(tid[0])
        trips0, cmd0 = counter.trips, counter.commands + counter.trips
        for i in range(messages):
            seen.clear()
            p.send_orderly(topic, b"x", sharding_key=key_of[rng.randrange(queues)])
            if not seen.wait(5):
                raise TimeoutError(f"message {i} was not handled within 5 s")
        while count[0] < messages:
            time.sleep(0.001)
        cpu = time.clock_gettime(clock) - c0
        us = [b - a for a, b in zip(us0, _user_sys(tid[0]), strict=True)]
        trips, cmds = counter.trips - trips0, counter.commands + counter.trips - cmd0
        wakes = _wakes(r) - w0
    finally:
        linger.clear()
        t.join(10)
        counter.close()
        p.close()
        r.close()
        eng.brokers.close()
    return {"messages": messages, "engine_cpu_us_per_msg": cpu / messages * 1e6,
            "engine_user_us_per_msg": us[0] / messages * 1e6, "engine_sys_us_per_msg": us[1] / messages * 1e6,
            "engine_round_trips_per_msg": trips / messages, "engine_commands_per_msg": cmds / messages,
            "wakes_per_msg": wakes / messages}


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
    args = ap.parse_args()
    with contextlib.ExitStack() as st:
        srv, _r = redis_and_client(st)
        trickle_pass(srv.url, messages=200, queues=args.queues, seed=0)  # scripts loaded, imports
        out = [trickle_pass(srv.url, messages=args.messages, queues=args.queues, seed=1 + i) for i in range(args.runs)]
    for res in out:
        log("trickle: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()))
    log("trickle medians: " + ", ".join(f"{k} {statistics.median(r[k] for r in out):.2f}" for k in out[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

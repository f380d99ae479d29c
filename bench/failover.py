"""Failover: seconds from ``kill -9`` of a worker owning queues until its queues progress elsewhere.

Three stock workers (stock settings: heartbeat interval/timeout, sweep, leases) consume a 16-queue
topic while a producer thread sends a steady stream (``send_orderly``, paced) over 2,000 keys.
Each round waits for a steady state (every queue locked by its assignee, all three workers owning
queues), picks a worker that owns queues (from each queue's lock entry), kills its whole process
group with SIGKILL (``WorkerProcess.kill()``), and polls the state hashes of the queues it owned:

* *moved*: the queue's lock is held by another worker (dead client detected, rebalance, assign.lua);
* *progress*: the queue's consume offset went past its value at the kill, committed by another
  worker (the figure: the time until every owned queue has progressed).

The killed worker is then restarted under the same name, and the next round begins.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from bench.common import ROOT, Config, Workload, log, mq_env, queues_of, redis_and_client, start_mq_workers
from mqorder import Producer, keys
from mqorder.testing.launcher import WorkerProcess


def _states(r: Any, group: str, mqs: list[Any]) -> list[tuple[str, int, int]]:
    """(owner with a live lease, consume offset, epoch) per queue."""
    pipe = r.pipeline(transaction=False)
    pipe.time()
    for mq in mqs:
        pipe.hmget(keys.sub_state(mq.tag, group), "owner", "offset", "lease", "epoch")
    res = pipe.execute()
    sec, usec = res[0]
    now = sec * 1000 + usec // 1000
    out = []
    for owner, offset, lease, epoch in res[1:]:
        live = (owner or b"").decode() if int(lease or 0) > now else ""
        out.append((live, int(offset or 0), int(epoch or 0)))
    return out


def _steady(r: Any, group: str, mqs: list[Any], hostnames: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assign = {k.decode(): v.decode() for k, v in r.hgetall(keys.assignment(group)).items()}
        owners = [s[0] for s in _states(r, group, mqs)]
        if (all(o and assign.get(mq.key) == o for o, mq in zip(owners, mqs, strict=True))
                and set(owners) == set(hostnames)):
            return
        time.sleep(0.1)
    raise TimeoutError(f"no steady state (every queue locked by its assignee, all of {hostnames} owning) "
                       f"within {timeout}s")


class Traffic(threading.Thread):
    """Paced ``send_orderly``; remembers when each send succeeded, so the first success after a
    fault says when sending resumed (``bench.sentinel`` kills the Redis primary under it)."""

    def __init__(self, url: str, topic: str, rate: float, n_keys: int, name: str = "bench-traffic") -> None:
        super().__init__(name=name, daemon=True)
        self.p = Producer(url)
        self.topic, self.rate, self.wl = topic, rate, Workload(n_keys)
        self.stop_ev = threading.Event()
        self.sent = 0
        self.errors = 0
        self.ok_at: list[float] = []

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop_ev.is_set():
            delay = t0 + self.sent / self.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            elif delay < -1.0:  # an outage: do not burst to catch up
                t0 = time.perf_counter() - self.sent / self.rate
            k, s = self.wl.next()
            try:
                self.p.send_orderly(self.topic, b'{"k":%d,"s":%d}' % (k, s), sharding_key=f"key-{k}")
                self.ok_at.append(time.perf_counter())
            except Exception:  # noqa: BLE001 - keep the stream going (or the outage measured); counted
                self.errors += 1
                time.sleep(0.01)
            self.sent += 1

    def first_ok_after(self, t: float) -> float | None:
        return next((x for x in self.ok_at[-5000:] if x > t), None)

    def stop(self) -> None:
        self.stop_ev.set()
        self.join(10)
        self.p.close()


def run(cfg: Config, *, kills: int, concurrency: int, rate: float = 500.0, workers: int = 3, queues: int = 16,
        n_keys: int = 2000, timeout: float = 60.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        topic, group = "fo", "g-fo"
        p = Producer(srv.url)
        p.create_topic(topic, queues=queues)
        p.close()
        env = mq_env(srv.url, topic=topic, group=group)
        names = [f"fo{i}" for i in range(workers)]
        logdir = cfg.logdir / "failover"
        log(f"failover: starting {workers} worker(s) -c {concurrency}, traffic {rate:.0f} msg/s")
        ws = start_mq_workers(st, srv.url, names, env, concurrency, logdir)
        traffic = Traffic(srv.url, topic, rate, n_keys)
        traffic.start()
        st.callback(traffic.stop)
        mqs = queues_of(topic, queues)
        for k in range(kills):
            _steady(r, group, mqs, [w.hostname for w in ws], timeout)
            before = _states(r, group, mqs)
            vi = k % len(ws)
            while not any(o == ws[vi].hostname for o, _, _ in before):
                vi = (vi + 1) % len(ws)
            victim = ws[vi]
            owned = [i for i, (o, _, _) in enumerate(before) if o == victim.hostname]
            t_kill = time.perf_counter()
            victim.kill()
            time.sleep(0.02)  # anything the victim had on the wire has reached Redis by now
            base = _states(r, group, mqs)
            moved: dict[int, float] = {}
            progressed: dict[int, float] = {}
            deadline = time.monotonic() + timeout
            while len(progressed) < len(owned) and time.monotonic() < deadline:
                now = _states(r, group, mqs)
                t = time.perf_counter() - t_kill
                for i in owned:
                    owner, offset, _ = now[i]
                    if owner and owner != victim.hostname:
                        moved.setdefault(i, t)
                        if offset > base[i][1]:
                            progressed.setdefault(i, t)
                time.sleep(0.01)
            ok = len(progressed) == len(owned)
            res = {
                "kill": k, "victim": victim.hostname, "queues_owned": len(owned), "ok": ok,
                "failover_s": max(progressed.values()) if ok else float("inf"),
                "moved_s": max(moved.values()) if len(moved) == len(owned) else float("inf"),
                "first_progress_s": min(progressed.values()) if progressed else float("inf"),
            }
            log(f"failover kill {k}: {victim.hostname} owned {len(owned)} queues; all moved after "
                f"{res['moved_s']:.2f}s, all progressed after {res['failover_s']:.2f}s")
            out.append(res)
            # Restart the killed worker under the same name.
            nw = WorkerProcess(victim.name, env=env, concurrency=concurrency,
                               logfile=logdir / f"{victim.name}.log", cwd=ROOT)
            nw.start()
            st.callback(nw.stop, 30)
            nw.wait_registered(r, timeout=90)
            ws[vi] = nw
        log(f"failover: traffic sent {traffic.sent:,} messages, {traffic.errors} send errors")
    return out

"""The chaos runner: its own redis-servers, real worker and beat subprocesses, a paced producer,
a state monitor, and the fault injectors. Everything it starts is stopped in ``Cluster.stop``.

Two ``redis-server`` processes run per scenario: the one under test (AOF on, ``appendfsync``
``always`` or ``everysec``; it is also the Celery broker) and a ledger Redis that the listeners
write to and no fault touches. The producer keeps its acknowledgements in memory, never in a
Redis that may be killed.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery.utils.nodenames import worker_direct

from chaos import listeners
from mqorder import Producer
from mqorder.embedded import RedisServer
from mqorder.errors import BrokerUnavailableError
from mqorder.launcher import BeatProcess, WorkerProcess, project_env
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import load_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.log import MessageLog

ROOT = Path(__file__).resolve().parent.parent
TOPIC = listeners.TOPIC
GROUP = listeners.GROUP


def log(msg: str) -> None:
    sys.stderr.write(f"[chaos {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


@dataclass
class Event:
    """One injected fault (or other action) with its wall-clock start and end (seconds)."""

    t: float
    kind: str
    target: str = ""
    t_end: float = 0.0
    queues: list[int] = field(default_factory=list)
    fault: bool = True
    info: dict[str, Any] = field(default_factory=dict)

    def end(self) -> float:
        return self.t_end or self.t


@dataclass
class Ack:
    key: str
    seq: int
    queue: int
    offset: int
    t: float


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the prefork pool processes of a worker), from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return sorted(out)


# -- producer -------------------------------------------------------------------------------------


class ProducerThread(threading.Thread):
    """Sends ``{"k": key, "s": seq}`` at a steady pace over ``n_keys`` keys with ``send_orderly``.

    A send that raised is not acknowledged; it is recorded as *unknown* (it may or may not be
    stored) and the same (key, seq) is retried until acknowledged, so per-key sequences stay
    contiguous. Acks live in this process's memory only.
    """

    def __init__(self, url: str, rate: float, n_keys: int, seed: int = 7) -> None:
        super().__init__(name="chaos-producer", daemon=True)
        self.url = url
        self.rate = rate
        self.keys = [f"k{i:04d}" for i in range(n_keys)]
        self.rng = random.Random(seed)
        self.next_seq = dict.fromkeys(self.keys, 1)
        self.acks: list[Ack] = []
        self.unknown: list[tuple[str, int, float, str]] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the runner
            self.error = exc

    def _run(self) -> None:
        producer = Producer(self.url)
        period = 1.0 / self.rate
        t_next = time.monotonic()
        try:
            while not self.stop_event.is_set():
                key = self.rng.choice(self.keys)
                seq = self.next_seq[key]
                body = f'{{"k": "{key}", "s": {seq}}}'.encode()
                while not self.stop_event.is_set():
                    try:
                        res = producer.send_orderly(TOPIC, body, sharding_key=key)
                    except (BrokerUnavailableError, redis.RedisError) as exc:
                        self.unknown.append((key, seq, time.time(), type(exc).__name__))
                        time.sleep(0.05)
                        continue
                    self.acks.append(Ack(key, seq, res.message_queue.queue_id, res.queue_offset, time.time()))
                    self.next_seq[key] = seq + 1
                    break
                t_next += period
                delay = t_next - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -1.0:  # fell behind (an outage): do not burst to catch up
                    t_next = time.monotonic()
        finally:
            producer.close()


# -- state monitor --------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Samples every queue's lock state (owner, epoch, lease, offset) a few times a second."""

    def __init__(self, url: str, mqs: list[MessageQueue], interval: float = 0.2,
                 on_tick: Callable[[], None] | None = None) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.url = url
        self.mqs = mqs
        self.interval = interval
        self.on_tick = on_tick
        #: (wall time, queue, owner, epoch, lease ms, offset, Redis now ms, pending token, pend_until ms, run ms)
        self.samples: list[tuple[float, int, str, int, int, int, int, str, int, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        from mqorder import keys

        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        while not self.stop_event.wait(self.interval):
            if self.on_tick is not None:
                self.on_tick()
            try:
                pipe = client.pipeline(transaction=False)
                pipe.time()
                for mq in self.mqs:
                    pipe.hmget(keys.sub_state(mq.tag, GROUP), "owner", "epoch", "lease", "offset", "pending", "pend_until",
                              "run")
                res = pipe.execute()
            except (redis.RedisError, OSError):
                continue
            t = time.time()
            sec, usec = res[0]
            now_ms = sec * 1000 + usec // 1000
            for mq, (owner, epoch, lease, offset, pending, pend_until, run) in zip(self.mqs, res[1:], strict=True):
                self.samples.append((
                    t, mq.queue_id, (owner or b"").decode(), int(epoch or 0), int(lease or 0),
                    int(offset or 0), now_ms, (pending or b"").decode(), int(pend_until or 0), int(run or 0),
                ))
        client.close()


# -- the cluster ----------------------------------------------------------------------------------


class Cluster:
    """Redis under test, ledger Redis, workers, beats, producer and monitor of one scenario."""

    def __init__(
        self,
        name: str,
        *,
        fsync: str = "everysec",
        env: dict[str, str] | None = None,
        workers: int = 3,
        concurrency: int = 2,
        queues: int = 12,
        rate: float = 300.0,
        n_keys: int = 300,
        keep_logs: bool = False,
    ) -> None:
        self.name = name
        self.fsync = fsync
        self.env_extra = dict(env or {})
        self.n_workers = workers
        self.concurrency = concurrency
        self.n_queues = queues
        self.rate = rate
        self.n_keys = n_keys
        self.keep_logs = keep_logs
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mqorder-chaos-{name}-"))
        self.redis = RedisServer(appendonly=True, appendfsync=fsync, workdir=str(self.tmp / "redis"))
        self.ledger_redis = RedisServer(workdir=str(self.tmp / "ledger"))
        self.workers: dict[str, WorkerProcess] = {}
        self.beats: list[BeatProcess] = []
        self.events: list[Event] = []
        self.producer: ProducerThread | None = None
        self.monitor: Monitor | None = None
        self.poison: list[tuple[int, int, int, float]] = []  # (id, queue, offset, ack time)
        self._worker_seq = 0
        #: Workers this runner killed or stopped; any other worker that exits has crashed.
        self.expected_down: set[str] = set()
        self._bg: list[threading.Thread] = []
        self._started = False
        self.t_traffic: tuple[float, float] = (0.0, 0.0)
        self.settings = None

    # -- setup ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.redis.url

    def env(self) -> dict[str, str]:
        return project_env(
            self.url,
            MQORDER_LISTENERS="chaos.listeners",
            CHAOS_LEDGER_URL=self.ledger_redis.url,
            **self.env_extra,
        )

    def start(self) -> Cluster:
        (self.tmp / "redis").mkdir()
        (self.tmp / "ledger").mkdir()
        self.redis.start()
        self.ledger_redis.start()
        self._started = True
        self.settings = load_settings(redis_url=self.url, **{
            k.removeprefix("MQORDER_").lower(): v for k, v in self.env_extra.items() if k.startswith("MQORDER_")
        })
        self.brokers = BrokerRegistry(self.url)
        self.locks = RebalanceLockManager(self.brokers, self.settings.ms(self.settings.lock_max_live_time))
        self.ledger = redis.Redis.from_url(self.ledger_redis.url)
        p = Producer(self.url)
        p.create_topic(TOPIC, queues=self.n_queues)
        self.mqs = p.describe_topic(TOPIC).message_queues
        p.close()
        names = [self.new_worker_name() for _ in range(self.n_workers)]
        for n in names:
            self.start_worker(n, wait=False)
        for n in names:
            self.workers[n].wait_registered(self.brokers.meta, timeout=90)
        self.start_beat()
        self.monitor = Monitor(self.url, self.mqs, on_tick=self.check_crashes)
        self.monitor.start()
        self.wait_all_owned(30)
        # A worker subscribes to its wake channel only after it has taken its queues; a message
        # sent in between waits for the pending TTL (see the report). Let the subscriptions settle.
        time.sleep(1.5)
        return self

    def new_worker_name(self) -> str:
        self._worker_seq += 1
        return f"w{self._worker_seq}"

    def start_worker(self, name: str, *, wait: bool = True) -> WorkerProcess:
        w = self.workers.get(name)
        if w is None:
            w = WorkerProcess(name, env=self.env(), concurrency=self.concurrency, cwd=ROOT,
                              logfile=self.tmp / f"{name}.log")
            self.workers[name] = w
        w.start()
        if wait:
            w.wait_registered(self.brokers.meta, timeout=90)
        return w

    def start_beat(self) -> BeatProcess:
        i = len(self.beats)
        b = BeatProcess(env=self.env(), workdir=self.tmp / f"beat{i}", logfile=self.tmp / f"beat{i}.log",
                        cwd=ROOT, loglevel="INFO")
        b.start()
        self.beats.append(b)
        return b

    def owners(self) -> dict[int, str]:
        """Queue id -> live owner, read from the state hashes (lock_entry)."""
        return {mq.queue_id: self.locks.lock_entry(GROUP, mq).owner for mq in self.mqs}

    def wait_all_owned(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(self.owners().values()):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.2)
        log(f"warning: not every queue had an owner after {timeout}s")

    def check_crashes(self) -> None:
        """Record a worker that exited without being killed or stopped by this runner."""
        for w in list(self.workers.values()):
            if w.proc is not None and w.name not in self.expected_down and w.proc.poll() is not None:
                self.expected_down.add(w.name)
                self.event("crash", w.name, fault=False, info={"returncode": w.proc.returncode,
                                                              "client": w.hostname})

    def alive_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive()]

    # -- traffic --------------------------------------------------------------------------------

    def start_traffic(self) -> None:
        self.producer = ProducerThread(self.url, self.rate, self.n_keys)
        self.t_traffic = (time.time(), 0.0)
        self.producer.start()

    def stop_traffic(self) -> None:
        if self.producer is not None:
            self.producer.stop_event.set()
            self.producer.join(30)
            self.t_traffic = (self.t_traffic[0], time.time())
            if self.producer.error is not None:
                raise RuntimeError(f"producer failed: {self.producer.error!r}")

    def drain(self, timeout: float) -> bool:
        """Wait until every queue's committed offset reached its end (twice in a row)."""
        mlog = MessageLog(self.brokers)
        deadline = time.monotonic() + timeout
        streak = 0
        while time.monotonic() < deadline:
            try:
                lag = sum(mlog.lag(GROUP, mq) for mq in self.mqs)
            except redis.RedisError:
                lag = -1
            streak = streak + 1 if lag == 0 else 0
            if streak >= 2:
                return True
            time.sleep(0.5)
        return False

    # -- faults ---------------------------------------------------------------------------------

    def event(self, kind: str, target: str = "", **kw: Any) -> Event:
        e = Event(time.time(), kind, target, **kw)
        self.events.append(e)
        log(f"{self.name}: {kind} {target} {kw.get('queues', '') or ''}".rstrip())
        return e

    def _busiest(self) -> tuple[WorkerProcess, list[int]] | None:
        owners = self.owners()
        best: tuple[WorkerProcess, list[int]] | None = None
        for w in self.alive_workers():
            qs = sorted(q for q, o in owners.items() if o == w.hostname)
            if qs and (best is None or len(qs) > len(best[1])):
                best = (w, qs)
        return best

    def kill_worker(self) -> Event | None:
        """``kill -9`` of the worker owning the most queues (owners read right before the kill)."""
        found = self._busiest()
        if found is None:
            log("no worker owns a queue; kill skipped")
            return None
        w, qs = found
        e = self.event("kill", w.name, queues=qs, info={"client": w.hostname})
        self.expected_down.add(w.name)
        w.kill()
        return e

    def restart_worker(self, name: str) -> Event:
        e = self.event("restart", name)
        w = self.start_worker(name, wait=False)
        self.expected_down.discard(name)
        w.wait_registered(self.brokers.meta, timeout=90)
        e.t_end = time.time()
        return e

    def pause_worker(self, seconds: float, *, in_call: bool = False) -> Event | None:
        """SIGSTOP of the whole process group of a queue owner for ``seconds``, then SIGCONT.

        With ``in_call`` the worker's listener calls are made slow (400 ms) for a moment first, so
        the pause lands inside listener calls: the case where a stale holder resumes mid-call.
        """
        found = self._busiest()
        if found is None:
            return None
        w, qs = found
        slow = f"slow:{w.hostname}"
        if in_call:
            self.ledger.hset(listeners.CTL, slow, 400)
            time.sleep(0.3)
        e = self.event("sigstop", w.name, queues=qs,
                       info={"client": w.hostname, "seconds": seconds, "in_call": in_call})
        w.signal(signal.SIGSTOP)
        self.ledger.hdel(listeners.CTL, slow)
        try:
            time.sleep(seconds)
        finally:
            w.signal(signal.SIGCONT)
        e.t_end = time.time()
        return e

    def pause_pool_process(self, seconds: float) -> Event | None:
        """SIGSTOP of one prefork pool process of a queue owner, inside a listener call, for
        ``seconds`` (its main process keeps heartbeating and renewing the worker's locks)."""
        found = self._busiest()
        if found is None:
            return None
        w, qs = found
        kids = child_pids(w.pid)
        if not kids:
            return None
        slow = f"slow:{w.hostname}"
        self.ledger.hset(listeners.CTL, slow, 400)
        time.sleep(0.3)
        e = self.event("sigstop-child", w.name, info={"client": w.hostname, "pid": kids[0], "seconds": seconds})
        os.kill(kids[0], signal.SIGSTOP)
        self.ledger.hdel(listeners.CTL, slow)
        try:
            time.sleep(seconds)
        finally:
            os.kill(kids[0], signal.SIGCONT)
        e.t_end = time.time()
        return e

    def restart_redis(self, down: float) -> Event:
        """Kill the Redis under test (SIGKILL) and restart it from its AOF after ``down`` seconds."""
        e = self.event("redis-kill", "redis", info={"fsync": self.fsync})
        self.redis.kill()
        e.info["killed_at"] = time.time()  # acks recorded before this were answered before the kill
        time.sleep(down)
        self.redis.start(timeout=60)
        e.t_end = time.time()
        log(f"{self.name}: redis back after {e.t_end - e.t:.1f}s")
        return e

    def join_worker(self) -> Event:
        name = self.new_worker_name()
        e = self.event("join", name)
        self.start_worker(name, wait=False)
        return e

    def leave_worker(self, name: str | None = None) -> Event | None:
        """Warm shutdown (SIGTERM) of a worker, in the background so the cadence is kept."""
        alive = self.alive_workers()
        if not alive:
            return None
        w = self.workers[name] if name else alive[0]
        e = self.event("leave", w.name)
        self.expected_down.add(w.name)
        t = threading.Thread(target=w.stop, kwargs={"timeout": 60}, daemon=True)
        t.start()
        self._bg.append(t)
        return e

    def direct_queues(self) -> list[str]:
        """The Celery direct queue keys of every worker this runner started (with kombu's priority
        sub-queues), whether or not they exist right now."""
        out = []
        for w in self.workers.values():
            q = worker_direct(w.hostname).name
            out += [q, *(f"{q}\x06\x16{p}" for p in (3, 6, 9))]
        return out

    def steal_tasks(self, burst: float = 1.0) -> Event:
        """Lost tasks: for ``burst`` seconds, take every ConsumeRequest task published to any worker
        direct queue away from the broker (a competing BRPOP that throws them away), and delete
        kombu's ``unacked`` structures."""
        c = redis.Redis.from_url(self.url, socket_timeout=5)
        e = self.event("delete-tasks", "broker")
        stolen = 0
        taken: list[tuple[float, int]] = []
        try:
            names = self.direct_queues()
            deadline = time.monotonic() + burst
            while time.monotonic() < deadline:
                got = c.brpop(names, timeout=0.1)
                if got is not None:
                    stolen += 1
                    m = re.search(rf"{TOPIC}:[^:']+:(\d+)", got[1].decode(errors="replace"))
                    if m:
                        taken.append((time.time(), int(m.group(1))))
            e.info["unacked_deleted"] = int(c.delete("unacked", "unacked_index"))
        finally:
            c.close()
            e.t_end = time.time()
            e.info["stolen"] = stolen
            e.info["taken"] = taken
        return e

    def inject_poison(self, count: int) -> Event:
        """Send ``count`` poison messages, each to a different queue, among the regular traffic."""
        p = Producer(self.url)
        try:
            start = len(self.poison)
            for i in range(count):
                pid = start + i
                qid = (pid * 5) % self.n_queues
                res = p.send_orderly(TOPIC, f'{{"poison": true, "id": {pid}}}'.encode(), sharding_key=pid,
                                     selector=lambda mqs, key, body, q=qid: mqs[q])
                self.poison.append((pid, res.message_queue.queue_id, res.queue_offset, time.time()))
        finally:
            p.close()
        return self.event("poison", "producer", fault=False, queues=[q for _, q, _, _ in self.poison[start:]])

    def kill_beat(self, beat: BeatProcess | None = None) -> Event:
        b = beat or next((b for b in self.beats if b.alive()), None)
        e = self.event("beat-kill", "beat")
        if b is not None:
            b.kill()
        return e

    def beat_start(self) -> Event:
        e = self.event("beat-start", "beat")
        self.start_beat()
        return e

    # -- results --------------------------------------------------------------------------------

    def read_ledger(self) -> list[str]:
        return [raw.decode() for raw in self.ledger.lrange(listeners.LEDGER, 0, -1)]

    def read_dlq(self) -> list[dict[str, str]]:
        from mqorder import keys

        mlog = MessageLog(self.brokers)
        try:
            msgs = mlog.read(MessageQueue(keys.dlq_topic(GROUP), "broker-a", 0), 0, 1000)
        except redis.RedisError:
            return []
        return [{**m.properties, "body": m.body.decode(errors="replace")} for m in msgs]

    def worker_logs(self) -> str:
        out = []
        for p in sorted(self.tmp.glob("w*.log")):
            out.append(p.read_text(errors="replace"))
        return "\n".join(out)

    def beat_logs(self) -> list[str]:
        return [p.read_text(errors="replace") for p in sorted(self.tmp.glob("beat*.log"))]

    # -- teardown -------------------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_processes()
        self.cleanup()

    def stop_processes(self) -> None:
        if self.producer is not None:
            self.producer.stop_event.set()
            self.producer.join(10)
        if self.monitor is not None:
            self.monitor.stop_event.set()
            self.monitor.join(5)
        self.expected_down.update(self.workers)
        stoppers = []
        for w in self.workers.values():
            if w.alive():
                w.signal(signal.SIGCONT)  # a paused worker cannot handle SIGTERM
                t = threading.Thread(target=w.stop, kwargs={"timeout": 20}, daemon=True)
                t.start()
                stoppers.append(t)
        for t in stoppers + self._bg:
            t.join(65)
        for w in self.workers.values():
            if w.proc is not None:
                try:
                    os.killpg(w.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for b in self.beats:
            b.stop()
        for srv in (self.redis, self.ledger_redis):
            try:
                srv.stop()
            except OSError:
                pass

    def cleanup(self) -> None:
        if self.keep_logs:
            log(f"{self.name}: logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

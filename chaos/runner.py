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
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

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

    def __init__(self, url: str, mqs: list[MessageQueue], interval: float = 0.2) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.url = url
        self.mqs = mqs
        self.interval = interval
        self.samples: list[tuple[float, int, str, int, int, int, int]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        from mqorder import keys

        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        while not self.stop_event.wait(self.interval):
            try:
                pipe = client.pipeline(transaction=False)
                pipe.time()
                for mq in self.mqs:
                    pipe.hmget(keys.sub_state(mq.tag, GROUP), "owner", "epoch", "lease", "offset")
                res = pipe.execute()
            except (redis.RedisError, OSError):
                continue
            t = time.time()
            sec, usec = res[0]
            now_ms = sec * 1000 + usec // 1000
            for mq, (owner, epoch, lease, offset) in zip(self.mqs, res[1:], strict=True):
                self.samples.append((
                    t, mq.queue_id, (owner or b"").decode(), int(epoch or 0), int(lease or 0),
                    int(offset or 0), now_ms,
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
        self.monitor = Monitor(self.url, self.mqs)
        self.monitor.start()
        self.wait_all_owned(30)
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
        w.kill()
        return e

    def restart_worker(self, name: str) -> Event:
        e = self.event("restart", name)
        self.start_worker(name, wait=True)
        e.t_end = time.time()
        return e

    def pause_worker(self, seconds: float) -> Event | None:
        """SIGSTOP of the whole process group of a queue owner for ``seconds``, then SIGCONT."""
        found = self._busiest()
        if found is None:
            return None
        w, qs = found
        e = self.event("sigstop", w.name, queues=qs, info={"client": w.hostname, "seconds": seconds})
        w.signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            w.signal(signal.SIGCONT)
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
        t = threading.Thread(target=w.stop, kwargs={"timeout": 60}, daemon=True)
        t.start()
        self._bg.append(t)
        return e

    def delete_tasks(self) -> Event:
        """Lost tasks: delete every worker direct queue and kombu's unacked structures."""
        c = self.brokers.meta
        names = [k for k in c.scan_iter(match="*.dq2*", count=1000)] + [b"unacked", b"unacked_index"]
        pipe = c.pipeline(transaction=True)
        for k in names:
            pipe.type(k)
        types = pipe.execute()
        pipe = c.pipeline(transaction=True)
        counted = []
        for k, t in zip(names, types, strict=True):
            if t == b"list":
                pipe.llen(k)
            elif t == b"hash":
                pipe.hlen(k)
            elif t == b"zset":
                pipe.zcard(k)
            else:
                continue
            counted.append(k)
        sizes = pipe.execute() if counted else []
        if counted:
            c.delete(*counted)
        n = int(sum(sizes))
        return self.event("delete-tasks", "broker", info={"removed": n, "keys": len(counted)})

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

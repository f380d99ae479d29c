"""``mqorder demo``: 2,000 order lifecycles through real workers, checked for order.

Uses ``MQORDER_REDIS_URL`` if it answers, else an embedded ``redis-server`` on a free port; starts
two prefork workers and beat; publishes every lifecycle (created, paid, shipped, delivered) with
the order id as sharding key over 8 queues; waits until everything is handled; prints the table;
exits non-zero on any order violation or loss; stops every process it started.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mqorder import keys
from mqorder.client.producer import Producer
from mqorder.examples.demo_keys import demo_prefix
from mqorder.model import MessageQueue
from mqorder.settings import load_settings
from mqorder.store.connect import close, connect
from mqorder.store.replies import text
from mqorder.testing.embedded import RedisServer
from mqorder.testing.launcher import BeatProcess, WorkerProcess, project_env

EVENTS = ("created", "paid", "shipped", "delivered")
#: The Celery app the demo's workers and beat run: the installed package's stock app, so the demo
#: needs no checkout.
DEMO_APP = "mqorder.app"
#: The only listener module the demo's workers load (``MQORDER_LISTENERS``).
DEMO_LISTENERS = "mqorder.examples.order_lifecycle"


@dataclass
class DemoResult:
    produced: int
    consumed: int
    dlq: int
    out_of_order: int
    duplicates: int
    lost: int
    msgs_per_s: float
    p50_ms: float
    p99_ms: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.out_of_order == 0 and self.lost == 0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_demo(
    orders: int = 2000, queues: int = 8, workers: int = 2, concurrency: int = 2, timeout: float = 300.0,
    console: Console | None = None, keep: bool = False,
) -> DemoResult:
    console = console or Console()
    settings = load_settings()
    run_id = uuid.uuid4().hex[:8]
    topic, group = f"orders-demo-{run_id}", f"order-lifecycle-{run_id}"
    tmp = Path(tempfile.mkdtemp(prefix="mqorder-demo-"))
    server: RedisServer | None = None
    procs: list[WorkerProcess | BeatProcess] = []
    url = settings.redis_url
    try:
        if _answers(url):
            console.print(f"using Redis at {settings.describe()['redis_url']}")
        else:
            server = RedisServer().start()
            url = server.url
            console.print(f"no Redis at {settings.describe()['redis_url']}; started an embedded redis-server on {url}")
        # The workers load the demo listener because the demo names it, and nothing else: the
        # caller's own MQORDER_LISTENERS would make them join the caller's groups too.
        env = project_env(url, MQORDER_LISTENERS=DEMO_LISTENERS, MQORDER_DEMO_TOPIC=topic, MQORDER_DEMO_GROUP=group)
        producer = Producer(url)
        producer.create_topic(topic, queues=queues)
        r = connect(url)
        for i in range(workers):
            w = WorkerProcess(f"demo{i + 1}-{run_id}", env=env, app=DEMO_APP, concurrency=concurrency,
                              logfile=tmp / f"worker{i + 1}.log")
            procs.append(w.start())
        procs.append(BeatProcess(env=env, app=DEMO_APP, workdir=tmp / "beat", logfile=tmp / "beat.log").start())
        for p in procs:
            if isinstance(p, WorkerProcess):
                p.wait_registered(r, timeout=60)
        console.print(f"{workers} workers (prefork, concurrency {concurrency}) and beat are up; topic {topic!r}, {queues} queues")

        total = orders * len(EVENTS)
        prefix = demo_prefix(group)
        t0 = time.time()
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=console, transient=False,
        ) as progress:
            sent_bar = progress.add_task("published", total=total)
            done_bar = progress.add_task("handled  ", total=total)
            # Interleave lifecycles the way real traffic does: step k of every order, then k+1.
            for step, name in enumerate(EVENTS, start=1):
                for o in range(orders):
                    body = json.dumps({"order": o, "seq": step, "event": name, "ts": time.time() * 1000}).encode()
                    producer.send_orderly(topic, body, sharding_key=str(o), keys=[str(o)])
                    if o % 200 == 0:
                        progress.update(sent_bar, completed=(step - 1) * orders + o + 1)
                        progress.update(done_bar, completed=_handled(r, prefix))
            progress.update(sent_bar, completed=total)
            deadline = time.time() + timeout
            while True:
                handled = _handled(r, prefix)
                progress.update(done_bar, completed=handled)
                dup = int(r.hget(f"{prefix}:counts", "duplicates") or 0)
                if handled >= total:
                    break
                if time.time() > deadline:
                    console.print(f"[red]timed out with {handled}/{total} handled ({dup} duplicates)")
                    break
                time.sleep(0.1)
        t_end = time.time()
        counts = {text(k): int(v) for k, v in r.hgetall(f"{prefix}:counts").items()}
        lat = [float(x) for x in r.lrange(f"{prefix}:latency_ms", 0, -1)]
        dlq_mq = MessageQueue(keys.dlq_topic(group), "broker-a", 0)
        dlq = int(r.get(keys.queue_next(dlq_mq.tag)) or 0)
        handled = counts.get("handled", 0)
        seconds = max(t_end - t0, 1e-6)
        result = DemoResult(
            produced=total, consumed=handled, dlq=dlq, out_of_order=counts.get("illegal", 0),
            duplicates=counts.get("duplicates", 0), lost=max(total - handled - dlq, 0),
            msgs_per_s=handled / seconds, p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), seconds=seconds,
        )
        _print(console, result)
        if not keep:
            _cleanup(r, prefix, topic, group, queues)
        producer.close()
        return result
    finally:
        for p in procs:
            p.stop()
        if server is not None:
            server.stop()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _answers(url: str, timeout: float = 0.5) -> bool:
    """Whether the Redis of ``url`` answers a PING now (a Sentinel URL: its current primary)."""
    try:
        client = connect(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    except ValueError:  # ConfigError included: a malformed URL is load_settings' to report
        return False
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        close(client)


def _handled(r: redis.Redis, prefix: str) -> int:
    return int(r.hget(f"{prefix}:counts", "handled") or 0)


def _print(console: Console, res: DemoResult) -> None:
    t = Table(title="mqorder demo: order lifecycles")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("produced", f"{res.produced:,}"),
        ("consumed", f"{res.consumed:,}"),
        ("DLQ", f"{res.dlq:,}"),
        ("out-of-order", f"{res.out_of_order:,}"),
        ("duplicates", f"{res.duplicates:,}"),
        ("lost", f"{res.lost:,}"),
        ("messages/s", f"{res.msgs_per_s:,.0f}"),
        ("p50 produce->handle", f"{res.p50_ms:,.1f} ms"),
        ("p99 produce->handle", f"{res.p99_ms:,.1f} ms"),
        ("wall time", f"{res.seconds:,.1f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if res.ok:
        console.print("[green]OK: every order's events were handled in order, none lost")
    else:
        console.print("[red]FAILED: order violations or lost messages")


def _cleanup(r: redis.Redis, prefix: str, topic: str, group: str, queues: int) -> None:
    pipe = r.pipeline(transaction=False)
    for k in r.scan_iter(f"{prefix}:*"):
        pipe.delete(k)
    for t, n in ((topic, queues), (keys.dlq_topic(group), 1)):
        for q in range(n):
            tag = keys.queue_tag(t, "broker-a", q)
            for k in r.scan_iter(f"{keys.PREFIX}:{tag}:*".replace("{", "\\{").replace("}", "\\}")):
                pipe.delete(k)
        pipe.delete(keys.topic_route(t), keys.topic_subs(t))
        pipe.srem(keys.topics(), t)
    pipe.hdel(keys.groups(), group)
    pipe.delete(keys.assignment(group), keys.stats(group))
    pipe.execute()

"""docker-compose.yml run for real (issue 30): images built here, the whole stack up, the demo
through it, a worker container killed mid-demo, the stack down with its volumes.

tests/test_compose.py checks the file; this runs it. ``deploy/compose/ensure_docker.sh`` installs
Debian's docker.io and docker-compose and starts dockerd when absent; ``build_images.sh`` builds the
images without an image registry when none is reachable (a debootstrapped Debian base, Debian's
redis-server) and only when their tags (hashes of their inputs) are missing, so a second run on a
machine builds nothing. The containers use host networking (``deploy/compose/hostnet.yml``) on free
ports, so nothing leaves the loopback and the machine's own Redis on 6379 is left alone.

The stack is one test (not a module fixture shared by several): pytest-xdist may send a module's
tests to two workers, and each would bring up a stack of its own.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from mqorder import keys
from mqorder.client.producer import Producer
from mqorder.examples.demo_keys import demo_prefix
from mqorder.store.replies import text
from tests.support import ROOT, wait_for

# A cold machine makes the base with debootstrap and builds every image first (~10 min measured on
# 2 loaded cores); a warm one finds them by tag. The suite's default 300 s would stop the cold run.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

HERE = ROOT / "deploy" / "compose"
TOPIC, GROUP = "orders", "order-lifecycle"  # the demo listener's defaults (docker-compose.yml)
ORDERS, QUEUES = 2000, 8  # 8,000 events: consumption lasts ~10 s, long enough to kill a worker in it
STACK_SERVICES = ("redis", "worker", "beat", "flower", "exporter")
#: Upper bound of an image's size: the app image measured 253 MB on the Debian base (issue 30).
MAX_IMAGE_BYTES = 400 * 1024 * 1024


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}")
    return done


@dataclass(frozen=True)
class Images:
    app: str
    redis: str
    base: str


@pytest.fixture(scope="module")
def images() -> Images:
    """A running Docker engine and the stack's images (built when their tags are missing)."""
    engine = run(["bash", str(HERE / "ensure_docker.sh")], timeout=900, check=False)
    if engine.returncode != 0:
        pytest.fail(f"no Docker engine here: deploy/compose/ensure_docker.sh said:\n{engine.stderr}")
    # BUILD_DEPS="": every dependency has a binary wheel here, so the build stage needs no compiler.
    env = {**os.environ, "MQORDER_IMAGE": "", "BUILD_DEPS": ""}
    built = run(["bash", str(HERE / "build_images.sh")], env=env, timeout=1800)
    out = dict(line.split("=", 1) for line in built.stdout.splitlines() if "=" in line)
    return Images(app=out["MQORDER_IMAGE"], redis=out["REDIS_IMAGE"], base=out["MQORDER_BASE_IMAGE"])


def wait_until(pred: Callable[[], object], *, timeout: float, what: str, state: Callable[[], object],
               interval: float = 1.0) -> None:
    """``wait_for``, with the state at the deadline in the failure (not the state at the start)."""
    try:
        wait_for(pred, timeout=timeout, interval=interval, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; at the deadline: {state()}") from None


def inspect(ref: str) -> dict:
    return json.loads(run(["docker", "inspect", ref], timeout=60).stdout)[0]


def test_images_run_as_non_root_and_their_own_health_checks_pass(images: Images) -> None:
    """Each image as ``docker run`` starts it, without compose: a Redis, and the app image's default
    command (a stock worker) beside it, sharing the Redis container's network namespace (its
    loopback, so no bridge and no host port). Both become healthy by the image's own HEALTHCHECK
    (probed every 2 s instead of 30 s), as a non-root user; each image stays under 400 MB."""
    for ref, user in ((images.app, "10001:10001"), (images.redis, "redis")):
        config = inspect(ref)["Config"]
        assert config["User"] == user, ref
        assert config["Healthcheck"]["Test"][0] in ("CMD", "CMD-SHELL"), f"{ref} has no HEALTHCHECK"
        size = inspect(ref)["Size"]
        assert size < MAX_IMAGE_BYTES, f"{ref} is {size / 2**20:.0f} MB"
        print(f"{ref}: {size / 1e6:.0f} MB")
    fast = ["--health-interval", "2s", "--health-start-period", "120s"]
    started: list[str] = []
    try:
        started.append(run(["docker", "run", "-d", "--network", "none", *fast, images.redis], timeout=60).stdout.strip())
        started.append(run(["docker", "run", "-d", f"--network=container:{started[0]}", *fast,
                            "-e", "MQORDER_REDIS_URL=redis://127.0.0.1:6379/0", images.app], timeout=60).stdout.strip())

        def health() -> list[str]:
            return [inspect(c)["State"].get("Health", {}).get("Status", "none") for c in started]

        wait_until(lambda: health() == ["healthy", "healthy"], timeout=240,
                   what="the images' own health checks passing", state=health)
        for cid in started:
            uid = run(["docker", "exec", cid, "id", "-u"], timeout=60).stdout.strip()
            assert uid not in ("", "0"), f"{inspect(cid)['Config']['Image']} runs as root"
    finally:
        if started:
            run(["docker", "rm", "-f", "-v", *reversed(started)], timeout=120, check=False)


def free_ports(n: int) -> list[int]:
    """n distinct ports free on the loopback now (bound together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Stack:
    """One compose project of docker-compose.yml + hostnet.yml, resolved into one file (Compose v1
    cannot drop the published ports in an override: deploy/compose/strip_host_ports.py)."""

    def __init__(self, images: Images, tmp: Path) -> None:
        self.redis_port, self.flower_port, self.exporter_port = free_ports(3)
        self.project = f"mqorder-t{os.getpid()}-{self.redis_port}"
        self.auth = ("test", os.urandom(6).hex())
        env_file = tmp / "compose.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in {
            "FLOWER_BASIC_AUTH": ":".join(self.auth),
            "MQORDER_LISTENERS": "mqorder.examples.order_lifecycle",
            "MQORDER_IMAGE": images.app, "REDIS_IMAGE": images.redis,
            "REDIS_PORT": self.redis_port, "FLOWER_PORT": self.flower_port, "EXPORTER_PORT": self.exporter_port,
            "DEMO_ORDERS": ORDERS, "DEMO_QUEUES": QUEUES,
        }.items()))
        # The shell's own values must not leak into the stack (compose reads them before the env file).
        self.env = {k: v for k, v in os.environ.items()
                    if not re.fullmatch(r"(MQORDER|REDIS|FLOWER|EXPORTER|DEMO|WORKER|LOG)_\w+", k)}
        resolved = run(["docker-compose", "--env-file", str(env_file), "-f", "docker-compose.yml",
                        "-f", str(HERE / "hostnet.yml"), "--profile", "demo", "config"], env=self.env, timeout=60)
        self.file = tmp / "stack.yml"
        stripped = subprocess.run(["python3", str(HERE / "strip_host_ports.py")], input=resolved.stdout,
                                  capture_output=True, text=True, timeout=60, check=True)
        self.file.write_text(stripped.stdout)
        self.url = f"redis://127.0.0.1:{self.redis_port}/0"

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["docker-compose", "-p", self.project, "--project-directory", str(ROOT), "-f", str(self.file),
                    *args], env=self.env, timeout=timeout, check=check)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(["docker-compose", "-p", self.project, "--project-directory", str(ROOT),
                                 "-f", str(self.file), *args], cwd=ROOT, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def containers(self, service: str | None = None, *, every: bool = False) -> list[str]:
        label = [f"--filter=label=com.docker.compose.service={service}"] if service else []
        out = run(["docker", "ps", "-q", "--no-trunc", *(["-a"] if every else []),
                   f"--filter=label=com.docker.compose.project={self.project}", *label], timeout=60).stdout
        return out.split()

    def volumes(self) -> list[str]:
        return run(["docker", "volume", "ls", "-q", f"--filter=label=com.docker.compose.project={self.project}"],
                   timeout=60).stdout.split()

    def unhealthy(self) -> dict[str, str]:
        """Each running service container that is not (yet) healthy, with its health status."""
        out = {}
        for service in STACK_SERVICES:
            ids = self.containers(service)
            if len(ids) != (2 if service == "worker" else 1):
                out[service] = f"{len(ids)} containers running"
            for cid in ids:
                health = inspect(cid)["State"].get("Health") or {"Status": "no health check"}
                if health["Status"] != "healthy":
                    probes = health.get("Log") or [{}]
                    last = f"last probe exit {probes[-1].get('ExitCode')}: {str(probes[-1].get('Output', ''))[:120]}"
                    out[f"{service} {cid[:12]}"] = f"{health['Status']} ({len(probes)} probes, {last})"
        return out

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "30", check=False, timeout=120).stdout

    def get(self, port: int, path: str, *, auth: bool = False) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if auth:
            token = base64.b64encode(":".join(self.auth).encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=15) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, ""


@pytest.fixture
def stack(images: Images, tmp_path: Path) -> Iterator[Stack]:
    s = Stack(images, tmp_path)
    try:
        yield s
    finally:
        print(s.logs())  # shown by pytest only when the test failed
        s.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)


def counts(r: redis.Redis) -> dict[str, int]:
    return {text(k): int(v) for k, v in r.hgetall(f"{demo_prefix(GROUP)}:counts").items()}


def assignees(r: redis.Redis, url: str) -> dict[int, str]:
    """Queue id -> the client the rebalance assigned it to (its state hash's ``assignee``)."""
    with Producer(url) as producer:
        mqs = producer.describe_topic(TOPIC).message_queues
    return {mq.queue_id: text(r.hget(keys.sub_state(mq.tag, GROUP), "assignee")) for mq in mqs}


def metric(scrape: str, name: str) -> list[float]:
    """The values of every series of ``name`` in a Prometheus text exposition."""
    return [float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines()
            if line.startswith(name) and line[len(name)] in " {"]


def test_stack_runs_the_demo_in_order_through_a_killed_worker(images: Images, stack: Stack) -> None:
    """The stack up and healthy; Flower and the exporter answer; the demo published through the
    compose ``demo`` profile; one worker container ``docker kill``ed while it consumes; its queues
    move to the other; every order's four events applied once, in order; the stack down with its
    volume."""
    started = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.monotonic() - started - sum(phases.values()), 1)

    stack.compose("up", "-d", "--no-build")
    phase("up")
    wait_until(lambda: not stack.unhealthy(), timeout=300, what="every service healthy", state=stack.unhealthy)
    phase("healthy")

    # Flower: its health endpoint open, its API behind the basic auth, both workers seen.
    assert stack.get(stack.flower_port, "/healthcheck") == (200, "OK")
    assert stack.get(stack.flower_port, "/api/workers")[0] == 401
    worker_ids = {cid[:12] for cid in stack.containers("worker")}
    names = {f"worker@{cid}" for cid in worker_ids}

    def flower_workers() -> set[str]:
        status, body = stack.get(stack.flower_port, "/api/workers?refresh=1", auth=True)
        return set(json.loads(body)) if status == 200 else set()

    wait_until(lambda: names <= flower_workers(), timeout=60, what=f"Flower listing {names}", state=flower_workers)

    # The exporter: up, reading Redis, both workers live in the demo group.
    status, scrape = stack.get(stack.exporter_port, "/metrics")
    assert status == 200 and metric(scrape, "mqorder_up") == [1.0], scrape[:2000]
    wait_for(lambda: metric(stack.get(stack.exporter_port, "/metrics")[1], "mqorder_clients_live") == [2.0],
             timeout=60, interval=1, what="the exporter counting 2 live clients")

    phase("flower+exporter")
    # The demo, through its compose profile; one worker killed once consumption has begun.
    r = redis.Redis.from_url(stack.url)
    # The worker containers are listed before the demo starts (a `docker compose ps`, ~1 s): on a
    # quiet machine the demo's 8,000 events were all handled within that second, before the kill.
    workers = stack.containers("worker")
    demo = stack.popen("--profile", "demo", "run", "--rm", "demo")
    try:
        wait_for(lambda: counts(r).get("handled", 0) > 0, timeout=180, interval=0.05, what="the demo consumed")
        before = assignees(r, stack.url)
        victim_id = next(c for c in workers if f"worker@{c[:12]}" in before.values())
        victim, survivor = f"worker@{victim_id[:12]}", (names - {f"worker@{victim_id[:12]}"}).pop()
        moved = {q for q, c in before.items() if c == victim}
        run(["docker", "kill", victim_id], timeout=60)
        killed_at = counts(r).get("handled", 0)
        phase("demo to kill")
        out, err = demo.communicate(timeout=300)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, err[-3000:]
    assert f"published {ORDERS * 4} events of {ORDERS} orders" in out, out + err[-2000:]
    assert killed_at < ORDERS * 4, f"the worker was killed after the demo was consumed ({killed_at} handled)"
    assert moved, f"{victim} owned no queue of {before}"
    assert not inspect(victim_id)["State"]["Running"], "the killed worker was restarted"

    phase("demo published")
    wait_until(lambda: set(assignees(r, stack.url).values()) == {survivor}, timeout=120, interval=0.5,
               what=f"{victim}'s queues {sorted(moved)} assigned to {survivor}", state=lambda: assignees(r, stack.url))
    phase("queues moved")
    wait_until(lambda: counts(r).get("handled", 0) >= ORDERS * 4, timeout=300, interval=0.5,
               what=f"{ORDERS * 4} events handled", state=lambda: counts(r))
    c = counts(r)
    assert c.get("handled") == ORDERS * 4, c
    assert c.get("illegal", 0) == 0, (c, r.lrange(f"{demo_prefix(GROUP)}:illegal", 0, 9))
    assert c.get("bad", 0) == 0, c
    state = r.hgetall(f"{demo_prefix(GROUP)}:state")
    assert len(state) == ORDERS and set(state.values()) == {b"4"}, f"{len(state)} orders, steps {set(state.values())}"
    wait_for(lambda: sum(metric(stack.get(stack.exporter_port, "/metrics")[1], "mqorder_queue_lag")) == 0,
             timeout=60, interval=1, what="the exporter reporting no lag")
    r.close()
    phase("consumed")

    # Down with the volume: nothing of the project left.
    stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "5")
    assert stack.containers(every=True) == [] and stack.volumes() == []
    phase("down")
    print(f"phases (s): {phases}; killed at {killed_at} handled; {c.get('duplicates', 0)} redeliveries skipped")

"""docker-compose.yml, Dockerfile and .env.example: what an operator gets from ``docker compose up``.

No Docker engine runs here, so the compose file is checked three ways: its structure (PyYAML),
``docker compose config`` / Debian's ``docker-compose config`` (which validates without an
engine), and its demo workload, run for real against a stock worker. The Dockerfile is checked
textually: slim base, non-root user, no compiler in the image that ships.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from mqorder.client.producer import Producer
from mqorder.examples.demo_keys import demo_prefix
from tests.support import ROOT, Cluster, wait_for

COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
MQORDER_SERVICES = ("worker", "beat", "flower", "exporter", "demo")
#: The monitoring profile's services (tests/test_compose_monitoring.py checks them).
MONITORING_SERVICES = ("prometheus", "grafana")
REDIS_URL_IN_COMPOSE = "redis://redis:6379/0"
#: ``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}``; ``$$`` is a literal dollar.
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)")
COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "libc6-dev", "cpp")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


def used_variables() -> set[str]:
    return set(VARIABLE.findall(COMPOSE.read_text()))


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return cmd if isinstance(cmd, list) else cmd.split()


# -- structure ---------------------------------------------------------------------------------


def test_compose_has_exactly_the_operating_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"redis", *MQORDER_SERVICES, *MONITORING_SERVICES}


def test_redis_keeps_an_append_only_file_on_a_volume_and_never_evicts(compose: dict[str, Any],
                                                                      services: dict[str, dict[str, Any]]) -> None:
    cmd = " ".join(command(services["redis"]))
    assert "--appendonly yes" in cmd
    assert "--maxmemory-policy noeviction" in cmd
    volume = next(v for v in services["redis"]["volumes"] if v.endswith(":/data"))
    assert volume.split(":")[0] in compose["volumes"], "Redis data must live on a named volume"


def test_every_mqorder_service_runs_the_repo_image_against_the_compose_redis(
    services: dict[str, dict[str, Any]],
) -> None:
    images = {services[name]["image"] for name in MQORDER_SERVICES}
    assert len(images) == 1, f"one image for every service, got {images}"
    for name in MQORDER_SERVICES:
        svc = services[name]
        assert svc["build"] == ".", name
        assert svc["environment"]["MQORDER_REDIS_URL"] == REDIS_URL_IN_COMPOSE, name
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
    topics = {services[name]["environment"]["MQORDER_DEMO_TOPIC"] for name in MQORDER_SERVICES}
    assert len(topics) == 1, "workers and the demo must agree on the demo topic"


def test_every_healthy_dependency_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    waited_on = set()
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: {cond}"
            waited_on.add(dep)
    assert waited_on == {"redis", "worker"}
    for name in ("redis", "worker", "flower", "exporter"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


def test_two_workers_with_distinct_client_ids_and_exactly_one_beat(services: dict[str, dict[str, Any]]) -> None:
    worker = services["worker"]
    assert worker["deploy"]["replicas"] == 2
    cmd = command(worker)
    assert cmd[:4] == ["celery", "-A", "mqorder.app", "worker"]
    assert cmd[cmd.index("-n") + 1] == "worker@%h", "each replica needs its own client id"
    assert "container_name" not in worker and "hostname" not in worker, "a fixed name forbids replicas"
    assert not {"-B", "--beat"} & set(cmd), "a worker must not embed a second beat"

    beats = [name for name, svc in services.items() if "beat" in command(svc)[:4]]
    assert beats == ["beat"]
    assert services["beat"]["deploy"]["replicas"] == 1


def test_flower_requires_basic_auth_from_the_environment(services: dict[str, dict[str, Any]]) -> None:
    flower = services["flower"]
    assert command(flower)[:4] == ["celery", "-A", "mqorder.app", "flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?"), "auth must be required"
    assert any(str(p).endswith(":5555") for p in flower["ports"])
    assert "--tasks_columns=name,args,state,received,runtime,worker" in command(flower)


def test_exporter_serves_cluster_metrics_on_9808(services: dict[str, dict[str, Any]]) -> None:
    exporter = services["exporter"]
    assert command(exporter) == ["mqorder", "exporter", "--port", "9808"]
    assert any(str(p).endswith(":9808") for p in exporter["ports"])
    assert "9808/metrics" in " ".join(exporter["healthcheck"]["test"])


def test_demo_runs_only_in_its_profile_once_workers_are_healthy(services: dict[str, dict[str, Any]]) -> None:
    demo = services["demo"]
    assert demo["profiles"] == ["demo"]
    assert demo["restart"] == "no"
    assert demo["depends_on"]["worker"] == {"condition": "service_healthy"}
    assert [name for name, svc in services.items() if svc.get("profiles")] == ["demo", *MONITORING_SERVICES]


def test_env_example_documents_exactly_the_variables_compose_reads() -> None:
    documented, used = set(env_example()), used_variables()
    assert used - documented == set(), f"used by docker-compose.yml but not in .env.example: {used - documented}"
    assert documented - used == set(), f"in .env.example but not used: {documented - used}"
    text = ENV_EXAMPLE.read_text()
    for name in used:  # each one explained by a comment right above it (or above its group)
        block = text[: text.index(f"\n{name}=")].rsplit("\n\n", 1)[-1]
        assert "# " in block, f"{name} has no explanation in .env.example"


# -- docker compose config -----------------------------------------------------------------------


def compose_client() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose`` (v1); Debian's v1 installed when absent."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker-compose"], env=env,
                       capture_output=True, timeout=900, check=False)
    return ["docker-compose"] if shutil.which("docker-compose") else None


def compose_config(client: list[str], env_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # The shell's own values must not leak into the check (compose reads them before the env file).
    env = {k: v for k, v in os.environ.items() if k not in used_variables()}
    return subprocess.run(
        [*client, "--env-file", str(env_file), "-f", str(COMPOSE), *extra, "config"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )


def test_docker_compose_config_accepts_the_file_with_env_example(tmp_path: Path) -> None:
    client = compose_client()
    if client is None:
        pytest.skip("no docker compose client here and none installable (apt-get docker-compose failed); "
                    "the structural tests above still ran")
    done = compose_config(client, ENV_EXAMPLE, "--profile", "demo")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    # docker compose v2 leaves the monitoring profile out; Debian's docker-compose v1 lists every service.
    assert {"redis", *MQORDER_SERVICES} <= set(resolved) <= {"redis", *MQORDER_SERVICES, *MONITORING_SERVICES}
    assert resolved["worker"]["deploy"]["replicas"] == 2
    assert resolved["beat"]["deploy"]["replicas"] == 1
    assert resolved["flower"]["environment"]["FLOWER_BASIC_AUTH"] == env_example()["FLOWER_BASIC_AUTH"]
    assert resolved["worker"]["command"][resolved["worker"]["command"].index("-c") + 1] == \
        env_example()["WORKER_CONCURRENCY"]

    no_auth = tmp_path / "no-auth.env"
    no_auth.write_text("".join(f"{k}={v}\n" for k, v in env_example().items() if k != "FLOWER_BASIC_AUTH"))
    refused = compose_config(client, no_auth)
    assert refused.returncode != 0
    assert "FLOWER_BASIC_AUTH" in refused.stderr + refused.stdout


# -- the demo profile's workload, for real -------------------------------------------------------


@pytest.mark.e2e
def test_demo_workload_is_consumed_in_order_by_a_stock_worker(
    services: dict[str, dict[str, Any]], cluster: Cluster, r: redis.Redis, redis_url: str,
) -> None:
    """The demo service's own script, run against a real Redis and a stock worker started, as the
    compose file says, with the demo listener named in MQORDER_LISTENERS: every lifecycle handled,
    none out of order."""
    topic, group = "orders-compose", "order-lifecycle-compose"
    cluster.start_worker("cw1", MQORDER_LISTENERS="mqorder.examples.order_lifecycle", MQORDER_DEMO_TOPIC=topic,
                         MQORDER_DEMO_GROUP=group)
    script = command(services["demo"])
    assert script[:2] == ["python", "-c"]
    env = cluster.env(MQORDER_DEMO_TOPIC=topic, MQORDER_DEMO_GROUP=group, DEMO_ORDERS="50", DEMO_QUEUES="4")
    for _ in range(2):  # twice: a second run adds new orders to the existing topic
        done = subprocess.run([sys.executable, *script[1:]], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "published 200 events of 50 orders" in done.stdout

    with Producer(redis_url) as producer:
        assert producer.describe_topic(topic).queue_count == 4

    def counts() -> dict[str, int]:
        return {k.decode(): int(v) for k, v in r.hgetall(f"{demo_prefix(group)}:counts").items()}

    wait_for(lambda: counts().get("handled", 0) >= 400, timeout=60, what="both demo runs handled")
    c = counts()
    assert c.get("illegal", 0) == 0, json.dumps(c)
    assert c.get("duplicates", 0) == 0 and c.get("bad", 0) == 0, json.dumps(c)
    assert r.hlen(f"{demo_prefix(group)}:state") == 100  # 2 runs x 50 distinct orders, each at its last step
    assert {int(v) for v in r.hvals(f"{demo_prefix(group)}:state")} == {4}


# -- Dockerfile and .dockerignore ----------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), one list per stage."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, " ".join(arg.split())))
    return stages


def test_dockerfile_ships_a_slim_non_root_image_without_compilers() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build tools stay in the build stage"
    # Both stages start FROM ${BASE_IMAGE}, whose default is the official slim Python (a laptop's
    # build); deploy/compose/build_images.sh passes a local Debian base where no registry answers.
    default_base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert default_base, "the Dockerfile must declare ARG BASE_IMAGE=<default> before its stages"
    assert re.fullmatch(r"python:(\$\{PYTHON_VERSION\}|3\.1[1-9])-slim(-\w+)?", default_base[1]), default_base[1]
    for stage in stages:
        assert stage[0][1].split()[0] == "${BASE_IMAGE}", stage[0]
    final = stages[-1]
    runs = " ".join(arg for op, arg in final if op == "RUN")
    for tool in COMPILERS:
        assert not re.search(rf"(?<![\w-]){re.escape(tool)}(?![\w-])", runs), f"{tool} installed in the final image"
    assert "apt-get install" not in runs
    users = [arg for op, arg in final if op == "USER"]
    assert users, "the final image must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("root", "0")
    last_user = max(i for i, (op, _) in enumerate(final) if op == "USER")
    assert not any(op == "RUN" for op, _ in final[last_user:]), "nothing may run as root after USER"
    assert any(op == "COPY" and arg.startswith("--from=") for op, arg in final), "the final stage copies the build"
    build = " ".join(arg for stage in stages[:-1] for op, arg in stage if op == "RUN")
    assert re.search(r"pip install \.(\s|$)", build), "the repo is installed with `pip install .`"
    cmd = json.loads(next(arg for op, arg in final if op == "CMD"))
    assert cmd[:4] == ["celery", "-A", "mqorder.app", "worker"]


def test_dockerignore_keeps_the_venv_and_git_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".env"} <= ignored
    copied = {src for stage in dockerfile_stages() for op, arg in stage
              if op == "COPY" and not arg.startswith("--from=") for src in arg.split()[:-1]}
    assert copied and not copied & ignored, f"the Dockerfile copies ignored paths: {copied & ignored}"

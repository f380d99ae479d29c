"""The ``monitoring`` profile of docker-compose.yml: Prometheus with the shipped rules, Grafana with
the dashboard, both off unless asked for. No Docker engine runs these tests: they check that every
file the services mount exists in the repo where the service expects it, that the Prometheus
config the compose Prometheus loads is valid (``promtool check config``, which loads the rules
too) and scrapes what compose runs, and that ``docker compose config --profile monitoring``
accepts the file (tests/test_compose.py covers the rest of the stack)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tests.test_alert_rules import prometheus_tool
from tests.test_compose import COMPOSE, ENV_EXAMPLE, command, compose_client, compose_config

MONITORING = ("prometheus", "grafana")
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> repo path of the service's bind mounts of repo files (``./...:...``)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            out[target] = ROOT / source
    return out


def test_monitoring_services_run_official_images_only_in_their_profile(services: dict[str, dict[str, Any]]) -> None:
    images = {name: services[name]["image"] for name in MONITORING}
    assert images["prometheus"].startswith("prom/prometheus:"), images
    assert images["grafana"].startswith("grafana/grafana:"), images
    for name in MONITORING:
        assert services[name]["profiles"] == ["monitoring"], name
        # Prometheus has no login: published on the loopback only, like Grafana.
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
        assert services[name]["healthcheck"]["test"][0] == "CMD", name


def test_every_mounted_file_exists_where_the_service_reads_it(services: dict[str, dict[str, Any]]) -> None:
    for name in MONITORING:
        for target, source in mounts(services[name]).items():
            assert source.exists(), f"{name} mounts {source.relative_to(ROOT)} at {target}: no such file"
    prom = mounts(services["prometheus"])
    config = prom["/etc/prometheus/prometheus.yml"]
    assert config == PROMETHEUS_CONFIG
    assert f"--config.file={'/etc/prometheus/prometheus.yml'}" in command(services["prometheus"])
    # rule_files are relative to the config file: each must be mounted beside it.
    for rule_file in yaml.safe_load(config.read_text())["rule_files"]:
        assert prom[f"/etc/prometheus/{rule_file}"] == config.parent / rule_file
    grafana = mounts(services["grafana"])
    assert grafana["/etc/grafana/provisioning"] == ROOT / "deploy" / "grafana" / "provisioning"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/mqorder.yml").read_text())["providers"][0]
    assert (grafana[provider["options"]["path"]] / "mqorder.json").is_file()
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD")


def test_prometheus_scrapes_the_compose_exporter_and_workers(services: dict[str, dict[str, Any]]) -> None:
    done = subprocess.run([prometheus_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    exporter_cmd = command(services["exporter"])
    assert jobs["mqorder-exporter"]["static_configs"][0]["targets"] == [
        f"exporter:{exporter_cmd[exporter_cmd.index('--port') + 1]}"]
    dns = jobs["mqorder-workers"]["dns_sd_configs"][0]
    assert dns["names"] == ["worker"]
    assert str(dns["port"]) == services["worker"]["environment"]["MQORDER_METRICS_PORT"]


def test_docker_compose_config_accepts_the_monitoring_profile() -> None:
    client = compose_client()
    if client is None:
        pytest.skip("no docker compose client here and none installable; the structural tests above still ran")
    done = compose_config(client, ENV_EXAMPLE, "--profile", "monitoring")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert set(MONITORING) <= set(resolved)
    assert "${" not in str(resolved["grafana"]["environment"]), resolved["grafana"]["environment"]
    assert str(ROOT / "deploy" / "prometheus" / "alerts.yml") in str(resolved["prometheus"]["volumes"])

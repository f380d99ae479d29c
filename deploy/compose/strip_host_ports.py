"""Drop the published ``ports`` of host-network services from a resolved compose file.

Why: under host networking a container listens on the host's ports directly, so docker-compose.yml's
``ports:`` mean nothing. Compose v2 ignores them, but Compose v1 (Debian's ``docker-compose``,
docker-py) refuses the combination ("host" network_mode is incompatible with port_bindings), and
an override file cannot remove a key in v1. So the merged file is resolved once and cleaned here::

    docker-compose -f docker-compose.yml -f deploy/compose/hostnet.yml --profile demo config \\
      | python3 deploy/compose/strip_host_ports.py > hostnet-stack.yml
    docker-compose -p mqorder --project-directory . -f hostnet-stack.yml up -d

Reads the resolved file (``config`` output: variables already interpolated, ``$`` kept as ``$$``)
on stdin and writes it on stdout. Needs PyYAML (Debian's docker-compose depends on it).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml


def strip_host_ports(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with no ``ports`` on services whose ``network_mode`` is ``host``; a service on
    another network keeps its ports. Fails with a clear message when given no services."""
    services = config.get("services")
    if not isinstance(services, dict) or not services:
        raise SystemExit("strip_host_ports: no services in the input; pipe `docker-compose ... config` into it")
    for service in services.values():
        if service.get("network_mode") == "host":
            service.pop("ports", None)
    return config


def main() -> None:
    config = yaml.safe_load(sys.stdin)
    if not isinstance(config, dict):
        raise SystemExit("strip_host_ports: the input is not a compose file (a YAML mapping)")
    yaml.safe_dump(strip_host_ports(config), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()

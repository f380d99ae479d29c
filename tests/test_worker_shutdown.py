"""A worker's client leaves cleanly however Celery shuts the worker down, on a real prefork worker.

Celery calls ``stop`` on a warm shutdown (SIGTERM) and ``terminate`` on a cold one (SIGQUIT, or a
second Ctrl-C): a step that only defines ``stop`` did nothing on a cold shutdown, so the client
stayed registered and its queues owned by a dead worker until its heartbeat lapsed.
"""

from __future__ import annotations

import signal
import time

import pytest

from mqorder import keys
from tests.support import Cluster


@pytest.mark.parametrize(("sig", "kind"), [(signal.SIGTERM, "Warm"), (signal.SIGQUIT, "Cold")])
def test_a_worker_shut_down_warm_or_cold_unregisters_its_client(cluster: Cluster, sig: int, kind: str) -> None:
    w = cluster.start_worker(f"bye-{kind.lower()}")
    assert cluster.client.exists(keys.client_info(w.hostname))
    time.sleep(1.0)  # past the first heartbeat watch
    w.signal(sig, group=False)
    w.proc.wait(60)
    log = (cluster.tmp / f"bye-{kind.lower()}.log").read_text()
    assert f"{kind} shutdown" in log
    assert not cluster.client.exists(keys.client_info(w.hostname)), "the client is still registered"
    assert "left; queues rebalanced" in log

"""An old primary that lost its replicas answers NOREPLICAS (``min-replicas-to-write``): mqorder's
connections and Celery's broker connection take it for a failover, not for a fatal error.

Seen in the chaos scenario ``sentinel-pause``: the primary was SIGSTOPped past the failover and
resumed; until Sentinel demoted it (~10 s), the BRPOP of every worker's kombu connection got
NOREPLICAS, a ``ResponseError`` kombu treats as unrecoverable, and every worker exited.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import kombu
import pytest
import redis

from mqorder.celery.broker import SENTINEL_TRANSPORT, celery_broker
from mqorder.celery.sentinel_transport import SentinelTransport
from mqorder.store.connect import connect
from mqorder.testing.sentinel import SentinelDeployment

MAX_LAG_S = 1


@pytest.fixture(scope="module")
def deployment() -> Iterator[SentinelDeployment]:
    extra = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", str(MAX_LAG_S))
    # down-after far beyond the test: the paused replica must not be failed over or reconfigured.
    with SentinelDeployment(replicas=1, sentinels=1, down_after_ms=60_000, extra_args=extra) as d:
        yield d


def wait_refusing(d: SentinelDeployment) -> None:
    """Until the primary, its replica paused, refuses writes (NOREPLICAS)."""
    direct = d.direct_client(d.primary())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            direct.set("probe", 1)
        except redis.ResponseError as exc:
            assert str(exc).startswith("NOREPLICAS")
            return
        time.sleep(0.2)
    raise AssertionError("the primary kept accepting writes with its only replica paused")


def test_a_store_client_takes_noreplicas_for_a_failover_and_reconnects(deployment: SentinelDeployment) -> None:
    client = connect(deployment.url(), socket_timeout=2)
    (replica,) = deployment.replicas()
    client.set("k", "before")
    deployment.pause(replica)
    try:
        wait_refusing(deployment)
        with pytest.raises(redis.ConnectionError, match="lost its replicas"):
            client.set("k", "refused")
    finally:
        deployment.resume(replica)
    deployment.wait_replicas_online(1)
    deadline = time.monotonic() + 10
    while True:  # the primary takes writes again once the replica acks within min-replicas-max-lag
        try:
            client.set("k", "after")
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert client.get("k") == b"after"
    client.close()


def test_celerys_broker_connection_recovers_from_noreplicas(deployment: SentinelDeployment) -> None:
    broker = celery_broker(deployment.url())
    assert broker.transport == SENTINEL_TRANSPORT
    conn = kombu.Connection(broker.url, transport=broker.transport, transport_options=broker.transport_options)
    try:
        assert isinstance(conn.transport, SentinelTransport)
        q = conn.SimpleQueue("mqorder-demotion-test")
        q.put({"n": 1})
        assert q.get(timeout=5).payload == {"n": 1}
        (replica,) = deployment.replicas()
        deployment.pause(replica)
        try:
            wait_refusing(deployment)
            # What Celery's worker loop recovers from is connection_errors (a ResponseError is not
            # one: with kombu's own Sentinel transport this put raises ResponseError NOREPLICAS,
            # which ended the workers in the chaos run).
            assert not any(issubclass(redis.ResponseError, e) for e in conn.connection_errors)
            with pytest.raises(conn.connection_errors, match="lost its replicas"):
                q.put({"n": 2})
            with pytest.raises(conn.connection_errors, match="lost its replicas"):
                q.get(timeout=2)  # the BRPOP a worker's consumer loop blocks in
        finally:
            deployment.resume(replica)
        q.close()
    finally:
        conn.release()

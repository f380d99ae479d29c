"""The test harness's ``redis-server`` (``mqorder.testing.embedded``): the server it hands out is
its own process, even when another process takes its port first (the start-up race of parallel
test workers), and its FLUSHALL never wipes another process's server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from mqorder.errors import BrokerUnavailableError
from mqorder.testing import embedded
from mqorder.testing.embedded import RedisServer


def _pid_on(url: str) -> int:
    c = redis.Redis.from_url(url)
    try:
        return int(c.info("server")["process_id"])
    finally:
        c.close()


@pytest.fixture
def foreign() -> Iterator[RedisServer]:
    """Another process's redis-server, holding a key of its own."""
    with RedisServer() as srv:
        c = redis.Redis.from_url(srv.url)
        c.set("theirs", "keep me")
        c.close()
        yield srv


def _still_has_its_key(srv: RedisServer) -> bool:
    c = redis.Redis.from_url(srv.url)
    try:
        return c.get("theirs") == b"keep me"
    finally:
        c.close()


def test_a_picked_port_taken_before_the_server_binds_moves_to_another(
    foreign: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race made certain: the "free" port handed out is the one the foreign server holds.
    real_free_port = embedded.free_port
    handed = iter([foreign.port])
    monkeypatch.setattr(embedded, "free_port", lambda: next(handed, None) or real_free_port())
    with RedisServer() as ours:
        assert ours.port != foreign.port
        assert ours.proc is not None and _pid_on(ours.url) == ours.proc.pid
        assert ours.owns_port()
    assert _still_has_its_key(foreign)


def test_a_cluster_node_whose_bus_port_is_taken_moves_both_ports(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bus port handed out first is held by another process: the retry must pick a new bus
    # port too (it used to keep the taken one, and failed all five attempts).
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real_free_port = embedded.free_port
        handed = iter([real_free_port(), taken])  # the port, then the bus port
        monkeypatch.setattr(embedded, "free_port", lambda: next(handed, None) or real_free_port())
        node = RedisServer(workdir=str(tmp_path), cluster_bus=True, extra_args=[
            "--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")])
        assert node.bus_port == taken
        with node:
            assert node.bus_port != taken and node.owns_port()
            c = redis.Redis.from_url(node.url)
            assert c.info("cluster")["cluster_enabled"] == 1
            c.close()


def test_a_chosen_port_held_by_another_server_is_an_error_naming_it(foreign: RedisServer) -> None:
    srv = RedisServer(port=foreign.port)
    with pytest.raises(BrokerUnavailableError, match=rf"port {foreign.port} is taken by another process"):
        srv.start()
    srv.stop()
    assert _still_has_its_key(foreign)


def test_flushall_refuses_a_server_that_took_our_port(tmp_path) -> None:
    ours = RedisServer().start()
    try:
        ours.kill()  # our server dies; another one comes up on its port
        (tmp_path / "thief").mkdir()
        with RedisServer(port=ours.port, workdir=str(tmp_path / "thief")) as thief:
            c = redis.Redis.from_url(thief.url)
            c.set("theirs", "keep me")
            c.close()
            assert not ours.owns_port()
            with pytest.raises(BrokerUnavailableError, match="refusing to FLUSHALL"):
                ours.flushall()
            assert _still_has_its_key(thief)
    finally:
        ours.stop()


def test_flushall_of_our_own_server_empties_it() -> None:
    with RedisServer() as ours:
        c = redis.Redis.from_url(ours.url)
        c.set("k", "v")
        ours.flushall()
        assert c.dbsize() == 0
        c.close()

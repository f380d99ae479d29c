"""``mqorder doctor`` on replicated Redis: a standalone Redis, a primary with two replicas, a replica
by mistake, ``min-replicas-to-write`` set or not, and a ``redis+sentinel://`` URL with all its
Sentinels up, one down, then two. Real servers throughout (``SentinelDeployment``: a primary, two
replicas and three Sentinels, one per module)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from mqorder.cli import app
from mqorder.settings import get_settings
from mqorder.testing.embedded import RedisServer
from mqorder.testing.sentinel import SentinelDeployment

pytestmark = pytest.mark.timeout(180)


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def doctor(*extra: str) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    """Exit code and the findings of ``mqorder doctor --json`` by check (Celery's not checked)."""
    res = cli("doctor", "--app", "", "--json", *extra)
    assert res.exit_code in (0, 1), res.stdout + res.stderr
    by: dict[str, list[dict[str, Any]]] = {}
    for f in json.loads(res.stdout)["findings"]:
        by.setdefault(f["check"], []).append(f)
    return res.exit_code, by


def one(found: dict[str, list[dict[str, Any]]], check: str) -> dict[str, Any]:
    (f,) = found[check]
    return f


@pytest.fixture(scope="module")
def deployment() -> Iterator[SentinelDeployment]:
    with SentinelDeployment() as d:
        yield d


@pytest.fixture
def point(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``point(url, VAR=value...)``: the store URL and settings the next ``doctor`` reads."""

    def set_(url: str, **env: str) -> None:
        monkeypatch.setenv("MQORDER_REDIS_URL", url)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()

    yield set_
    get_settings.cache_clear()


def _in_sync(d: SentinelDeployment) -> None:
    c = d.direct_client(d.primary())
    try:
        c.set("doctor:probe", 1)
        assert c.execute_command("WAIT", len(d.nodes) - 1, 10_000) == len(d.nodes) - 1
    finally:
        c.close()


def test_standalone_redis_says_a_crash_loses_data_and_nothing_can_fail_over(redis_url: str) -> None:
    code, found = doctor()
    assert code == 0  # warnings only
    assert one(found, "role")["verdict"] == "OK"
    fo = one(found, "failover")
    assert fo["verdict"] == "WARN"
    assert fo["detail"] == ("no replicas: a primary crash loses everything since the last fsync/RDB; "
                            "no failover possible")
    assert one(found, "replicas")["data"]["connected"] == 0
    assert one(found, "send durability")["verdict"] == "OK"  # nothing to wait for
    assert "sentinel" not in found and "sentinels" not in found
    assert doctor("--strict")[0] == 1


def test_a_primary_with_replicas_counts_them_and_shows_how_far_behind_each_is(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    _in_sync(deployment)
    point(deployment.primary().url)
    code, found = doctor()
    assert code == 0
    reps = one(found, "replicas")
    assert reps["verdict"] == "OK" and reps["data"]["connected"] == 2 and reps["data"]["online"] == 2
    assert {r["addr"] for r in reps["data"]["replicas"]} == {f"127.0.0.1:{n.port}" for n in deployment.replicas()}
    assert "2 replicas connected" in reps["detail"] and " behind, last ack " in reps["detail"]
    fo = one(found, "failover")
    assert fo["verdict"] == "WARN" and fo["detail"].startswith("2 replicas, async: a failover can lose up to ")
    assert "lock grants are re-fenced by epoch" in fo["detail"]
    sd = one(found, "send durability")
    assert sd["verdict"] == "WARN" and "MQORDER_SEND_WAIT_REPLICAS=0: acknowledged sends can be lost on failover" \
        in sd["detail"]

    # A replica that stops acknowledging falls behind by what the primary writes meanwhile.
    lagging = deployment.replicas()[0]
    SentinelDeployment.pause(lagging)
    try:
        c = deployment.direct_client(deployment.primary())
        c.set("doctor:bulk", b"x" * 100_000)
        c.close()
        _, found = doctor()
    finally:
        SentinelDeployment.resume(lagging)
    by_addr = {r["addr"]: r for r in one(found, "replicas")["data"]["replicas"]}
    assert by_addr[f"127.0.0.1:{lagging.port}"]["lag_bytes"] >= 100_000
    assert one(found, "failover")["data"]["max_lag_bytes"] >= 100_000
    assert "KiB (last ack up to" in one(found, "failover")["detail"]
    _in_sync(deployment)


def test_the_send_wait_setting_is_judged_against_the_connected_replicas(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    point(deployment.primary().url, MQORDER_SEND_WAIT_REPLICAS="1")
    code, found = doctor()
    assert code == 0
    assert one(found, "send durability")["verdict"] == "OK"
    fo = one(found, "failover")
    assert fo["verdict"] == "OK" and "but not sends: they wait for 1 replica" in fo["detail"]
    point(deployment.primary().url, MQORDER_SEND_WAIT_REPLICAS="3")
    code, found = doctor()
    assert code == 1
    sd = one(found, "send durability")
    assert sd["verdict"] == "FAIL" and "connected_slaves:2: every send is refused" in sd["detail"]


def test_min_replicas_to_write_unset_warns_of_an_isolated_primary_and_set_is_ok(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    point(deployment.primary().url)
    _, found = doctor()
    mr = one(found, "min-replicas")
    assert mr["verdict"] == "WARN" and mr["data"] == {"min_replicas_to_write": 0, "min_replicas_max_lag": 10}
    assert "an isolated old primary keeps accepting writes that are discarded when it rejoins" in mr["detail"]
    c = deployment.direct_client(deployment.primary())
    try:
        c.config_set("min-replicas-to-write", 1)
        _, found = doctor()
        mr = one(found, "min-replicas")
        assert mr["verdict"] == "OK" and "refuses writes after 10 s" in mr["detail"]
        c.config_set("min-replicas-to-write", 3)
        code, found = doctor()
        assert code == 1
        assert one(found, "min-replicas")["verdict"] == "FAIL"
        assert "refuses every write now (NOREPLICAS)" in one(found, "min-replicas")["detail"]
    finally:
        c.config_set("min-replicas-to-write", 0)
        c.close()


def test_config_renamed_away_reads_as_unknown(point: Callable[..., None]) -> None:
    with RedisServer(extra_args=["--rename-command", "CONFIG", ""]) as srv:
        point(srv.url)
        _, found = doctor()
    mr = one(found, "min-replicas")
    assert mr["verdict"] == "WARN" and "unknown (CONFIG GET: unknown command" in mr["detail"]
    assert mr["data"] == {"min_replicas_to_write": None, "min_replicas_max_lag": None}


def test_pointed_at_a_replica_it_fails_and_says_to_use_the_primary(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    replica = deployment.replicas()[0]
    point(replica.url)
    code, found = doctor()
    assert code == 1
    role = one(found, "role")
    assert role["verdict"] == "FAIL" and role["detail"].startswith("this is a replica (of 127.0.0.1:")
    assert "redis+sentinel://" in role["fix"]
    assert "failover" not in found and "replicas" not in found  # they would describe the wrong node


def test_a_sentinel_url_checks_each_sentinel_and_whether_a_failover_can_happen(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    point(deployment.url())
    code, found = doctor()
    assert code == 0
    assert one(found, "role")["verdict"] == "OK"  # the data checks reach the primary through the Sentinels
    assert one(found, "replicas")["data"]["connected"] == 2
    sentinels = found["sentinel"]
    assert [s["verdict"] for s in sentinels] == ["OK"] * 3
    primary = f"127.0.0.1:{deployment.primary_port()}"
    for s in sentinels:
        d = s["data"]
        assert (d["primary"], d["quorum"], d["num_other_sentinels"], d["down_after_ms"], d["failover_timeout_ms"]) == (
            primary, 2, 2, deployment.down_after_ms, deployment.failover_timeout_ms)
        assert d["ckquorum_ok"] and d["ckquorum"].startswith("OK ")
    summary = one(found, "sentinels")
    assert summary["verdict"] == "OK" and summary["detail"].startswith("3 of 3 Sentinels answer")
    assert summary["data"] | {"primaries": None} == {"listed": 3, "answering": 3, "known": 3, "quorum": 2,
                                                      "majority": 2, "primaries": None}


def test_a_hung_sentinel_costs_about_its_timeout(deployment: SentinelDeployment) -> None:
    """The doctor asks each Sentinel once, with a 1 s timeout: a paused one does not stall it."""
    from mqorder.admin.doctor_ha import SENTINEL_TIMEOUT_S, ask_sentinel
    from mqorder.store.urls import parse_sentinel_url

    alive = next(s for s in deployment.sentinels if s.proc is not None and s.proc.poll() is None)
    assert alive.proc is not None
    SentinelDeployment.pause(alive)  # type: ignore[arg-type]  # it needs only .proc, which a Sentinel has too
    try:
        t0 = time.monotonic()
        view = ask_sentinel(parse_sentinel_url(deployment.url()), "127.0.0.1", alive.port)
        took = time.monotonic() - t0
    finally:
        SentinelDeployment.resume(alive)  # type: ignore[arg-type]
    assert not view.reachable and "TimeoutError" in view.error
    assert took < SENTINEL_TIMEOUT_S * 3


def test_one_sentinel_down_is_reported_and_two_stop_any_failover(
    deployment: SentinelDeployment, point: Callable[..., None]
) -> None:
    """Last in the module: it stops Sentinels of the shared deployment for good."""
    dead = deployment.sentinels[0]
    dead.stop()
    point(deployment.url())
    t0 = time.monotonic()
    code, found = doctor()
    assert code == 0, found  # a WARN: reported, and a failover can still happen
    assert time.monotonic() - t0 < 30
    by_addr = {s["data"]["addr"]: s for s in found["sentinel"]}
    down = by_addr[f"127.0.0.1:{dead.port}"]
    assert down["verdict"] == "WARN" and "did not answer" in down["detail"] and not down["data"]["reachable"]
    assert sorted(s["verdict"] for s in found["sentinel"]) == ["OK", "OK", "WARN"]
    summary = one(found, "sentinels")
    assert summary["verdict"] == "OK" and summary["detail"].startswith("2 of 3 Sentinels answer")
    assert "1 listed in the URL do not answer" in summary["detail"]
    assert doctor("--strict")[0] == 1

    deployment.sentinels[1].stop()
    code, found = doctor()
    assert code == 1
    summary = one(found, "sentinels")
    assert summary["verdict"] == "FAIL" and summary["detail"].startswith("1 of 3 Sentinels answer")
    assert "no failover can happen now" in summary["detail"]

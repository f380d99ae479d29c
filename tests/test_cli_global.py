"""The ``mqorder`` root: ``--version``, the global ``--redis-url`` (over ``MQORDER_REDIS_URL``),
errors on stderr with the documented exit codes, and Enum choices refused by name. Against the
suite's real redis-server, through typer's CliRunner (and ``python -m mqorder.cli`` once)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from mqorder import Producer
from mqorder.cli import EXIT_BAD, EXIT_OK, app
from mqorder.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parents[1]
#: Nothing listens on port 1: a connection there is refused at once.
UNREACHABLE = "redis://127.0.0.1:1/0"


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def plain(text: str) -> str:
    """One line of words: typer draws usage errors in a box that wraps at 80 columns."""
    return " ".join(text.replace("│", " ").split())


def test_version_prints_the_installed_package_version() -> None:
    res = cli("--version")
    assert res.exit_code == EXIT_OK
    assert res.stdout == f"mqorder {importlib.metadata.version('mqorder')}\n"
    proc = subprocess.run([sys.executable, "-m", "mqorder.cli", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == res.stdout, proc.stderr


def test_the_global_redis_url_replaces_the_environment_for_the_command_then_is_put_back(
    redis_url: str, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = Producer(settings=settings)
    producer.create_topic("orders", queues=3)
    producer.close()
    monkeypatch.setenv("MQORDER_REDIS_URL", UNREACHABLE)
    get_settings.cache_clear()
    assert cli("topic", "list").exit_code == EXIT_BAD  # the environment alone points nowhere
    res = cli("--redis-url", redis_url, "topic", "list", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert [(t["topic"], t["queue_count"]) for t in json.loads(res.stdout)] == [("orders", 3)]
    assert os.environ["MQORDER_REDIS_URL"] == UNREACHABLE and get_settings().redis_url == UNREACHABLE


def test_an_unreachable_global_redis_url_is_a_clear_error_on_stderr_with_exit_2(redis_url: str) -> None:
    res = cli("--redis-url", UNREACHABLE, "topic", "list")
    assert res.exit_code == EXIT_BAD
    assert res.stdout == ""
    assert "cannot reach Redis broker 'broker-a' at redis://127.0.0.1:1/0" in plain(res.stderr)
    assert os.environ["MQORDER_REDIS_URL"] == redis_url


def test_a_malformed_global_redis_url_names_the_option(redis_url: str) -> None:
    res = cli("--redis-url", "http://127.0.0.1:6379", "status", "g")
    assert res.exit_code == EXIT_BAD and res.stdout == ""
    assert "--redis-url='http://127.0.0.1:6379' has scheme 'http'" in plain(res.stderr)


def test_errors_go_to_stderr_and_nothing_to_stdout(redis_url: str, tmp_path: Path) -> None:
    missing = cli("topic", "describe", "nope")
    assert missing.exit_code == EXIT_BAD and missing.stdout == ""
    assert "error: topic 'nope' does not exist" in missing.stderr
    # The pipeline's checks before Spark report the same way (they printed to stdout before).
    export = cli("pipeline", "export", "--topic", "nope", "--out", str(tmp_path / "x.csv"))
    assert export.exit_code == EXIT_BAD and export.stdout == ""
    assert "must end with .parquet" in plain(export.stderr)


def test_fixed_values_are_enum_choices_listed_in_help_and_refused_by_name(redis_url: str) -> None:
    bad_perm = cli("topic", "create", "t", "--perm", "rwx")
    assert bad_perm.exit_code == EXIT_BAD and bad_perm.stdout == ""
    assert "topic permission must be one of rw, r, w, got 'rwx'" in plain(bad_perm.stderr)
    assert "rw|r|w" in cli("topic", "create", "--help").stdout
    bad_policy = cli("topic", "retention", "t", "--policy", "forever")
    assert bad_policy.exit_code == EXIT_BAD
    assert "retention policy must be one of time, consumed, got 'forever'" in plain(bad_policy.stderr)
    assert "key|queue" in cli("pipeline", "audit", "--help").stdout
    bad_ordering = cli("pipeline", "audit", "--topic", "t", "--group", "g", "--report", "r", "--ordering", "lane")
    assert bad_ordering.exit_code == EXIT_BAD
    assert "--ordering must be one of key, queue, got 'lane'" in plain(bad_ordering.stderr)
    created = cli("topic", "create", "t", "--queues", "2", "--perm", "r", "--retention-policy", "consumed", "--json")
    assert created.exit_code == EXIT_OK, created.stderr
    info = json.loads(created.stdout)
    assert (info["perm"], info["retention"]["policy"]) == ("r", "consumed")


def test_every_command_prints_its_help() -> None:
    """``--help`` of the program and of every command and group renders (rich markup in a help
    text, such as a URL's optional ``[/<db>]``, once made ``mqorder --help`` itself crash)."""
    import typer.main

    def walk(cmd, path: list[str]):
        yield path
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name])

    paths = list(walk(typer.main.get_command(app), []))
    assert len(paths) > 10
    for path in paths:
        res = cli(*path, "--help")
        assert res.exit_code == EXIT_OK, (path, res.stdout, res.stderr, res.exception)
        assert "Usage" in res.stdout, path
    assert "redis+sentinel://[:password@]" in plain(cli("--help").stdout).replace("\n", "")

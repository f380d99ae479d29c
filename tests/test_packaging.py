"""What ``pip install mqorder`` puts on the import path: ``mqorder`` and nothing else (issue 24).

The checkout's top-level ``workers``, ``tasks`` and ``config`` are the reference app; installed,
they would shadow any application's own ``config`` package. The project is installed for real
with this interpreter's pip into a temporary directory (from a copy of the checkout, so the build's
``build/`` and ``*.egg-info`` land there and not in the shared working tree), and the result is
read from the files pip wrote and from the wheel's own RECORD.

Pip builds in an isolated environment: the virtualenv lacks ``wheel``, which setuptools'
``bdist_wheel`` needs, and the build requirements come from the local wheel cache, so no network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

#: Not part of the source tree a build sees (the Dockerfile's context leaves them out too).
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", "*.egg-info", "build", "dist",
                                 ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis", "spark-warehouse",
                                 "*.log")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("packaging")
    src, target = base / "src", base / "target"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(target), "."],
        cwd=src, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr
    return target


def test_installing_puts_only_mqorder_on_the_import_path(installed: Path) -> None:
    # ``bin`` holds the ``mqorder`` console script; it is not on the import path.
    names = {p.name for p in installed.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info")}
    assert names == {"mqorder"}, f"top-level importable names besides mqorder: {names - {'mqorder'}}"
    (dist_info,) = installed.glob("mqorder-*.dist-info")
    recorded = {line.split(",", 1)[0] for line in (dist_info / "RECORD").read_text().splitlines() if line}
    # The console script is recorded relative to the install directory's parent (``../../bin``).
    tops = {path.split("/", 1)[0] for path in recorded if not path.startswith("../")}
    assert tops == {"mqorder", dist_info.name}, tops
    assert {path for path in recorded if path.startswith("../")} == {"../../bin/mqorder"}


def test_the_package_ships_the_lua_scripts_the_stock_app_and_the_demo_listener(installed: Path) -> None:
    pkg = installed / "mqorder"
    lua = {p.name for p in (pkg / "store" / "lua").glob("*.lua")}
    assert lua == {p.name for p in (ROOT / "mqorder" / "store" / "lua").glob("*.lua")}
    assert "_now.lua" in lua
    for module in ("app.py", "celery/stock_config.py", "examples/order_lifecycle.py"):
        assert (pkg / module).is_file(), module


def test_the_installed_stock_app_loads_without_the_checkout(installed: Path, tmp_path: Path) -> None:
    """``mqorder.app`` (what ``celery -A mqorder.app`` imports) from the installed copy, put first
    on the path and run from an empty directory: it finds its configuration inside the package and
    loads exactly the listener module it is told to (here the demo's, from the package too)."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[1]]; import mqorder.app as a; "
        "from mqorder.consumer.listener import registered_listeners; "
        "print(a.__file__); print(a.app.conf.task_serializer, a.app.conf.worker_send_task_events); "
        "print(sorted((s.group, s.topic) for s in registered_listeners() if not s.is_retry))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(installed)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "MQORDER_LISTENERS": "mqorder.examples.order_lifecycle",
             "MQORDER_REDIS_URL": "redis://127.0.0.1:1/0"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    path, conf, groups = done.stdout.strip().splitlines()
    assert path == str(installed / "mqorder" / "app.py")
    assert conf == "json True"
    assert groups == "[('order-lifecycle', 'orders')]"

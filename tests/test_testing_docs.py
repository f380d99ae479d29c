"""docs/TESTING.md's files run as written: every Python block of the page that starts with a
``# <path>.py`` line is written to that path in an empty directory, and pytest runs the test
files there in a subprocess, as an application's own suite would (its own rootdir, no conftest of
ours, the stock ``mqorder.app`` worker loading ``myapp.listeners``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PAGE = ROOT / "docs" / "TESTING.md"
FILE_BLOCK = re.compile(r"```python\n# ([\w/]+\.py)\n(.*?)```", re.S)


def page_files() -> dict[str, str]:
    files = {path: f"# {path}\n{code}" for path, code in FILE_BLOCK.findall(PAGE.read_text())}
    assert "myapp/listeners.py" in files, "docs/TESTING.md lost its listener module"
    return files


def test_every_python_block_of_the_page_is_a_file_run_here() -> None:
    blocks = PAGE.read_text().count("```python\n")
    assert blocks == len(page_files()), "a python block without a '# <path>.py' first line is not tested"


@pytest.mark.e2e
def test_the_pages_tests_pass_as_written(tmp_path: Path) -> None:
    for path, code in page_files().items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)
    (tmp_path / "myapp" / "__init__.py").touch()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the application's rootdir, not ours
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's mqorder
    for name in ("MQORDER_REDIS_URL", "MQORDER_CELERY_BROKER_URL", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    tests = sorted(p for p in page_files() if p.startswith("test_"))
    assert len(tests) == 3
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert re.search(r"\b7 passed\b", proc.stdout), proc.stdout[-2000:]

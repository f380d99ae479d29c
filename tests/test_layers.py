"""The library's layering, checked on the real import graph (not by reading the code)."""

from __future__ import annotations

import subprocess
import sys

#: Modules allowed to import Celery: the integration itself, and the entry points that start it.
CELERY_SIDE = ("mqorder.celery", "mqorder.spark", "mqorder.cli", "mqorder.demo", "mqorder.app")

# Module names come from the files (pkgutil.walk_packages would import every package to walk it,
# the Celery side included).
PROBE = f"""
import importlib, pathlib, sys
import mqorder
root = pathlib.Path(mqorder.__file__).parent
skip = {CELERY_SIDE!r}
names = sorted(
    n for n in ("mqorder." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                for p in root.rglob("*.py"))
    if not n.startswith(skip)
)
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m == "celery" or m.startswith(("celery.", "kombu")))
print(len(names), leaked)
"""


def test_the_core_imports_nothing_from_celery() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    count, leaked = out.stdout.strip().split(" ", 1)
    assert int(count) > 20  # the walk really imported the core
    assert leaked == "[]", f"the Celery-free core pulled in {leaked}"

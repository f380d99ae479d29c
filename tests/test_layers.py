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


def _consumer_imports() -> dict[str, set[str]]:
    """Module -> the mqorder.consumer modules it imports, and every import made inside a function."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "mqorder" / "consumer"
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        graph[f"mqorder.consumer.{path.stem}"] = {
            node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mqorder.consumer.")
        }
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
                assert not inner, f"{path.name}: {fn.name} imports inside a function: {inner}"
    return graph


def test_the_consumer_package_imports_form_a_dag() -> None:
    """A request class importing the engine that picks request classes (a cycle once resolved by an
    import inside a function) is the shape this forbids: each module imports only ones below it."""
    import graphlib

    graph = _consumer_imports()
    assert "mqorder.consumer.engine" in graph and graph["mqorder.consumer.engine"]
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("mqorder.consumer.consume_request") < order.index("mqorder.consumer.engine")

"""How ``make test`` spreads the suite over its pytest-xdist workers (``--dist loadgroup``).

pytest-xdist's own ``loadgroup`` does not group on pytest 9.2 (it renames ``item._nodeid``, which
pytest 9 no longer reads), and plain ``load`` sends tests anywhere. Two needs of this suite:

- **Shared Spark servers.** The standalone cluster and the Spark Connect server are session
  fixtures (``tests/spark_cluster.py``): one per worker process that uses them. The issue asks for
  one of each per run, and a cluster has cores for one tests' driver and one ``mqorder pipeline``
  application at a time, so every test that needs them runs on one worker, as one unit
  (``GROUPS``).
- **The longest first.** The slowest tests (whole stacks, JVMs, chaos runs) are handed out before
  the hundreds of quick ones (``FIRST``), so the run does not end with one worker finishing a
  long test alone while the other idles.

Everything else is one test per unit, handed to whichever worker has fewer than two pending, as
xdist's ``loadscope`` does with its scopes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Test files whose tests must run on one worker, in one unit: group name -> files.
GROUPS: dict[str, tuple[str, ...]] = {
    "spark-servers": ("tests/test_spark_standalone.py", "tests/test_spark_connect.py",
                      "tests/test_spark_pipelines.py"),
}

#: Files handed out first, slowest first (measured durations of a full run, 2 cores).
FIRST: tuple[str, ...] = (
    "tests/test_spark_driver_kill.py",
)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class GroupedLoadScheduling(LoadScopeScheduling):
    """``loadscope`` with one unit per test, except the files of a ``GROUPS`` entry (one unit
    each group), and units ordered groups first, then ``FIRST``, then collection order."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._group_of = {f: name for name, files in GROUPS.items() for f in files}

    def _split_scope(self, nodeid: str) -> str:
        group = self._group_of.get(_file(nodeid))
        return f"group:{group}" if group else nodeid

    def _rank(self, scope: str, first_nodeid: str) -> tuple[int, int]:
        if scope.startswith("group:"):
            return (0, 0)
        f = _file(first_nodeid)
        return (1, FIRST.index(f)) if f in FIRST else (2, 0)

    def schedule(self) -> None:
        """xdist's ``LoadScopeScheduling.schedule`` with this class's order of units."""
        assert self.collection_is_completed
        if self.collection is not None:  # the initial distribution happened: reschedule
            for node in self.nodes:
                self._reschedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = list(next(iter(self.registered_collections.values())))
        if not self.collection:
            return
        units: OrderedDict[str, dict[str, bool]] = OrderedDict()
        for nodeid in self.collection:
            units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for scope, unit in sorted(units.items(), key=lambda kv: self._rank(kv[0], next(iter(kv[1])))):
            self.workqueue[scope] = unit
        for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than units
            self.assigned_work.popitem()[0].shutdown()
        for node in self.nodes:
            self._assign_work_unit(node)
        for node in self.nodes:
            self._reschedule(node)
        if not self.workqueue:
            for node in self.nodes:
                node.shutdown()


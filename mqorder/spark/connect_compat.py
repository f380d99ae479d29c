"""Spark Connect client: let a command's response stream carry metrics (SPARK-59135).

pyspark 4.3.0's Connect client ends ``execute_command_as_iterator`` with ``UNKNOWN_RESPONSE`` at
the first item of a command's response stream that is not a dict, though it decodes metrics
itself; and a Python data source's workers send empty profiler accumulator updates, as observed
metrics, even with profiling off. So a ``spark-pipelines run`` whose flows read or write
``format("mqorder")`` printed "Run is COMPLETED" and then exited 1 on that error (the same happens
to any command stream: streaming listeners too). Upstream fixed it (apache/spark#58435: the
iterator yields every decoded item and its consumers skip metrics).

``install()`` gives the client that behaviour where it lacks it: its command iterator skips
``PlanMetrics`` and ``ObservedMetrics`` (already applied to accumulators when decoded) and still
refuses anything else. It is a no-op on a client that does not raise on them, and it is installed
by ``mqorder.spark.register`` on a Spark Connect session, so a pipeline definition that registers
the data source fixes its own ``spark-pipelines`` process.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

_MARK = "_mqorder_skips_metrics"


def _needs_patch(fn: Any) -> bool:
    """The 4.3.0 body: a dict check that raises ``UNKNOWN_RESPONSE`` on everything else."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "isinstance(response, dict)" in source and "UNKNOWN_RESPONSE" in source and "Metrics" not in source


def install() -> bool:
    """Patch the Connect client's command iterator if it needs it; True if patched now."""
    try:
        from pyspark.errors import PySparkValueError
        from pyspark.sql.connect.client.core import SparkConnectClient
        from pyspark.sql.metrics import ObservedMetrics, PlanMetrics
    except ImportError:  # no Connect client here (the connect extra is not installed)
        return False
    original = SparkConnectClient.execute_command_as_iterator
    if getattr(original, _MARK, False) or not _needs_patch(original):
        return False

    def execute_command_as_iterator(self: Any, command: Any, observations: Any = None) -> Iterator[dict[str, Any]]:
        req = self._execute_plan_request_with_metadata()
        self._set_command_in_plan(req.plan, command)
        for response in self._execute_and_fetch_as_iterator(req, observations or {}):
            if isinstance(response, dict):
                yield response
            elif not isinstance(response, PlanMetrics | ObservedMetrics):
                raise PySparkValueError(errorClass="UNKNOWN_RESPONSE", messageParameters={"response": str(response)})

    setattr(execute_command_as_iterator, _MARK, True)
    execute_command_as_iterator.__doc__ = original.__doc__
    SparkConnectClient.execute_command_as_iterator = execute_command_as_iterator  # type: ignore[method-assign]
    return True

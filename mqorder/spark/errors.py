"""mqorder's own error inside a Spark error: the same message in every mode.

A check that fails where Spark runs the data source (an unknown topic, a missing column, null
keys) reaches the caller wrapped by Spark: a classic session raises an ``AnalysisException`` or a
``PythonException`` whose text holds the Python traceback, a Spark Connect client a gRPC error
with that traceback (and the JVM's, unless the server sets
``spark.sql.connect.serverStacktrace.enabled=false``). The message our check wrote is still in
there, as the traceback's last line ``mqorder.errors.TopicNotFoundError: topic 'x' does not exist;
create it first with ...``. ``mqorder_error`` finds it and rebuilds the exception, so
``mqorder.spark.publish`` and ``mqorder pipeline`` raise and print what a local check would, on
``local[*]``, on a cluster and through Spark Connect alike.
"""

from __future__ import annotations

import importlib
import re

from mqorder.errors import MQOrderError

#: ``mqorder.<module>.<ErrorName>: <message>``, the last line Python prints for an exception.
_RAISED = re.compile(r"^(mqorder(?:\.\w+)*)\.(\w+Error): (.+)$")
#: What Spark appends after the Python traceback: not part of our message.
_SPARK_TAIL = re.compile(r"^\s*(SQLSTATE|JVM stacktrace|at |org\.apache\.|Caused by|\[|File \"|Traceback)")


def mqorder_error(exc: BaseException) -> MQOrderError | None:
    """The mqorder exception a Spark error carries (its last one, the one raised), else ``None``."""
    lines = str(exc).splitlines()
    found: tuple[int, re.Match[str]] | None = None
    for i, line in enumerate(lines):
        m = _RAISED.match(line.strip())
        if m:
            found = (i, m)
    if found is None:
        return None
    i, m = found
    message = [m.group(3).strip()]
    for line in lines[i + 1:]:  # a message of several lines (a refused job's counts)
        if not line.strip() or _SPARK_TAIL.match(line):
            break
        message.append(line.rstrip())
    text = "\n".join(message)
    try:
        cls = getattr(importlib.import_module(m.group(1)), m.group(2), None)
    except ImportError:
        cls = None
    if isinstance(cls, type) and issubclass(cls, MQOrderError):
        try:
            return cls(text)
        except TypeError:  # an error class with a constructor of its own: keep the message
            pass
    return MQOrderError(f"{m.group(2)}: {text}")

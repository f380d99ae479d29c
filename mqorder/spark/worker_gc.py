"""Keep PySpark's end-of-task garbage collection cheap in the Python workers that run our tasks.

A reused PySpark worker (``spark.python.worker.reuse``, the default) runs ``gc.collect()`` after
every task (``pyspark/daemon.py``). A full collection walks every object the cyclic collector
tracks, and a worker that has run one of our tasks holds pyspark's, pyarrow's, numpy's, redis-py's
and mqorder's modules: ~77,000 objects, 15 ms per collection in a bare process and about 50 ms in
a read worker (py-spy: 16.5 % of a read worker's samples during warm counts of 300,000 messages,
two tasks per count). Those objects live as long as the process, so walking them finds nothing.

``freeze_imports()``, called where our code starts in a worker (a read or write task, and the
planning of one: schema, reader, writer), collects once, then moves every object alive at that moment into the
permanent generation (``gc.freeze``, meant for exactly this: long-lived objects of a process
that should not be walked again). Later collections walk only what was created after it, so
garbage of later tasks is still collected. The one cost: an object frozen here that later becomes
part of a garbage cycle is not freed; that is bounded by what was alive at the first task (the
modules), not growing per task.
"""

from __future__ import annotations

import gc
import os

_frozen = False


def freeze_imports() -> None:
    """Once per process, in a reused PySpark worker (``SPARK_REUSE_WORKER``, set by Spark for its
    workers; only they run the per-task collection): collect, then freeze what is alive now.
    Anywhere else (a driver, a test calling a reader directly) it does nothing: a user's process
    keeps its collector as it was."""
    global _frozen
    if _frozen or not os.environ.get("SPARK_REUSE_WORKER"):
        return
    _frozen = True
    gc.collect()
    gc.freeze()

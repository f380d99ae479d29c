"""Keep PySpark's end-of-task garbage collection cheap in the Python workers that run our tasks.

A reused PySpark worker (``spark.python.worker.reuse``, the default) is a child of PySpark's daemon
(``python -m pyspark.daemon``), which runs ``gc.collect()`` after every task it hands the worker
(``pyspark/daemon.py``). A full collection walks every object the cyclic collector tracks, and a
worker that has run one of our tasks holds pyspark's, pyarrow's, numpy's, redis-py's and mqorder's
modules: ~77,000-85,000 objects, 15 ms per collection in a bare process and about 50 ms in a read
worker (py-spy: 16.5 % of a read worker's samples during warm counts of 300,000 messages, two
tasks per count). Those objects live as long as the process, so walking them finds nothing.

``freeze_imports()``, called where our code starts in a worker (a read or write task, and the
planning of one: schema, reader, writer), collects once, then moves every object alive at that
moment into the permanent generation (``gc.freeze``, meant for long-lived objects of a process
that should not be walked again). Later collections walk only what was created after it, so
garbage of later tasks is still collected.

What it costs: a frozen object is never freed by the cyclic collector. If one later drops out as
part of a cycle (say a cache a UDF that ran earlier in the same worker kept in a cycle, replaced
afterwards), it leaks, with whatever it references by then, young objects included. Each frozen
object can leak once at most; what is frozen is what was alive at our first task in the process
(almost all of it modules). ``spark.python.worker.reuse=false`` turns this off with the reuse.

It does nothing outside a daemon's reused worker: a driver, a Spark Connect client, a one-shot
worker (``spark.python.use.daemon=false``, Windows: no per-task collection there, so nothing to
save), or a program a UDF starts (it inherits ``SPARK_REUSE_WORKER``, not the daemon's
``__main__``).
"""

from __future__ import annotations

import gc
import os
import sys

_frozen = False


def in_reused_daemon_worker() -> bool:
    """True in a worker forked by ``pyspark.daemon`` for reuse: the processes that run a full
    collection after every task (Spark sets ``SPARK_REUSE_WORKER`` for them)."""
    if not os.environ.get("SPARK_REUSE_WORKER"):
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "pyspark.daemon"


def freeze_imports() -> None:
    """Once per process, in a reused daemon worker (``in_reused_daemon_worker``): collect, then
    freeze what is alive now. Anywhere else it does nothing: a user's process keeps its collector
    as it was."""
    global _frozen
    if _frozen or not in_reused_daemon_worker():
        return
    _frozen = True
    gc.collect()
    gc.freeze()

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
garbage of later tasks is still collected. What the first task imported after its freeze (~29,000
objects after a first read) is frozen at a later task's start in the same way, while there are
more than ``REFREEZE_ABOVE`` such objects, ``MAX_FREEZES`` times per process at most.

What it costs: a frozen object is never freed by the cyclic collector. If one later drops out as
part of a cycle (say a cache a UDF that ran earlier in the same worker kept in a cycle, replaced
afterwards), it leaks, with whatever it references by then, young objects included. Each frozen
object can leak once at most; what is frozen is what was alive at our first few tasks in the
process (almost all of it modules). ``spark.python.worker.reuse=false`` turns this off with the reuse.

It does nothing outside a daemon's reused worker: a driver, a Spark Connect client, a one-shot
worker (``spark.python.use.daemon=false``, Windows: no per-task collection there, so nothing to
save), or a program a UDF starts (it inherits ``SPARK_REUSE_WORKER``, not the daemon's
``__main__``).
"""

from __future__ import annotations

import gc
import os
import sys

#: Objects the cyclic collector tracks outside the frozen generation at a task's start above which
#: the worker freezes again. A first task imports modules lazily after the first freeze (pyarrow's
#: compute and JSON modules, hiredis, redis-py's pool...): ~29,000 objects after a first read
#: here, which the daemon's collection then walked after every later task (8-25 ms each). At the
#: next task's start they are alive and frozen too; what one task leaves behind stays below this.
REFREEZE_ABOVE = 10_000
#: Freezes per process at most: each freezes what is alive at that moment, and a frozen object
#: that later becomes garbage in a cycle is never freed, so what is frozen stays what the
#: process's first few tasks left alive (almost all of it modules).
MAX_FREEZES = 3

_freezes = 0


def in_reused_daemon_worker() -> bool:
    """True in a worker forked by ``pyspark.daemon`` for reuse: the processes that run a full
    collection after every task (Spark sets ``SPARK_REUSE_WORKER`` for them)."""
    if not os.environ.get("SPARK_REUSE_WORKER"):
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "pyspark.daemon"


def freeze_imports() -> None:
    """In a reused daemon worker (``in_reused_daemon_worker``): the first time, collect, then freeze
    what is alive now; at a later task's start, freeze again if more than ``REFREEZE_ABOVE``
    objects are tracked outside the frozen generation (what the first tasks imported), up to
    ``MAX_FREEZES`` times in all. Anywhere else it does nothing: a user's process keeps its
    collector as it was."""
    global _freezes
    if _freezes >= MAX_FREEZES or not in_reused_daemon_worker():
        return
    if _freezes and len(gc.get_objects()) <= REFREEZE_ABOVE:
        return
    _freezes += 1
    gc.collect()
    gc.freeze()

"""The Python workers that ran our tasks freeze their imports, so PySpark's per-task gc.collect()
stays cheap, and garbage made before and after the freeze is still collected."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mqorder import Producer


def test_freeze_collects_first_freezes_once_and_later_garbage_is_still_collected() -> None:
    # In a process of its own: gc.freeze is process-wide.
    code = textwrap.dedent("""
        import gc, importlib.machinery, sys, weakref
        from mqorder.spark import worker_gc

        # What a worker forked by `python -m pyspark.daemon` sees as its __main__ (the Spark test
        # below covers the real daemon).
        sys.modules["__main__"].__spec__ = importlib.machinery.ModuleSpec("pyspark.daemon", None)
        assert worker_gc.in_reused_daemon_worker()

        class Node:
            pass

        def cycle():
            a, b = Node(), Node()
            a.other, b.other = b, a
            return weakref.ref(a)

        gc.disable()  # only explicit collections from here on
        before = cycle()  # garbage alive when the freeze comes: collected, not frozen
        assert before() is not None
        worker_gc.freeze_imports()
        assert before() is None, "garbage alive at the freeze was frozen"
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen  # the imported modules' objects
        worker_gc.freeze_imports()
        assert gc.get_freeze_count() == frozen, "the second call froze again"
        after = cycle()  # garbage of a later task
        gc.collect()
        assert after() is None, "garbage made after the freeze was not collected"
        print("ok", frozen)
    """)
    env = {**os.environ, "SPARK_REUSE_WORKER": "1"}  # what Spark sets for the workers it reuses
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_what_later_tasks_leave_alive_is_frozen_again_a_bounded_number_of_times() -> None:
    # Modules a first task imports after its freeze (~29,000 objects after a first read) would be
    # walked by the daemon's collection after every later task: the next task's start freezes
    # them, and only past REFREEZE_ABOVE objects, MAX_FREEZES times per process at most.
    code = textwrap.dedent("""
        import gc, importlib.machinery, sys
        from mqorder.spark import worker_gc

        sys.modules["__main__"].__spec__ = importlib.machinery.ModuleSpec("pyspark.daemon", None)
        gc.disable()

        class Node:
            pass

        worker_gc.freeze_imports()
        counts = [gc.get_freeze_count()]
        kept = []
        for _ in range(worker_gc.MAX_FREEZES + 1):
            kept.append([Node() for _ in range(worker_gc.REFREEZE_ABOVE + 5000)])  # a lazy import's worth
            worker_gc.freeze_imports()
            counts.append(gc.get_freeze_count())
        grew = [b - a for a, b in zip(counts, counts[1:])]
        n = worker_gc.REFREEZE_ABOVE + 5000
        assert all(g >= n for g in grew[: worker_gc.MAX_FREEZES - 1]), grew
        assert grew[worker_gc.MAX_FREEZES - 1:] == [0, 0], grew  # the bound: no freeze after the last
        assert len(gc.get_objects()) >= 2 * n  # what came after the last freeze is still walked
        print("ok", grew)
    """)
    env = {**os.environ, "SPARK_REUSE_WORKER": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


@pytest.mark.parametrize("reuse", [None, "1"], ids=["no reuse", "reuse, not a daemon worker"])
def test_outside_a_reused_daemon_worker_nothing_is_frozen(reuse: str | None) -> None:
    # A driver, a one-shot worker (spark.python.use.daemon=false), or a program a UDF starts (it
    # inherits SPARK_REUSE_WORKER but not the daemon's __main__).
    code = "import gc; from mqorder.spark import worker_gc; worker_gc.freeze_imports(); print(gc.get_freeze_count())"
    env = {k: v for k, v in os.environ.items() if k != "SPARK_REUSE_WORKER"}
    if reuse:
        env["SPARK_REUSE_WORKER"] = reuse
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_worker_that_read_a_topic_has_frozen_its_imports(spark, redis_url: str) -> None:
    with Producer(redis_url) as p:
        p.create_topic("gc_freeze", queues=2)
        p.send_orderly_batch("gc_freeze", [(f"k{i}", b"x") for i in range(40)])
    assert spark.read.format("mqorder").option("topic", "gc_freeze").load().count() == 40

    # The workers are reused (spark.python.worker.reuse): the next job's Python UDFs run in the
    # ones that read (the SQL workers' pool; an RDD's lambdas have a pool of their own), and report
    # their permanent generation.
    from pyspark.sql.functions import udf

    frozen = udf(lambda _: __import__("gc").get_freeze_count(), "long")
    counts = [r[0] for r in spark.range(0, 8, 1, 8).select(frozen("id")).collect()]  # a task per row
    assert max(counts) > 1000, counts

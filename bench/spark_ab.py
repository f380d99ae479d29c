"""Same-run A/B of the Spark readers: today's code against the code of a baseline commit.

The baseline is a copy of the ``mqorder`` package at ``BASELINE`` (``git archive``: no worktree, no
branch), put in a temporary directory. Each measurement runs in a child process of its own
(``python -m bench.spark_ab child ...``) with its own Spark session on the same master, against
the same ``redis-server`` and the same stored data; the baseline's child runs with that copy first
on its path and as its working directory, so its driver *and* its Spark Python workers import the
old package (the child checks this on an executor and says which file it imported). Children run
in alternating pairs (baseline, then current), so both halves of a pair see about the same load on
a shared machine; ratios are taken per pair. Session start is not timed: each child warms up (the
Python workers started, the modules imported) before its timed runs.

What a child measures (``--what``):

* ``read``: ``spark.read.format("mqorder").option("topic", T).load().count()``;
* ``audit``: ``mqorder.spark.audit(spark, T, G)`` (the ledger and, if the audit needs them, the
  stored messages), its report's verdict checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The code the A/B compares against: main before issue 29's faster readers (Arrow pages, the
#: audit's index reads).
BASELINE = "bb2ad9b8a951344a61e23070d50d54f85b6efad6"


@contextlib.contextmanager
def baseline_tree(commit: str = BASELINE) -> Iterator[Path]:
    """A temporary directory holding ``mqorder/`` as it was at ``commit``."""
    try:
        raw = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "mqorder"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        raise SystemExit(f"the A/B needs the baseline commit {commit[:12]} of this git repository "
                         f"(git archive failed: {err.decode(errors='replace').strip() or exc}); "
                         "run it from a clone with full history") from None
    with tempfile.TemporaryDirectory(prefix="mqorder-baseline-") as tmp:
        with tarfile.open(fileobj=BytesIO(raw)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def run_child(what: str, tree: Path | None, url: str, topic: str, master: str, reps: int,
              group: str = "", expect: int = 0, queues: int = 1) -> dict[str, Any]:
    """One child: ``tree`` (a baseline copy) or None (this checkout). Returns its figures."""
    cwd = tree or ROOT
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in ([tree] if tree else []) + [ROOT])
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    cmd = [sys.executable, "-m", "bench.spark_ab", "child", "--what", what, "--url", url, "--topic", topic,
           "--master", master, "--reps", str(reps), "--group", group, "--expect", str(expect), "--queues", str(queues)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"A/B child ({'baseline' if tree else 'current'} {what}) failed:\n{proc.stderr[-4000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    want = str(tree) if tree else str(ROOT)
    for f in (out["driver_mqorder"], out["executor_mqorder"]):
        if not f.startswith(want):
            raise RuntimeError(f"A/B child imported {f}, not the package under {want}")
    return out


def ab_pairs(what: str, url: str, topic: str, master: str, runs: int, reps: int = 1, group: str = "",
             expect: int = 0, queues: int = 1, log: Any = None) -> dict[str, Any]:
    """``runs`` pairs (baseline child, then current child); per pair the best of ``reps`` timed runs
    of each. Returns {"baseline": [...], "current": [...], "ratios": [...]}, seconds per child."""
    res: dict[str, Any] = {"baseline_commit": BASELINE, "baseline": [], "current": [], "ratios": []}
    with baseline_tree() as tree:
        for i in range(runs):
            old = run_child(what, tree, url, topic, master, reps, group, expect, queues)
            new = run_child(what, None, url, topic, master, reps, group, expect, queues)
            res["baseline"].append(old)
            res["current"].append(new)
            res["ratios"].append(min(old["seconds"]) / min(new["seconds"]))
            res.setdefault("cpu_ratios", []).append(min(old["cpu_seconds"]) / min(new["cpu_seconds"]))
            if log is not None:
                log(f"{what} A/B pair {i}: baseline {min(old['seconds']):.2f} s, current {min(new['seconds']):.2f} s "
                    f"({res['ratios'][-1]:.2f}x; CPU {res['cpu_ratios'][-1]:.2f}x)")
    return res


# -- the child ----------------------------------------------------------------------------------------


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every process under it (the JVM, the Python
    workers): what a measurement cost, less sensitive than its wall time to a shared machine's load."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import mqorder
    from mqorder.spark import session

    spark = session("mqorder-bench-ab", args.master, **{
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.driver.memory": "2g",
        "spark.sql.shuffle.partitions": "8"})
    spark.sparkContext.setLogLevel("ERROR")
    executor_file = spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("mqorder").__file__).collect()[0]
    out: dict[str, Any] = {"what": args.what, "driver_mqorder": mqorder.__file__, "executor_mqorder": executor_file,
                           "seconds": []}
    if args.what == "read":
        def reader(**opts: str) -> Any:
            return spark.read.format("mqorder").option("topic", args.topic).option("redisUrl", args.url).options(**opts)

        # Warm-up: the first 100 offsets of every queue (every Python worker started, modules imported).
        reader(endingOffsets=json.dumps({str(q): 100 for q in range(args.queues)})).load().count()
        for _ in range(args.reps):
            c0, t0 = _tree_cpu(), time.perf_counter()
            n = reader().load().count()
            out["seconds"].append(time.perf_counter() - t0)
            out.setdefault("cpu_seconds", []).append(_tree_cpu() - c0)
            out["rows"] = n
        if args.expect and out["rows"] != args.expect:
            raise SystemExit(f"read {out['rows']} rows, expected {args.expect}")
    elif args.what == "audit":
        from mqorder.spark import audit

        for _ in range(args.reps + 1):  # the first is the warm-up
            c0, t0 = _tree_cpu(), time.perf_counter()
            rep = audit(spark, args.topic, args.group, redis_url=args.url)
            secs = time.perf_counter() - t0
            out.setdefault("cpu_seconds", []).append(_tree_cpu() - c0)
            if not rep.ok or (args.expect and rep.ledger_records != args.expect):
                raise SystemExit(f"the audit did not pass: ok={rep.ok}, {rep.ledger_records} records")
            out.setdefault("warmup_seconds", secs)
            out["seconds"].append(secs)
            out["rows"] = rep.ledger_records
        out["seconds"], out["cpu_seconds"] = out["seconds"][1:], out["cpu_seconds"][1:]
    else:
        raise SystemExit(f"unknown --what {args.what!r}")
    spark.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_ab", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("child", help="one measurement (run by ab_pairs)")
    c.add_argument("--what", choices=("read", "audit"), required=True)
    c.add_argument("--url", required=True)
    c.add_argument("--topic", required=True)
    c.add_argument("--group", default="")
    c.add_argument("--master", default="local[2]")
    c.add_argument("--reps", type=int, default=1)
    c.add_argument("--expect", type=int, default=0)
    c.add_argument("--queues", type=int, default=1, help="queues of the topic (the read warm-up reads each)")
    args = ap.parse_args(argv)
    res = _child(args)
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

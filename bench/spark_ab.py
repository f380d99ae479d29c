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

The whole interleaved A/B in one command (a ``redis-server`` started, the data built, JSON of the
rounds on stdout): ``python -m bench.spark_ab ab --what read --rounds 6`` (300,000 messages) or
``--what audit --rounds 5`` (a 200,000-record ledger, ``bench.spark_audit.build``); add
``--protocol pairs --reps 6`` for an application per measurement (``ab_pairs``).
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
        _build_native(Path(tmp), "mqorder")
        yield Path(tmp)


#: String literals of ``mqorder/spark`` renamed in the baseline copy, so both register side by side.
_RENAMED = {'"mqorder"': '"mqorder_baseline"', '"_mqorder_registered"': '"_mqorder_baseline_registered"',
            '"mqorder_audit_index"': '"mqorder_baseline_audit_index"',
            '"_mqorder_audit_index_registered"': '"_mqorder_baseline_audit_index_registered"'}


def baseline_package(tree: Path) -> Path:
    """The baseline copy in ``tree`` renamed to the package ``mqorder_baseline`` (imports rewritten,
    its Spark formats named ``mqorder_baseline`` and ``mqorder_baseline_audit_index``), so one
    Spark application can run the baseline's reader and audit next to today's. Returns the
    directory to put on the path."""
    import re
    import shutil

    src, dst = tree / "mqorder", tree / "renamed" / "mqorder_baseline"
    if not dst.exists():
        shutil.copytree(src, dst)
        imports = re.compile(r"(?m)^(\s*)(from|import) mqorder(?=[\s.])")
        for f in dst.rglob("*.py"):
            text = imports.sub(r"\1\2 mqorder_baseline", f.read_text())
            if f.parent.name == "spark":
                for old, new in _RENAMED.items():
                    text = text.replace(old, new)
            f.write_text(text)
        _build_native(dst.parent, "mqorder_baseline")
    return dst.parent


def _build_native(root: Path, package: str) -> None:
    """Compile ``root/<package>/spark/_resp.c`` where the baseline has one, as ``make install``
    compiles today's: a baseline left on its numpy fallbacks would make today's code look faster
    than it is (both the plain copy the pairs protocol runs and the renamed one of the interleaved
    protocol). Where no compiler works the baseline keeps those fallbacks, and the A/B says so on
    stderr."""
    src = root / package / "spark" / "_resp.c"
    if not src.exists():
        return
    build = ("from setuptools import Extension, setup; "
             f"setup(ext_modules=[Extension('{package}.spark._resp', [{str(src.relative_to(root))!r}])], "
             "script_args=['build_ext', '--inplace', '--quiet'])")
    done = subprocess.run([sys.executable, "-c", build], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
    if done.returncode:
        sys.stderr.write(f"[bench spark_ab] the baseline's _resp.c did not compile; it runs on its numpy paths:\n"
                         f"{done.stdout[-2000:]}\n")


def interleaved(what: str, url: str, topic: str, master: str, rounds: int, group: str = "", expect: int = 0,
                queues: int = 1, log: Any = None, baseline: str = BASELINE) -> dict[str, Any]:
    """The A/B inside one Spark application: the baseline (``baseline_package``) and today's code
    alternate ``rounds`` times on the same JVM and Python workers, after a warm-up of each; on a
    shared machine this is the fairer of the two A/Bs (no application start between the halves).
    Ratios are per round: baseline seconds / current seconds."""
    with baseline_tree(baseline) as tree:
        path = baseline_package(tree)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(path)])
        env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        cmd = [sys.executable, "-m", "bench.spark_ab", "interleaved", "--what", what, "--url", url, "--topic", topic,
               "--master", master, "--reps", str(rounds), "--group", group, "--expect", str(expect),
               "--queues", str(queues)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"interleaved A/B ({what}) failed:\n{proc.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    res["baseline_commit"] = baseline
    res["ratios"] = [b / c for b, c in zip(res["baseline_seconds"], res["current_seconds"], strict=True)]
    if log is not None:
        log(f"{what} interleaved A/B: baseline {res['baseline_seconds']}, current {res['current_seconds']}")
    return res


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
             expect: int = 0, queues: int = 1, log: Any = None, baseline: str = BASELINE) -> dict[str, Any]:
    """``runs`` pairs (baseline child, then current child); per pair the best of ``reps`` timed runs
    of each. Returns {"baseline": [...], "current": [...], "ratios": [...]}, seconds per child."""
    res: dict[str, Any] = {"baseline_commit": baseline, "baseline": [], "current": [], "ratios": []}
    with baseline_tree(baseline) as tree:
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


def bench_session(app: str, master: str) -> Any:
    """The Spark session of a measurement: no UI or progress bar, 2 GB for the driver, 8 shuffle
    partitions, only errors logged (the same for every child and for ``bench.spark_floor``)."""
    from mqorder.spark import session

    spark = session(app, master, **{
        "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.driver.memory": "2g",
        "spark.sql.shuffle.partitions": "8"})
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import mqorder

    spark = bench_session("mqorder-bench-ab", args.master)
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


def _interleaved(args: argparse.Namespace) -> dict[str, Any]:
    import mqorder_baseline  # type: ignore[import-not-found]
    import mqorder_baseline.spark as old  # type: ignore[import-not-found]

    import mqorder
    import mqorder.spark as new

    spark = bench_session("mqorder-bench-ab", args.master)
    old.register(spark)
    files = spark.sparkContext.parallelize([0], 1).map(
        lambda _: (__import__("mqorder").__file__, __import__("mqorder_baseline").__file__)).collect()[0]
    if "renamed" not in files[1] or "renamed" in files[0]:
        raise SystemExit(f"executors imported {files}")
    out: dict[str, Any] = {"what": args.what, "driver": [mqorder.__file__, mqorder_baseline.__file__],
                           "baseline_seconds": [], "current_seconds": [], "baseline_cpu": [], "current_cpu": []}

    def once(side: str) -> float:
        if args.what == "read":
            fmt = "mqorder_baseline" if side == "baseline" else "mqorder"
            n = spark.read.format(fmt).option("topic", args.topic).option("redisUrl", args.url).load().count()
        else:
            rep = (old if side == "baseline" else new).audit(spark, args.topic, args.group, redis_url=args.url)
            if not rep.ok:
                raise SystemExit(f"the {side} audit did not pass")
            n = rep.ledger_records
        if args.expect and n != args.expect:
            raise SystemExit(f"{side} {args.what}: {n} rows, expected {args.expect}")
        return n

    for side in ("baseline", "current"):  # warm-up: workers started, modules imported, the JIT at work
        once(side)
    for _ in range(args.reps):
        for side in ("baseline", "current"):
            c0, t0 = _tree_cpu(), time.perf_counter()
            out["rows"] = once(side)
            out[f"{side}_seconds"].append(time.perf_counter() - t0)
            out[f"{side}_cpu"].append(_tree_cpu() - c0)
    spark.stop()
    return out


#: The read A/B's topic (``ab``): ``--messages`` bodies of ``BODY`` bytes over 16 queues.
READ_TOPIC, READ_QUEUES, BODY, READ_KEYS = "spark_ab_read", 16, 100, 2000


def build_read(url: str, messages: int) -> None:
    """The read A/B's topic: ``messages`` of ``BODY`` bytes over ``READ_KEYS`` keys (bench.spark's shape)."""
    from mqorder import Producer

    p = Producer(url)
    try:
        p.create_topic(READ_TOPIC, queues=READ_QUEUES)
        for c in range(0, messages, 10_000):
            p.send_orderly_batch(READ_TOPIC, [
                (f"key-{i % READ_KEYS}", (b'{"k":%d,"s":%d}' % (i % READ_KEYS, i)).ljust(BODY, b" "))
                for i in range(c, min(messages, c + 10_000))])
    finally:
        p.close()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[len(s) // 2] + s[(len(s) - 1) // 2]) / 2


def run_ab(what: str, size: int, rounds: int, master: str, protocol: str = "interleaved", reps: int = 6,
           baseline: str = BASELINE) -> dict[str, Any]:
    """The whole A/B on a fresh ``redis-server``: the data built (``build_read``, or
    ``bench.spark_audit.build`` for the audit), then ``interleaved`` or ``ab_pairs`` (``protocol``:
    an application per measurement, each the best of ``reps``; the one protocol that measures a
    change to the Python workers' process state, e.g. ``mqorder.spark.worker_gc``, which the
    baseline's tasks would share in one application); load averages before and after."""
    from mqorder.testing.embedded import RedisServer

    def log(msg: str) -> None:
        sys.stderr.write(f"[bench spark_ab {time.strftime('%H:%M:%S')}] {msg}\n")

    with RedisServer() as srv:
        if what == "read":
            build_read(srv.url, size)
            topic, group = READ_TOPIC, ""
        else:
            from bench import spark_audit

            spark_audit.build(srv.url, size)
            topic, group = spark_audit.TOPIC, spark_audit.GROUP
        load0 = os.getloadavg()[0]
        log(f"{what}: {size:,} built, load {load0:.1f}; {rounds} rounds")
        if protocol == "pairs":
            res = ab_pairs(what, srv.url, topic, master, rounds, reps=reps, group=group, expect=size,
                           queues=READ_QUEUES, log=log, baseline=baseline)
            res["baseline_seconds"] = [min(c["seconds"]) for c in res.pop("baseline")]
            res["current_seconds"] = [min(c["seconds"]) for c in res.pop("current")]
        else:
            res = interleaved(what, srv.url, topic, master, rounds, group=group, expect=size, queues=READ_QUEUES,
                              log=log, baseline=baseline)
    res["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    res.update(size=size, master=master, protocol=protocol, median_ratio=_median(res["ratios"]),
               median_baseline_s=_median(res["baseline_seconds"]), median_current_s=_median(res["current_seconds"]))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spark_ab", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ab", help="the whole A/B: redis-server started, data built, both codes interleaved")
    a.add_argument("--what", choices=("read", "audit"), default="read")
    a.add_argument("--size", type=int, default=0, help="messages (read: 300,000) or ledger records (audit: 200,000)")
    a.add_argument("--rounds", type=int, default=6)
    a.add_argument("--master", default="local[2]")
    a.add_argument("--protocol", choices=("interleaved", "pairs"), default="interleaved",
                   help="interleaved: both codes in one application; pairs: an application per measurement")
    a.add_argument("--reps", type=int, default=6, help="pairs: timed runs per application (its best is taken)")
    a.add_argument("--baseline", default=BASELINE,
                   help=f"the commit to compare against (default {BASELINE[:7]}, issue 29's baseline)")
    for name, what in (("child", "one measurement (run by ab_pairs)"),
                       ("interleaved", "baseline and current alternating in one application (run by interleaved)")):
        c = sub.add_parser(name, help=what)
        c.add_argument("--what", choices=("read", "audit"), required=True)
        c.add_argument("--url", required=True)
        c.add_argument("--topic", required=True)
        c.add_argument("--group", default="")
        c.add_argument("--master", default="local[2]")
        c.add_argument("--reps", type=int, default=1)
        c.add_argument("--expect", type=int, default=0)
        c.add_argument("--queues", type=int, default=1, help="queues of the topic (the read warm-up reads each)")
    args = ap.parse_args(argv)
    if args.cmd == "ab" and (args.rounds < 1 or args.reps < 1):
        ap.error(f"--rounds {args.rounds} and --reps {args.reps}: give at least 1 of each")
    if args.cmd == "ab":
        res = run_ab(args.what, args.size or (300_000 if args.what == "read" else 200_000), args.rounds, args.master,
                     args.protocol, args.reps, args.baseline)
    else:
        res = _child(args) if args.cmd == "child" else _interleaved(args)
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

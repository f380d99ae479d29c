"""``python -m chaos`` (``make chaos``): run the chaos scenarios and write docs/RELIABILITY.md.

    python -m chaos                      # every scenario (about 25 minutes)
    python -m chaos --scenario kill      # one (repeatable, or comma-separated)
    python -m chaos sentinel-failover    # the same, as positional names
    python -m chaos cluster-kill cluster-failover cluster-reshard   # the Redis Cluster rows
    python -m chaos --quick              # shorter timelines, fewer faults
    python -m chaos --list
"""

from __future__ import annotations

import argparse
import sys
import time

from chaos import report
from chaos.checker import Result
from chaos.runner import log
from chaos.scenarios import SCENARIOS, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="NAME", help="scenarios to run (as --scenario)")
    ap.add_argument("--scenario", action="append", default=[], metavar="NAME",
                    help=f"run only these ({', '.join(SCENARIOS)}); repeatable or comma-separated")
    ap.add_argument("--quick", action="store_true", help="shorter timelines and fewer faults")
    ap.add_argument("--keep-logs", action="store_true", help="keep worker/beat/redis logs (printed path)")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/RELIABILITY.md")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = ap.parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:22} {s.title}")
        return 0
    names = [n.strip() for arg in [*args.names, *args.scenario] for n in arg.split(",") if n.strip()] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    t0 = time.monotonic()
    engine = report.engine_version()
    results = {}
    failed = []
    for n in names:
        sc = SCENARIOS[n]
        start = time.monotonic()
        try:
            res = run(sc, quick=args.quick, keep_logs=args.keep_logs)
        except Exception as exc:  # noqa: BLE001 - one broken scenario must not hide the others
            log(f"== {n}: scenario could not run: {exc!r}")
            res = Result(n, sc.fsync, problems=[f"the scenario could not run: {exc!r}"[:400]])
        seconds = time.monotonic() - start
        rows = {n: report.compact(res, title=report.group_title(sc.title, res), env=sc.env, quick=args.quick,
                                  seconds=seconds, engine=engine,
                                  sentinel=sc.sentinel.describe() if sc.sentinel is not None else None,
                                  cluster=sc.cluster.describe() if sc.cluster is not None else None)}
        # A run with several groups: a row per other group (``<scenario>/<group>``), under the scenario's.
        for g, gres in res.groups.items():
            rows[gres.scenario] = report.compact(gres, title=report.group_title(sc.title, gres, g), env=sc.env,
                                                 quick=args.quick, seconds=seconds, engine=engine)
        results.update(rows)
        if not res.passed:
            failed.append(n)
        if not args.no_write:
            report.write(rows)  # after each scenario, so an interrupted run keeps its figures
    if not args.no_write:
        log(f"wrote {report.DOC}")
    log(f"{len(names)} scenario(s) in {time.monotonic() - t0:.0f}s; "
        f"{'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

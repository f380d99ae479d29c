"""A Spark driver process the tests talk to: ``python -m tests.spark_driver --master URL`` (a classic
driver, e.g. on a standalone cluster) or ``--remote sc://...`` (a Spark Connect client).

It opens one session (``mqorder.spark.session``, mqorder registered), prints ``{"ok": ...}`` once
ready, then reads requests ``{"job": NAME, "kwargs": {...}}`` on stdin, one JSON line each, runs
``tests.spark_jobs.NAME(spark, **kwargs)`` and answers one JSON line: ``{"ok": result}`` or
``{"error": class, "message": text, "mqorder": [class, message] | null}`` (the mqorder error a
Spark error carried). Spark's and the JVM's output go to stderr; stdout is the answers only. It
stops its session and exits when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master")
    parser.add_argument("--remote")
    parser.add_argument("--conf", action="append", default=[])
    args = parser.parse_args()
    # Answers on a private copy of stdout; fd 1 (inherited by the JVM) goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from mqorder.spark import session
    from mqorder.spark.errors import mqorder_error
    from tests import spark_jobs

    conf = dict(c.split("=", 1) for c in args.conf)
    if args.remote:
        spark = session(remote=args.remote)
    else:
        conf.setdefault("spark.ui.enabled", "false")
        conf.setdefault("spark.sql.session.timeZone", "UTC")
        spark = session(f"mqorder-driver-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", args.master, **conf)
        spark.sparkContext.setLogLevel("ERROR")
    answers.write(json.dumps({"ok": {"pid": os.getpid()}}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            result = getattr(spark_jobs, req["job"])(spark, **req.get("kwargs", {}))
            reply = {"ok": result}
        except Exception as exc:  # noqa: BLE001 -- every failure goes back to the test, as data
            traceback.print_exc()
            ours = mqorder_error(exc)
            reply = {"error": type(exc).__name__, "message": str(exc),
                     "mqorder": [type(ours).__name__, str(ours)] if ours is not None else None}
        answers.write(json.dumps(reply) + "\n")
    spark.stop()


if __name__ == "__main__":
    main()

"""Same-run A/B of ``commit.lua`` before and after it learnt to record a listener's last error
(issue 28: the ``('e', '<offset>|<ms>|<text>')`` pair, kept as the state's ``error`` field).

    python -m bench.commit_error_ab [--calls 20000] [--rounds 8]

Both versions are loaded into one redis-server; the "before" text is today's script with the old
loop put back (the only change), so everything else (preludes, arguments) is identical. Each
round runs, per variant, ``calls`` fenced commits pipelined 500 at a time on a lane this client
holds, in two shapes:

* ``success``: a commit with no reconsume counts, the shape of every commit of a healthy queue;
* ``suspend``: a commit recording one reconsume count, plus, after the change, the error pair.

Measured per block: Redis's CPU time per call (the redis-server process's user + system time, read
from ``/proc``: on a shared machine the time Redis waits for a core is not in it) and Redis's own
time per call (``INFO commandstats`` ``usec_per_call`` of ``evalsha``, reset before each block:
wall time inside Redis, waits included). Blocks interleaved A, B, A, B, ...; medians and minimums
of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from typing import Any

from bench.common import cpu_s, load1, redis_and_client, server_pid
from mqorder import keys
from mqorder.store.scripts import source

OLD_LOOP = "for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end"
NEW_LOOP = """for i = 10, #ARGV, 2 do
  if ARGV[i] == 'e' then
    redis.call('HSET', KEYS[1], 'error', ARGV[i + 1])
  else
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  end
end"""
ERROR = "RuntimeError: card declined for order-7"
TAG = "{t:broker-a:0}"
CHUNK = 500  # commits per pipeline; --calls should be a multiple


def _block(r: Any, pid: int, sha: str, shape: str, with_error: bool, start: int, calls: int) -> tuple[float, float]:
    """``calls`` commits from offset ``start``; Redis CPU µs and Redis-measured µs per call."""
    k = [keys.sub_state(TAG, "g"), keys.queue_next(TAG), keys.sub_retries(TAG, "g")]
    r.config_resetstat()
    cpu0 = cpu_s(pid)
    off = start
    for _ in range(0, calls, CHUNK):
        pipe = r.pipeline(transaction=False)
        for _ in range(CHUNK):
            off += 1
            args: list[Any] = ["c1", 7, "tok", off, 60000, 60000, "0", "", off]
            if shape == "suspend":
                args += [off, 1]
                if with_error:
                    args += ["e", f"{off}|1764000000000|{ERROR}"]
            pipe.evalsha(sha, 3, *k, *args)
        replies = pipe.execute()
        assert all(rep[0] == b"OK" for rep in replies), replies[:1]
    cpu = (cpu_s(pid) - cpu0) * 1e6 / calls
    return cpu, float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def run(calls: int, rounds: int) -> dict[str, Any]:
    new = source("commit")
    assert NEW_LOOP in new, "commit.lua changed since this A/B was written"
    old = new.replace(NEW_LOOP, OLD_LOOP)
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)
        pid = server_pid(srv)
        r.hset(keys.sub_state(TAG, "g"), mapping={"owner": "c1", "epoch": 7, "pending": "tok", "offset": 0,
                                                  "lease": 2**50, "assignee": "c1"})
        r.set(keys.queue_next(TAG), 10**12)
        shas = {"before": r.script_load(old), "after": r.script_load(new)}
        cpu: dict[str, dict[str, list[float]]] = {s: {"before": [], "after": []} for s in ("success", "suspend")}
        usec: dict[str, dict[str, list[float]]] = {s: {"before": [], "after": []} for s in ("success", "suspend")}
        off = 0
        for _ in range(rounds):
            for shape in ("success", "suspend"):
                for variant in ("before", "after"):
                    c, u = _block(r, pid, shas[variant], shape, variant == "after", off, calls)
                    cpu[shape][variant].append(c)
                    usec[shape][variant].append(u)
                    off += calls

    def stats(d: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
        return {s: {v: {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2)} for v, xs in dv.items()}
                for s, dv in d.items()}

    return {"calls": calls, "rounds": rounds, "load1": load1(), "redis_cpu_us_per_call": stats(cpu),
            "redis_usec_per_call": stats(usec), "raw": {"cpu": cpu, "usec": usec}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(json.dumps(run(args.calls, args.rounds), indent=2))


if __name__ == "__main__":
    main()

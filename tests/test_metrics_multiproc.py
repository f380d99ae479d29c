"""The worker endpoint's multiprocess files (``mqorder.metrics.multiproc``): dead processes' live
gauges are reaped whatever became of their pids, and scrapes running at once do not fail.

Each case runs in a process of its own: ``WorkerMetrics`` switches prometheus-client to its
multiprocess files for the whole process, which the suite's other metrics tests must not see."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT

_SETUP = """
import glob, json, os, shutil, sys, threading
from mqorder.settings import load_settings
from mqorder.metrics.worker import WorkerMetrics, _WorkerCollector

m = WorkerMetrics(load_settings(redis_url=sys.argv[1]))
m.linger.mark(True)  # a lingering slot: this process's live-gauge file holds 1
(mine,) = glob.glob(os.path.join(m.path, f"gauge_livesum_{os.getpid()}.db"))
lingering = os.path.join(m.path, "lingering.db.copy")
shutil.copy(mine, lingering)
m.linger.mark(False)

def plant(pid):
    shutil.copy(lingering, os.path.join(m.path, f"gauge_livesum_{pid}.db"))

def lingering_slots():
    return sum(s.value for fam in _WorkerCollector(m).collect() for s in fam.samples
               if s.name == "mqorder_lingering_slots")
"""


def _run(redis_url: str, body: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SETUP + body, redis_url], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_dead_childs_live_gauges_are_reaped_though_its_pid_now_runs_something_else(redis_url: str) -> None:
    """pid 1 runs, but is not this worker's: a live gauge filed under it is a dead child's whose pid
    went to another process (``pid_max`` is 32,768 in many containers). Once it was summed into
    every scrape while that process lived."""
    res = _run(redis_url, "plant(1)\nprint(json.dumps({'before': 1, 'slots': lingering_slots()}))")
    assert res["slots"] == 0


def test_a_new_process_does_not_carry_on_a_dead_ones_live_gauges_under_its_reused_pid(redis_url: str) -> None:
    """A pool child forked with the pid of a child that died before any scrape reaped it would
    reopen that child's live-gauge file and go on from its values. The pids the next fork may get
    are planted with a lingering slot; the child must find none under its own."""
    res = _run(redis_url, """
nxt = int(open("/proc/sys/kernel/ns_last_pid").read())
for pid in range(nxt + 1, nxt + 200):
    plant(pid)
r, w = os.pipe()
child = os.fork()
if child == 0:
    own = glob.glob(os.path.join(m.path, f"gauge_livesum_{os.getpid()}.db"))
    os.write(w, json.dumps({"own": len(own)}).encode())
    os._exit(0)
os.waitpid(child, 0)
seen = json.loads(os.read(r, 1000))
print(json.dumps({"planted": nxt < child < nxt + 200, "own": seen["own"]}))
""")
    assert res["planted"], "the fork got a pid outside the planted range: nothing was tested"
    assert res["own"] == 0


def test_scrapes_at_once_reaping_the_same_dead_children_all_succeed(redis_url: str) -> None:
    """Two Prometheus servers scraping one worker: both reaped the same dead children and the one
    that lost the race failed whole (``FileNotFoundError``: an HTTP 500)."""
    res = _run(redis_url, """
dead = [p for p in range(30000, 32700) if not os.path.exists(f"/proc/{p}")][:300]
errors = []
def scrape():
    try:
        lingering_slots()
    except Exception as exc:
        errors.append(repr(exc))
for _ in range(15):
    for pid in dead:
        plant(pid)
    threads = [threading.Thread(target=scrape) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(json.dumps({"errors": errors[:3], "failed": len(errors), "slots": lingering_slots()}))
""")
    assert res["failed"] == 0, res["errors"]
    assert res["slots"] == 0

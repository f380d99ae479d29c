"""prometheus-client's multiprocess mode, done the way a prefork Celery worker needs it.

Listener calls run in pool *children*, the scrape is answered by the worker's *main* process, and
children come and go (a crash, ``max_tasks_per_child``). prometheus-client's answer is a directory
of per-process memory-mapped files (``PROMETHEUS_MULTIPROC_DIR``) that a ``MultiProcessCollector``
sums at scrape time. Its rules, and how each is kept here:

* the directory must be set before any metric exists and before the children fork, and be empty
  at start: ``prepare()`` makes a fresh private one, from the worker bootstep's constructor, which
  Celery calls before it creates the pool; it is removed when the main process exits;
* prometheus-client picks its value class when it is imported: if the application imported it
  before the directory was set, ``prepare()`` picks the class again, so the metrics created after
  it write to the shared files;
* a child that exited must be ``mark_process_dead``: otherwise its ``live*`` gauges (the lingering
  slots) stay in the sum forever. Nothing tells the main process reliably when a child died (a
  ``kill -9`` runs no hook in the child), so ``reap_dead()`` runs before every scrape and removes
  the live-gauge files of every pid that is no longer this process or a running child of it. A
  reused pid is no cover: a new process first removes any live-gauge file under its own pid (a
  fork hook). Counters and histograms of dead children are kept, as they must be: they are totals;
* a process creates its file and sizes it a moment later (``MmapedDict.__init__``): a scrape that
  reads it at 0 bytes fails whole (``struct.error``, prometheus/client_python#1199: an HTTP 500,
  seen once in CI right after a pool child's first refused commit), and a child killed in that
  moment leaves the empty file for good. ``metric_files()`` leaves out files too short to hold the
  header: nothing is recorded in them yet.
"""

from __future__ import annotations

import atexit
import functools
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "PROMETHEUS_MULTIPROC_DIR"
#: ``gauge_<mode>_<pid>.db``, the files of one process's gauges.
_GAUGE_FILE = re.compile(r"gauge_(live\w+?)_(\d+)\.db$")


def prepare() -> str:
    """Create this worker's private metrics directory and switch prometheus-client to it.

    Must run in the worker's main process before the pool forks and before any metric exists.
    A directory inherited through ``PROMETHEUS_MULTIPROC_DIR`` is not reused: it may hold another
    worker's files (which would be summed into this one's) or a previous run's.
    """
    inherited = os.environ.get(ENV)
    path = tempfile.mkdtemp(prefix="mqorder-metrics-")
    if inherited:
        log.info("mqorder: ignoring PROMETHEUS_MULTIPROC_DIR=%s; this worker's metrics live in %s", inherited, path)
    os.environ[ENV] = path
    from prometheus_client import values

    if not getattr(values.ValueClass, "_multiprocess", False):
        # Imported earlier (by the application, say) and set up for a single process.
        values.ValueClass = values.get_value_class()
    atexit.register(_remove, path, os.getpid())
    os.register_at_fork(after_in_child=functools.partial(_forget_own_live_gauges, path))
    return path


#: The header of a metrics file: 4 bytes of used length, 4 of padding.
_HEADER = 8


def metric_files(path: str) -> list[str]:
    """The ``.db`` files of ``path`` a scrape can read: those a process has sized (see above)."""
    files = []
    for f in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.path.getsize(f) >= _HEADER:
                files.append(f)
        except FileNotFoundError:
            continue  # a live gauge's file, marked dead since the glob
    return files


def _remove(path: str, owner_pid: int) -> None:
    # Forked children inherit atexit handlers; only the process that made the directory removes it.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` is this process or one of its children that has not exited (a zombie has).

    Any process by that number would not do: pids are reused (``pid_max`` is 32,768 in many
    containers), and a dead pool child whose pid went to an unrelated process kept its lingering
    slots and suspended keys in every scrape for as long as that process lived."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours: our children run as we do
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return True  # no procfs: trust kill(0)
    return fields[0] != "Z" and int(fields[1]) == os.getpid()


def _forget_own_live_gauges(path: str) -> None:
    """In a newly forked process: live-gauge files under its pid are a dead process's (the pid was
    reused before a scrape reaped them), whose values it would otherwise carry on from."""
    for f in glob.glob(os.path.join(path, f"gauge_live*_{os.getpid()}.db")):
        Path(f).unlink(missing_ok=True)


#: Scrapes run on threads of their own (two Prometheus servers at once): one reaps at a time.
_reaping = threading.Lock()


def reap_dead(path: str) -> list[int]:
    """Remove the live-gauge files of every pid that is no longer running (prometheus-client's
    ``mark_process_dead``, which raised ``FileNotFoundError`` when two scrapes reaped the same
    child at once: the scrape that lost the race failed whole, an HTTP 500)."""
    dead = set()
    with _reaping:
        for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
            m = _GAUGE_FILE.search(os.path.basename(f))
            if m is not None and not _running(int(m.group(2))):
                dead.add(int(m.group(2)))
                Path(f).unlink(missing_ok=True)
    return sorted(dead)

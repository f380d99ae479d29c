"""Per-queue consume TPS and RT (RocketMQ's ``ConsumerStatsManager``).

Counters are kept in process memory (no Redis call per message) and flushed to a Redis hash at
the end of every ConsumeRequest run, so every process of every worker adds to one view:
``mqorder:stats:<sub>`` with fields ``<queue key>#<counter>`` for the counters ``ok``, ``failed``,
``rt_ms``, ``rt_n`` and ``skipped`` (messages retention trimmed before the group read them) (``stats_field`` / ``parse_stats_field``). ``#`` is in no topic or broker
name, so a field splits back into its queue key and counter whatever the names hold. TPS is the
rate of ``ok``/``failed`` between two reads; the mean RT is ``rt_ms / rt_n``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import redis

from mqorder import keys
from mqorder.store.replies import text

log = logging.getLogger(__name__)

#: Consume counters are pushed to Redis at most this often per process.
STATS_FLUSH_INTERVAL_S = 1.0

#: The counters of one queue, as named in the stats hash.
COUNTERS = ("ok", "failed", "rt_ms", "rt_n", "skipped")


def stats_field(mq_key: str, counter: str) -> str:
    """The stats hash field of ``counter`` for the queue ``mq_key``: ``<queue key>#<counter>``."""
    return f"{mq_key}{keys.STATS_FIELD_SEP}{counter}"


def parse_stats_field(field: str) -> tuple[str, str]:
    """(queue key, counter) of a ``stats_field``; ``ValueError`` for anything else."""
    mq_key, sep, counter = field.partition(keys.STATS_FIELD_SEP)
    if not sep or counter not in COUNTERS:
        raise ValueError(f"not a stats field (<queue key>#<counter>): {field!r}")
    keys.parse_queue_key(mq_key)
    return mq_key, counter


@dataclass
class QueueStats:
    ok: int = 0
    failed: int = 0
    rt_ms: float = 0.0
    rt_n: int = 0
    skipped: int = 0


class ConsumerStatsManager:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], QueueStats] = defaultdict(QueueStats)
        self._flushed_at = 0.0

    def inc_consume_ok(self, sub: str, mq_key: str, n: int) -> None:
        self._pending[(sub, mq_key)].ok += n

    def inc_consume_failed(self, sub: str, mq_key: str, n: int) -> None:
        self._pending[(sub, mq_key)].failed += n

    def inc_consume_skipped(self, sub: str, mq_key: str, n: int) -> None:
        self._pending[(sub, mq_key)].skipped += n

    def inc_consume_rt_total(self, sub: str, mq_key: str, rt_ms_sum: float, calls: int) -> None:
        s = self._pending[(sub, mq_key)]
        s.rt_ms += rt_ms_sum
        s.rt_n += calls

    def add_run(self, sub: str, mq_key: str, ok: int, failed: int, rt_ms_sum: float, calls: int) -> None:
        """The counters of one whole run (a run counts in plain attributes and hands them over
        once, at its end: no lock or dict lookup per message; at a trickle a run is one message,
        so this is one lookup)."""
        if not (ok or failed or calls):
            return
        s = self._pending[(sub, mq_key)]
        s.ok += ok
        s.failed += failed
        if calls:
            s.rt_ms += rt_ms_sum
            s.rt_n += calls

    def flush_due(self, client: redis.Redis) -> None:
        """``flush`` at most once every ``STATS_FLUSH_INTERVAL_S`` per process: a short run must
        not pay a round trip for its counters. A failed flush is logged, never raised: counters
        must not fail a run whose progress is committed."""
        now = time.monotonic()
        if now - self._flushed_at < STATS_FLUSH_INTERVAL_S:
            return
        self._flushed_at = now
        try:
            self.flush(client)
        except Exception:
            log.debug("stats flush failed", exc_info=True)

    def flush(self, client: redis.Redis) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(QueueStats)
        if not pending:
            return
        pipe = client.pipeline(transaction=False)
        for (sub, mq_key), s in pending.items():
            k = keys.stats(sub)
            if s.ok:
                pipe.hincrby(k, stats_field(mq_key, "ok"), s.ok)
            if s.failed:
                pipe.hincrby(k, stats_field(mq_key, "failed"), s.failed)
            if s.skipped:
                pipe.hincrby(k, stats_field(mq_key, "skipped"), s.skipped)
            if s.rt_n:
                pipe.hincrbyfloat(k, stats_field(mq_key, "rt_ms"), round(s.rt_ms, 3))
                pipe.hincrby(k, stats_field(mq_key, "rt_n"), s.rt_n)
        pipe.execute()

    @staticmethod
    def read(client: redis.Redis, sub: str) -> dict[str, dict[str, float]]:
        """Queue key -> counter -> value, summed over every process that flushed.

        Fields that do not parse (written by an older mqorder as ``<queue key>|<counter>``) are
        skipped: stats are a view, and the next runs write them again in this format.
        """
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for f, v in client.hgetall(keys.stats(sub)).items():
            try:
                mq_key, counter = parse_stats_field(text(f))
            except ValueError:
                continue
            out[mq_key][counter] = float(v)
        return dict(out)

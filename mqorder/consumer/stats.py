"""Per-queue consume TPS and RT (RocketMQ's ``ConsumerStatsManager``).

Counters are kept in process memory (no Redis call per message) and flushed to a Redis hash at
the end of every ConsumeRequest run, so every process of every worker adds to one view:
``mqorder:stats:<sub>`` with fields ``<queue key>|ok``, ``|failed``, ``|rt_ms``, ``|rt_n``,
``|rt_max_ms``. TPS is the rate of ``ok``/``failed`` between two reads.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import redis

from mqorder import keys


@dataclass
class QueueStats:
    ok: int = 0
    failed: int = 0
    rt_ms: float = 0.0
    rt_n: int = 0
    rt_max_ms: float = 0.0


class ConsumerStatsManager:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], QueueStats] = defaultdict(QueueStats)

    def inc_consume_ok(self, sub: str, mq_key: str, n: int) -> None:
        self._pending[(sub, mq_key)].ok += n

    def inc_consume_failed(self, sub: str, mq_key: str, n: int) -> None:
        self._pending[(sub, mq_key)].failed += n

    def inc_consume_rt(self, sub: str, mq_key: str, rt_ms: float) -> None:
        s = self._pending[(sub, mq_key)]
        s.rt_ms += rt_ms
        s.rt_n += 1
        if rt_ms > s.rt_max_ms:
            s.rt_max_ms = rt_ms

    def inc_consume_rt_total(self, sub: str, mq_key: str, rt_ms_sum: float, calls: int) -> None:
        s = self._pending[(sub, mq_key)]
        s.rt_ms += rt_ms_sum
        s.rt_n += calls

    def flush(self, client: redis.Redis) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(QueueStats)
        if not pending:
            return
        pipe = client.pipeline(transaction=False)
        for (sub, mq_key), s in pending.items():
            k = keys.stats(sub)
            if s.ok:
                pipe.hincrby(k, f"{mq_key}|ok", s.ok)
            if s.failed:
                pipe.hincrby(k, f"{mq_key}|failed", s.failed)
            if s.rt_n:
                pipe.hincrbyfloat(k, f"{mq_key}|rt_ms", round(s.rt_ms, 3))
                pipe.hincrby(k, f"{mq_key}|rt_n", s.rt_n)
        pipe.execute()

    @staticmethod
    def read(client: redis.Redis, sub: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for f, v in client.hgetall(keys.stats(sub)).items():
            mq_key, _, name = f.decode().rpartition("|")
            out[mq_key][name] = float(v)
        return dict(out)

"""Raw single-process ceiling: one Python process, redis-py + hiredis, no Celery.

The backlog is written by mqorder's own ``Producer.send_orderly_batch`` (same stream layout). The
reader then walks each queue's log (``keys.queue_log``) with ``XRANGE ... COUNT 32`` and, after
each batch, commits the offset with a small fenced Lua script (check owner + epoch in the state
hash, refuse to go backwards, ``HSET offset``): two round trips per 32 messages, no decoding, no
per-message Python beyond what redis-py's XRANGE reply parsing does.

A second variant, ``raw + decode``, also turns every batch into ``MessageExt`` objects with
mqorder's ``decode_entries`` (the same decoder the consume path uses), to show what decoding costs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from bench.common import Config, cpu_s, log, produce_backlog, queues_of, redis_and_client, server_pid
from mqorder import keys
from mqorder.codec import decode_entries

#: The fenced commit: the same check as commit.lua (owner + epoch), without the fused pull.
COMMIT = """
local st = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'offset')
if st[1] ~= ARGV[1] or tonumber(st[2] or 0) ~= tonumber(ARGV[2]) then return -1 end
local new = tonumber(ARGV[3])
if new < tonumber(st[3] or 0) then return -2 end
redis.call('HSET', KEYS[1], 'offset', new)
return new
"""

OWNER, EPOCH = "raw-reader", 1


def read_all(r: Any, commit: Any, topic: str, queues: int, group: str, batch: int, decode: bool) -> int:
    """Consume every queue of ``topic`` to its end; returns the number of messages read."""
    n = 0
    for mq in queues_of(topic, queues):
        log_key, state = keys.queue_log(mq.tag), keys.sub_state(mq.tag, group)
        offset = 0
        while True:
            entries = r.xrange(log_key, min=str(offset), count=batch)
            if not entries:
                break
            if decode:
                decode_entries(mq, entries)
            offset = int(entries[-1][0].split(b"-", 1)[0]) + 1
            if commit(keys=[state], args=[OWNER, EPOCH, offset]) < 0:
                raise RuntimeError(f"raw commit refused on {mq.key}")
            n += len(entries)
    return n


class RawCeiling:
    """A redis-server holding a backlog, and the raw reader; ``measure()`` is one timed run.

    Kept alive across the mqorder drain runs too, so each of those can be paired with a raw run
    taken just before it (same machine conditions): see ``bench.mqorder_drain``.
    """

    def __init__(self, stack: contextlib.ExitStack, *, messages: int, n_keys: int = 2000, queues: int = 16,
                 batch: int = 32) -> None:
        self.srv, self.r = redis_and_client(stack)
        self.topic, self.messages, self.queues, self.batch = "raw", messages, queues, batch
        produce_backlog(self.srv.url, self.topic, queues, messages, n_keys)
        self.commit = self.r.register_script(COMMIT)
        self.redis_pid = server_pid(self.srv)
        self.runs = 0
        # Warm-up (script load, connection, caches): one queue, not measured.
        self._own("warmup")
        read_all(self.r, self.commit, self.topic, 1, "warmup", batch, True)

    def _own(self, group: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        for mq in queues_of(self.topic, self.queues):
            pipe.hset(keys.sub_state(mq.tag, group), mapping={"owner": OWNER, "epoch": EPOCH, "offset": 0})
        pipe.execute()

    def measure(self, decode: bool = False) -> dict[str, float]:
        self.runs += 1
        group = f"raw-{self.runs}"
        self._own(group)
        c0, rc0 = time.process_time(), cpu_s(self.redis_pid)
        t0 = time.perf_counter()
        n = read_all(self.r, self.commit, self.topic, self.queues, group, self.batch, decode)
        secs = time.perf_counter() - t0
        cpu, rcpu = time.process_time() - c0, cpu_s(self.redis_pid) - rc0
        if n != self.messages:
            raise RuntimeError(f"raw reader read {n} messages, expected {self.messages}")
        # Drop the group's state so repeated runs do not accumulate keys.
        pipe = self.r.pipeline(transaction=False)
        for mq in queues_of(self.topic, self.queues):
            pipe.unlink(keys.sub_state(mq.tag, group))
        pipe.execute()
        return {"messages": n, "seconds": secs, "rate": n / secs, "worker_cpu_s": cpu, "redis_cpu_s": rcpu}


def run(cfg: Config, *, messages: int, n_keys: int = 2000, queues: int = 16, batch: int = 32,
        runs: int = 3) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"raw": [], "raw+decode": []}
    with contextlib.ExitStack() as st:
        rc = RawCeiling(st, messages=messages, n_keys=n_keys, queues=queues, batch=batch)
        for i in range(runs):
            for variant in ("raw", "raw+decode"):
                res = rc.measure(decode=variant == "raw+decode")
                out[variant].append(res)
                n, secs = res["messages"], res["seconds"]
                log(f"{variant} run {i}: {n} msgs in {secs:.2f}s = {n / secs:,.0f} msg/s (reader CPU "
                    f"{res['worker_cpu_s'] / n * 1e6:.1f} µs/msg, redis CPU {res['redis_cpu_s'] / n * 1e6:.1f} µs/msg)")
    return out

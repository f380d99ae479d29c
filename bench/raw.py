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

from bench.common import Config, client, log, produce_backlog, queues_of, redis_server
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


def run(cfg: Config, *, messages: int, n_keys: int = 2000, queues: int = 16, batch: int = 32,
        runs: int = 3) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"raw": [], "raw+decode": []}
    with contextlib.ExitStack() as st:
        srv = redis_server(st)
        r = client(srv.url)
        st.callback(r.close)
        topic = "raw"
        produce_backlog(srv.url, topic, queues, messages, n_keys)
        commit = r.register_script(COMMIT)

        def own(group: str) -> None:
            pipe = r.pipeline(transaction=False)
            for mq in queues_of(topic, queues):
                pipe.hset(keys.sub_state(mq.tag, group), mapping={"owner": OWNER, "epoch": EPOCH, "offset": 0})
            pipe.execute()

        # Warm-up (script load, connection, caches): one queue, not measured.
        own("warmup")
        read_all(r, commit, topic, 1, "warmup", batch, True)
        for i in range(runs):
            for variant in ("raw", "raw+decode"):
                group = f"{variant}-{i}"
                own(group)
                t0 = time.perf_counter()
                n = read_all(r, commit, topic, queues, group, batch, variant == "raw+decode")
                secs = time.perf_counter() - t0
                if n != messages:
                    raise RuntimeError(f"raw reader read {n} messages, expected {messages}")
                out[variant].append({"messages": n, "seconds": secs, "rate": n / secs})
                log(f"{variant} run {i}: {n} msgs in {secs:.2f}s = {n / secs:,.0f} msg/s")
    return out

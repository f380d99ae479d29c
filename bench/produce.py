"""Produce rate: ``send_orderly`` one by one, ``send_orderly_batch``, and raw pipelined ``XADD``.

All three write to a 16-queue topic over 2,000 keys that one consumer group subscribes to (so the
send script does its subscription check, as in production; the group has no owner, so nobody is
woken and nothing consumes). The raw variant writes the same kind of entry (a header field ``h``
of the producer's size and the body ``b``) with ``XADD <queue log> * h .. b ..``, pipelined in
chunks of 1,000, to the same 16 log keys of another topic: no Lua, no offset counter, no wake check.
Its headers are encoded and its queues chosen before the clock starts (a pure write ceiling); the
two producer calls do their own validation, id generation, header encoding and queue selection
inside the timed region.
"""

from __future__ import annotations

import contextlib
import time
import zlib

from bench.common import Config, Workload, log, queues_of, redis_and_client
from mqorder import Producer, keys
from mqorder.codec import MsgIdGenerator, encode_header
from mqorder.model import MessageModel


def run(cfg: Config, *, single: int, batch: int, raw: int, batch_call: int = 10_000, pipe_chunk: int = 1000,
        queues: int = 16, n_keys: int = 2000, runs: int = 3) -> dict[str, list[dict[str, float]]]:
    out: dict[str, list[dict[str, float]]] = {"send_orderly": [], "send_orderly_batch": [], "raw_xadd": []}
    with contextlib.ExitStack() as st:
        srv, r = redis_and_client(st)

        def fresh() -> Producer:
            r.flushall()
            p = Producer(srv.url)
            p.create_topic("prod", queues=queues)
            p.topics.subscribe("g-prod", "prod", MessageModel.CLUSTERING)
            p.send_orderly("prod", b"warm", sharding_key="warm")  # route and subscription caches, script load
            return p

        for run in range(runs):
            # send_orderly, one synchronous call per message
            p = fresh()
            wl = Workload(n_keys)
            items = wl.items(single)
            t0 = time.perf_counter()
            for key, body in items:
                p.send_orderly("prod", body, sharding_key=key)
            secs = time.perf_counter() - t0
            out["send_orderly"].append({"messages": single, "seconds": secs, "rate": single / secs})
            p.close()

            # send_orderly_batch, batch_call items per call
            p = fresh()
            wl = Workload(n_keys)
            chunks = [wl.items(min(batch_call, batch - c)) for c in range(0, batch, batch_call)]
            t0 = time.perf_counter()
            for ch in chunks:
                p.send_orderly_batch("prod", ch)
            secs = time.perf_counter() - t0
            out["send_orderly_batch"].append({"messages": batch, "seconds": secs, "rate": batch / secs})
            p.close()

            # raw pipelined XADD of the same entries (header + body) to the same kind of keys
            r.flushall()
            wl = Workload(n_keys)
            ids = MsgIdGenerator()
            logs = [keys.queue_log(mq.tag) for mq in queues_of("rawprod", queues)]
            entries: list[tuple[str, bytes, bytes]] = []
            for key, body in wl.items(raw):
                q = logs[zlib.crc32(key.encode()) % queues]
                entries.append((q, encode_header(ids.next(), key), body))
            t0 = time.perf_counter()
            for c in range(0, raw, pipe_chunk):
                pipe = r.pipeline(transaction=False)
                for q, h, b in entries[c:c + pipe_chunk]:
                    pipe.xadd(q, {"h": h, "b": b})
                pipe.execute()
            secs = time.perf_counter() - t0
            out["raw_xadd"].append({"messages": raw, "seconds": secs, "rate": raw / secs})
            log("produce run {}: send_orderly {:,.0f}/s, send_orderly_batch {:,.0f}/s, raw XADD {:,.0f}/s".format(
                run, out["send_orderly"][-1]["rate"], out["send_orderly_batch"][-1]["rate"],
                out["raw_xadd"][-1]["rate"]))
    return out

"""The listener of the Sentinel end-to-end tests (``MQORDER_LISTENERS=tests.sentinel_listeners``).

Its ledger lives in a Redis of its own (``SENTINEL_TEST_LEDGER_URL``, a plain redis-server the
test starts), not in the store: a kill -9 of the store's primary may lose the last writes of the
replication window, and what the listener handled must survive it to be checked. One JSON record per
message on ``ledger:<group>`` (``tests.sentinel_support.ledger_entries`` reads them), with the
time its send attempt began (``stamped_body``).
"""

from __future__ import annotations

import json
import os
import time

import redis

from mqorder import ConsumeOrderlyStatus, orderly_listener
from tests.sentinel_support import GROUP, TOPIC

_ledger: redis.Redis | None = None


def ledger_client() -> redis.Redis:
    global _ledger
    if _ledger is None or _ledger.connection_pool.pid != os.getpid():
        _ledger = redis.Redis.from_url(os.environ["SENTINEL_TEST_LEDGER_URL"], socket_timeout=5)
    return _ledger


@orderly_listener(topic=TOPIC, group=GROUP)
def record(msgs, ctx):
    start = time.time()
    records = []
    for m in msgs:
        body = json.loads(m.body)
        records.append(json.dumps({
            "key": body["k"], "seq": body["s"], "sent": body.get("t", 0.0), "queue": m.queue_id,
            "offset": m.queue_offset, "epoch": ctx.epoch, "client": ctx.client_id, "pid": os.getpid(),
            "start": start, "reconsume": m.reconsume_times, "ok": True,
        }))
    ledger_client().rpush(f"ledger:{GROUP}", *records)
    return ConsumeOrderlyStatus.SUCCESS

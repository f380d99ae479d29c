"""An ``async def`` key-ordered listener (docs/ASYNC.md): payments of many accounts, in order per
account, thousands in flight on each worker process's event loop.

Run it on the stock workers::

    MQORDER_LISTENERS=mqorder.examples.async_orders celery -A workers.app worker -c 2

and send with ``python -m mqorder.examples.async_orders`` (20,000 payments of 2,000 accounts).
Each payment is JSON ``{"account": id, "seq": n}``; ``applied`` keeps, per account, the last
``seq`` applied in this process, and ``out_of_order`` counts a payment that arrived before its
predecessor (it stays 0: one call at a time per account, in offset order).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from mqorder import ConsumeOrderlyStatus, Producer, orderly_listener

TOPIC = os.environ.get("MQORDER_ASYNC_EXAMPLE_TOPIC", "payments")
GROUP = os.environ.get("MQORDER_ASYNC_EXAMPLE_GROUP", "payments-async")

applied: dict[str, int] = {}
out_of_order = 0


@orderly_listener(topic=TOPIC, group=GROUP, ordering="key", key_concurrency=256)
async def charge(msgs, ctx):
    """One account's next payment(s): awaited I/O (here a 10 ms sleep standing in for an HTTP
    call), then a check that this worker still owns the queue before the irreversible step."""
    global out_of_order
    for m in msgs:
        p = json.loads(m.body)
        await asyncio.sleep(0.01)  # e.g. await client.post(...) with httpx.AsyncClient
        if not await ctx.still_owner_async():
            # The queue moved to another worker (this one paused past its lease): stop here;
            # the new owner gets this payment again, and this run's commit will be refused.
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        last = applied.get(p["account"], 0)
        if p["seq"] > last + 1:
            out_of_order += 1  # a payment before its predecessor: never happens
        applied[p["account"]] = max(p["seq"], last)  # seq <= last: a redelivery after a failover
    return ConsumeOrderlyStatus.SUCCESS


def send(n_accounts: int = 2000, per_account: int = 10, url: str | None = None) -> int:
    """Send ``per_account`` payments of each account (seq 1, 2, ...; accounts interleaved)."""
    p = Producer(url) if url else Producer()
    p.create_topic(TOPIC, queues=16)
    accounts = [f"acct-{i}" for i in range(n_accounts)]
    for seq in range(1, per_account + 1):
        p.send_orderly_batch(TOPIC, [(a, json.dumps({"account": a, "seq": seq}).encode()) for a in accounts])
    p.close()
    return n_accounts * per_account


if __name__ == "__main__":
    print(f"sent {send()} payments to {TOPIC!r}", file=sys.stderr)

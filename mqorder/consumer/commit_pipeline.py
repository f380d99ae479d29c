"""The fenced commit of a pulled batch and what rides behind it, in one round trip.

A run commits once per pulled batch (RocketMQ commits per batch as well, to the broker's offset
store). Behind the fenced commit script (``commit.lua`` or a key-ordered run's ``key_commit.lua``)
go the ledger records of the batch just handled and the read of the next batch, so Redis sees one
round trip per batch. Every command goes by SHA: after a Redis restart or ``SCRIPT FLUSH`` a call
refused with ``NOSCRIPT`` changed nothing, so only what was refused is sent again. A commit that ran
is never sent twice, and records that were written are never written twice.

What rode behind a commit refused with ``NOSCRIPT`` did run, and one of those reads may change
state: a lingering read's ``switch.lua``, known to Redis again (another client loaded it after a
restart) while ``commit.lua`` is not, may have ended the run's hold on its queue (a commit that
moves no offset does not stop it). Its reply must not be dropped: ``kept`` says whether it changed
anything, and then nothing is sent again and the commit is answered ``SUPERSEDED``, as it would
be if sent again (the switch gave the queue's pending slot to the watch); the caller takes the
switch's reply as it takes one behind a refused commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from mqorder.consumer.ledger import LedgerBuffer
from mqorder.store.raw_pipe import ConnectionLease, RawPipeline
from mqorder.store.scripts import Scripts


def commit_pipelined(
    scripts: Scripts, lease: ConnectionLease, script: str, keys_: list[str], args: list[Any],
    ledger: LedgerBuffer | None, queue_reads: Callable[[RawPipeline], None],
    kept: Callable[[list[Any]], bool] | None = None,
) -> tuple[Any, list[Any]]:
    """Run ``script`` with ``keys_``/``args``, the ledger's buffered records, then what
    ``queue_reads`` queues (reads, and maybe a last write such as an idle nudge), in one round
    trip; returns the commit's reply and the replies of what ``queue_reads`` queued.

    ``queue_reads`` is called again if the pipeline is sent again (once, after ``NOSCRIPT``),
    unless ``kept`` says that what it queued the first time changed state (see above)."""
    records = ledger.take() if ledger is not None else []
    for attempt in (0, 1):
        pipe = RawPipeline(lease)
        scripts.queue_in(pipe, script, keys_, args)
        if ledger is not None and records:
            # Before the read: a lingering read may block, the records must not wait for it.
            ledger.queue_in(pipe, scripts, records)
        n = len(pipe)
        queue_reads(pipe)
        replies = pipe.execute(raise_on_error=False)
        refused = [isinstance(r, NoScriptError) for r in replies[:n]]
        for i, r in enumerate(replies):
            if not isinstance(r, ResponseError) or (i < n and refused[i] and not attempt):
                continue
            if i >= n and isinstance(r, NoScriptError):
                continue  # a read's own script (a lingering read's switch.lua): its caller loads it
            raise r
        if ledger is not None and records:
            if not refused[1]:
                records = []  # written: never again
            elif not refused[0]:
                ledger.write(scripts, records, via=lease)  # the commit ran: the records alone
        if refused[0]:
            scripts.load(script)
            if kept is not None and not attempt and kept(replies[n:]):
                if ledger is not None and records:
                    ledger.write(scripts, records, via=lease)  # refused[1]: not written yet
                return [b"SUPERSEDED"], replies[n:]
            if records:
                scripts.load("ledger")
            continue
        return replies[0], replies[n:]
    raise AssertionError("unreachable")  # pragma: no cover

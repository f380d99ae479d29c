"""Checks shared by the Sentinel tests (``test_sentinel_connect``, ``test_sentinel_e2e``): order of
what was handled across a failover, where sends acknowledged without a replica wait may be lost
and lost consumption progress comes back as redelivery."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

#: The topic and group of ``tests/sentinel_listeners.py`` (here, so a test module need not import
#: the listener module: importing it registers the listener in the pytest process too).
TOPIC, GROUP = "t-sentinel", "g-sentinel"


def stamped_body(key: str, seq: int, sent: float) -> bytes:
    """A message body naming its key, sequence number and when this send attempt began (``sent``):
    a body made after the promotion can only have been stored on the promoted replica, whereas a
    (key, seq) resent after the kill may also have been stored, and handled, before it."""
    return json.dumps({"k": key, "s": seq, "t": sent}).encode()


def ledger_entries(client: redis.Redis, group: str) -> list[dict[str, Any]]:
    """The records ``tests/sentinel_listeners.py`` wrote for ``group``, in the order they were written."""
    return [json.loads(raw) for raw in client.lrange(f"ledger:{group}", 0, -1)]


def eventually(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Whether ``pred()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def order_violations(handled: Iterable[Mapping[str, Any]]) -> list[str]:
    """What breaks order in ``handled`` (entries with ``key``, ``seq``, ``queue``, ``offset``, in
    the order they were handled).

    Per queue an offset is the last one plus one, or at most the last one (a redelivery from an
    earlier offset: progress lost in the failover, or a fenced run); never a skip ahead. Per key,
    between two such rewinds, the sequence number never goes back (it may repeat: a send whose
    acknowledgement was lost is sent again). A gap in a key's sequence is not a violation: the
    send was lost in the replication window, it was never there to be handled.
    """
    out: list[str] = []
    by_queue: dict[int, list[Mapping[str, Any]]] = {}
    for h in handled:
        by_queue.setdefault(int(h["queue"]), []).append(h)
    for q, hs in sorted(by_queue.items()):
        last_seq: dict[str, int] = {}
        prev: Mapping[str, Any] | None = None
        for cur in hs:
            if prev is not None:
                if cur["offset"] > prev["offset"] + 1:
                    out.append(f"queue {q}: offset {cur['offset']} handled right after {prev['offset']}")
                if cur["offset"] <= prev["offset"]:
                    last_seq = {}  # a rewind: every key starts over from there
            if cur["seq"] < last_seq.get(cur["key"], 0):
                out.append(f"queue {q}: key {cur['key']} seq {cur['seq']} after {last_seq[cur['key']]} "
                           f"(offset {cur['offset']}) without a rewind")
            last_seq[cur["key"]] = cur["seq"]
            prev = cur
    return out


def longest_pause(times: Iterable[float], since: float) -> float:
    """The longest gap between two consecutive handling times from ``since`` on."""
    ts = sorted(t for t in times if t >= since)
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=0.0)

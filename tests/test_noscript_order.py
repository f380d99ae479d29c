"""A lost script cache must not reorder a queue or run a script twice.

Redis loses its scripts on a restart or a failover to a replica, and every client then gets
``NOSCRIPT`` and loads them again. The calls of one round trip are not atomic together: when
another client's ``SCRIPT LOAD`` lands while Redis is still reading a round trip, the calls before
it are refused with ``NOSCRIPT`` (they ran nothing) and the calls after it run. These tests put
exactly that interleaving on a real redis-server: the cache is flushed and a ``SCRIPT LOAD`` is
inserted in the round trip right after its first call of the script (``load_midway``), as another
client's would arrive.

Once bugs: two chunks of one queue in one round trip (``send_orderly_batch``,
``send_orderly_async``) were stored second first, and ``Scripts.run_pipelined`` sent every call
again, running the ones that had run a second time.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis

from mqorder import Producer
from mqorder.client.selector import queue_index
from mqorder.model import MessageQueue
from mqorder.store.append import queue_rounds
from mqorder.store.log import MessageLog
from mqorder.store.raw_pipe import ConnectionLease
from mqorder.store.scripts import source


def load_midway(monkeypatch: pytest.MonkeyPatch, r: redis.Redis, name: str) -> list[int]:
    """From now on, the first round trip with two or more calls of script ``name`` finds Redis's
    script cache empty and another client's ``SCRIPT LOAD`` of it right behind its first call.
    Returns the list in which that round trip's number of calls of ``name`` is recorded."""
    body = source(name)
    sha = hashlib.sha1(body.encode()).hexdigest()
    original = ConnectionLease.round_trip
    seen: list[int] = []

    def round_trip(self: ConnectionLease, commands: list[tuple[Any, ...]]) -> list[Any]:
        at = [k for k, c in enumerate(commands) if c[0] == "EVALSHA" and c[1] == sha]
        if seen or len(at) < 2:
            return original(self, commands)
        seen.append(len(at))
        r.script_flush()
        k = at[0] + 1
        replies = original(self, [*commands[:k], ("SCRIPT", "LOAD", body), *commands[k:]])
        assert replies[k] in (sha, sha.encode()), replies[k]
        return replies[:k] + replies[k + 1:]

    monkeypatch.setattr(ConnectionLease, "round_trip", round_trip)
    return seen


def two_keys_on_two_queues(queues: int) -> tuple[str, str]:
    """Two sharding keys of two different queues (the default selector)."""
    first = "k0"
    for n in range(1, 1000):
        if queue_index(f"k{n}", queues) != queue_index(first, queues):
            return first, f"k{n}"
    raise AssertionError("no second queue")  # pragma: no cover


def bodies_by_key(p: Producer, topic: str) -> dict[str, list[str]]:
    """Each key's stored bodies (``<key>:<n>``) in offset order."""
    out: dict[str, list[str]] = {}
    for mq in p.describe_topic(topic).message_queues:
        for m in MessageLog(p.brokers).read(mq, 0, 100_000):
            body = m.body.decode()
            out.setdefault(body.split(":")[0], []).append(body)
    return out


def test_rounds_hold_one_call_per_queue_and_the_last_holds_every_queues_last_call() -> None:
    q = {0: "a", 1: "a", 2: "b", 3: "a", 4: "c", 5: "b"}
    rounds = queue_rounds(list(q), q.__getitem__)
    assert rounds == [[0], [1, 2], [3, 4, 5]]
    for rnd in rounds:
        assert len({q[i] for i in rnd}) == len(rnd)
    assert queue_rounds([0, 2, 4], q.__getitem__) == [[0, 2, 4]]  # one call per queue: one round
    assert queue_rounds([], q.__getitem__) == [[]]


def test_a_batch_of_several_chunks_per_queue_keeps_each_keys_order_when_the_script_is_reloaded_midway(
    settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = Producer(settings=settings)
    p.create_topic("t", queues=4)
    a, b = two_keys_on_two_queues(4)
    items = [(key, f"{key}:{n}".encode()) for n in range(2_500) for key in (a, b)]  # 3 chunks per queue
    seen = load_midway(monkeypatch, r, "send")
    results = p.send_orderly_batch("t", items)
    assert seen, "no round trip carried two send.lua calls: the interleaving was not tried"
    assert len(results) == len(items)
    stored = bodies_by_key(p, "t")
    for key in (a, b):
        assert stored[key] == [f"{key}:{n}" for n in range(2_500)], f"{key}'s messages stored out of order"
    p.close()


def test_async_sends_of_several_chunks_per_queue_keep_each_keys_order_when_the_script_is_reloaded_midway(
    settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sends with and without a dedup key go in separate chunks (``send.lua``'s modes), so one
    batch holds several chunks of each key's queue."""
    p = Producer(settings=settings, linger_ms=200)
    p.create_topic("t", queues=4)
    a, b = two_keys_on_two_queues(4)
    seen = load_midway(monkeypatch, r, "send")
    futures = []
    for n in range(20):
        for key in (a, b):
            dedup = f"{key}-{n}" if n % 2 else None
            futures.append(p.send_orderly_async("t", f"{key}:{n}".encode(), sharding_key=key, dedup_key=dedup))
    p.flush()
    results = [f.result(timeout=10) for f in futures]
    assert seen, "no round trip carried two send.lua calls: the interleaving was not tried"
    stored = bodies_by_key(p, "t")
    for key in (a, b):
        assert stored[key] == [f"{key}:{n}" for n in range(20)], f"{key}'s messages stored out of order"
    offsets: dict[MessageQueue, list[int]] = {}
    for res in results:
        offsets.setdefault(res.message_queue, []).append(res.queue_offset)
    assert all(o == sorted(o) for o in offsets.values()), "futures' offsets are not in call order"
    p.close()


def test_run_pipelined_sends_again_only_the_calls_refused_with_noscript(
    settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rebalance's ``assign.lua`` of two queues: the second ran in the first round trip and
    must not run again (it would answer KEPT: the request it asked for would never be sent)."""
    p = Producer(settings=settings)
    p.create_topic("t", queues=2)
    broker = p.brokers.get(p.describe_topic("t").message_queues[0].broker_name)
    from mqorder import keys

    def call(mq: MessageQueue) -> tuple[list[str], list[Any]]:
        return [keys.sub_state(mq.tag, "g"), keys.queue_next(mq.tag)], [60_000, 10_000, 0, "c2", f"tok-{mq.queue_id}"]

    mqs = p.describe_topic("t").message_queues
    for mq in mqs:
        p.send_orderly("t", b"x", sharding_key=next(k for k in (f"k{n}" for n in range(100))
                                                        if queue_index(k, 2) == mq.queue_id))
    calls = [call(mq) for mq in mqs]
    seen = load_midway(monkeypatch, r, "assign")
    replies = broker.scripts.run_pipelined("assign", calls)
    assert seen == [2]
    # Each queue's first assignment (a backlog, nobody consuming it): a request for c2, once each.
    assert [[x.decode() for x in res] for res in replies] == [["DISPATCH"], ["DISPATCH"]]
    p.close()

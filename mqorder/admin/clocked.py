"""Reads judged by the clock of the Redis that answers them: one round trip per broker.

A lease in a state hash (``owner``, ``lease``, ``run``, ``pend_until``) is a deadline by the clock
of the Redis that holds it: the scripts judge it by that Redis's ``TIME``. So does every reader
that says whether a lock is live (``mqorder status``, ``mqorder consumers``, the exporter). On one
Redis, a read pipeline with a ``TIME`` in it gives one clock for every reply. On a Redis Cluster
the queues' state sits on different nodes, each with its own clock, and redis-py's cluster
pipeline refuses ``TIME`` altogether (a keyless command has no node to go to).

``clocked_reads`` groups the items by the node that serves their hash tag and puts one ``TIME``
after each node's reads. ``RawPipeline`` sends a keyless command to the node of the command
before it (``mqorder.store.cluster_route``), so every item is judged by its own node's clock,
and every node's reads still go out in the one round trip (all nodes written before any is read).
On a plain Redis it is the one pipeline it was, with its ``TIME``.

Replies are raw (``RawPipeline`` applies no response callbacks): ``GET`` bytes or ``None``,
``HMGET`` a list, ``XRANGE`` ``[[id, [field, value, ...]], ...]``, ``XLEN`` an int.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mqorder.store.brokers import Broker
from mqorder.store.cluster_route import shard_groups
from mqorder.store.raw_pipe import RawPipeline

T = TypeVar("T")

#: A command as ``execute_command`` takes it: ``("HMGET", key, "owner", "lease")``.
Command = tuple[Any, ...]


@dataclass(frozen=True)
class Clocked(Generic[T]):
    """One item's replies, and the ms by the clock of the node that served them."""

    item: T
    now_ms: int
    replies: list[Any]


def clocked_reads(broker: Broker, items: Sequence[T], tag_of: Callable[[T], str],
                  commands_of: Callable[[T], Sequence[Command]]) -> list[Clocked[T]]:
    """Send ``commands_of(item)`` for every item, and a ``TIME`` per node, in one round trip.

    ``tag_of`` gives an item's hash tag (``MessageQueue.tag``): every command of an item must
    touch keys of that tag only. The result is in ``items``' order.
    """
    if not items:
        return []
    pipe = RawPipeline(broker.client)
    # Per node: the item indices, then one TIME after their commands.
    counts: list[int] = [0] * len(items)
    layout: list[list[int]] = []
    for idxs in shard_groups(broker.client, range(len(items)), lambda i: tag_of(items[i])):
        for i in idxs:
            cmds = commands_of(items[i])
            counts[i] = len(cmds)
            for cmd in cmds:
                pipe.execute_command(*cmd)
        pipe.execute_command("TIME")
        layout.append(idxs)
    replies = pipe.execute()
    out: list[Clocked[T] | None] = [None] * len(items)
    pos = 0
    for idxs in layout:
        start = pos
        pos += sum(counts[i] for i in idxs)
        sec, usec = replies[pos]
        now_ms = int(sec) * 1000 + int(usec) // 1000
        at = start
        for i in idxs:
            out[i] = Clocked(items[i], now_ms, list(replies[at : at + counts[i]]))
            at += counts[i]
        pos += 1
    return [c for c in out if c is not None]

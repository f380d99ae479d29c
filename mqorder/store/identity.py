"""Which mqorder store this is: an id kept in the store itself.

Two processes that must know whether they share a store (a worker taking a beat task, and the beat
that sent it) compare this id, not their URLs: ``redis://redis:6379/0`` inside a container and
``redis://localhost:6379/0`` outside it are one store, two databases of one server are two. The id
is made by the first process that asks (``SET NX``: every process of the store reads the same
one) and lives as long as the store's data: a ``FLUSHALL`` makes the next asker pick a new one.
"""

from __future__ import annotations

import os

import redis

from mqorder import keys
from mqorder.store.replies import text


def store_id(meta: redis.Redis) -> str:
    """The id of the store ``meta`` (its meta broker's client), made on first use."""
    got = meta.get(keys.store_id())
    if got is None:
        meta.set(keys.store_id(), os.urandom(8).hex(), nx=True)
        got = meta.get(keys.store_id())
    return text(got) if got is not None else ""

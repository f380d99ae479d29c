"""Which queue a row goes to, computed in Spark SQL: ``pmod(crc32(cast(key as string)), n)``.

The same number ``Producer.send_orderly`` picks for the same key (``crc32(utf8(key)) mod n``,
``mqorder.client.selector.queue_index``): Spark's ``crc32`` hashes the UTF-8 bytes of the string,
so a key published from Spark and the same key sent by a Python producer land in the same queue,
and their order holds together.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column
from pyspark.sql import functions as F

#: Columns ``publish`` adds start with this; they never enter a JSON body.
INTERNAL_PREFIX = "__mqorder_"
#: The column ``publish`` adds (and the writer reads) so rows are partitioned by queue in Spark.
QUEUE_COLUMN = f"{INTERNAL_PREFIX}queue"
#: The sharding key as text, added by ``publish`` when the key column is not a string.
KEY_COLUMN = f"{INTERNAL_PREFIX}key"


@dataclass(frozen=True)
class QueueRef:
    """One queue of the topic, by its index in the route (what ``crc32(key) mod n`` picks) and where
    it lives: what a write task stages to and a read task reads from."""

    index: int
    broker: str
    queue_id: int


def key_string(key: str | Column) -> Column:
    """The sharding key as the text that is hashed and stored (Spark's cast of any type to string)."""
    col = F.col(key) if isinstance(key, str) else key
    return col.cast("string")


def queue_of(key: str | Column, queue_count: int) -> Column:
    """The queue index of each row: ``pmod(crc32(cast(key as string)), queue_count)``."""
    if queue_count < 1:
        raise ValueError(f"queue_count must be at least 1, got {queue_count}")
    return F.pmod(F.crc32(key_string(key)), F.lit(queue_count)).cast("int")

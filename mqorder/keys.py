"""The whole Redis key schema of mqorder, in one screen.

Every key is built here and nowhere else (arq's ``constants.py`` habit), so the schema can be
audited at a glance and no f-string key is written twice.

Per-queue keys carry the queue's Redis Cluster hash tag ``{topic:broker:qid}``: the log, its
offset counter and every consumer group's state for that queue live in one slot, so each per-queue
Lua script (send, begin, commit, finish, sweep) touches a single slot.

::

    mqorder:topics                                  SET   names of all topics
    mqorder:topic:<topic>                           HASH  route: queues, brokers (JSON), created_ms
    mqorder:topic:<topic>:subs                      SET   subscription ids consuming the topic
    mqorder:groups                                  HASH  group -> JSON {topic: mode}
    mqorder:clients                                 ZSET  client id -> heartbeat deadline (ms, Redis clock)
    mqorder:client:<client>                         HASH  client info (groups JSON, pid, host, started)
    mqorder:assign:<sub>                            HASH  queue key -> assigned client (a read hint)
    mqorder:rebalance:mutex                         STR   serialises concurrent rebalances
    mqorder:rebalance:last                          STR   ms of the last rebalance (stale -> workers run one)
    mqorder:rebalance:seen:<crc>                    STR   one worker reacts to a membership change
    mqorder:wake:<client>                           CHAN  pub/sub: "a queue of yours has new messages"
    mqorder:stats:<sub>                             HASH  per-queue consume counters
    mqorder:{t:b:q}:log                             STREAM message log, entry id "<offset>-1"
    mqorder:{t:b:q}:next                            STR   next offset to assign (= max offset + 1)
    mqorder:{t:b:q}:ids                             HASH  msg id -> offset, for idempotent appends only
    mqorder:{t:b:q}:s:<sub>                         HASH  lock/epoch/offset/pending state of sub on q
    mqorder:{t:b:q}:r:<sub>                         HASH  offset -> reconsume times (retrying head)

A *subscription id* (``sub``) is the consumer group name in clustering mode, and
``<group>%BC%<client>`` in broadcasting mode: each broadcast client then owns a private lane with
its own offsets and an always-granted lock, and the whole engine is reused unchanged.
"""

from __future__ import annotations

import re

PREFIX = "mqorder"

#: RocketMQ's topic charset (``^[%|a-zA-Z0-9_-]+$``), max 127 characters.
#: Use with ``fullmatch``: ``$`` would also accept a trailing newline.
NAME_RE = re.compile(r"[%|a-zA-Z0-9_.-]{1,127}")
#: Client ids are Celery node names (``name@host``); allow what Celery allows, minus whitespace.
CLIENT_RE = re.compile(r"[^\s\x00{}]{1,255}")

BROADCAST_SEP = "%BC%"
DLQ_PREFIX = "%DLQ%"


def topics() -> str:
    return f"{PREFIX}:topics"


def topic_route(topic: str) -> str:
    return f"{PREFIX}:topic:{topic}"


def topic_subs(topic: str) -> str:
    return f"{PREFIX}:topic:{topic}:subs"


def groups() -> str:
    return f"{PREFIX}:groups"


def clients() -> str:
    return f"{PREFIX}:clients"


def client_info(client_id: str) -> str:
    return f"{PREFIX}:client:{client_id}"


def assignment(sub: str) -> str:
    return f"{PREFIX}:assign:{sub}"


def rebalance_mutex() -> str:
    return f"{PREFIX}:rebalance:mutex"


def rebalance_last() -> str:
    """Wall-clock ms of the last completed rebalance (workers rebalance themselves if it is old)."""
    return f"{PREFIX}:rebalance:last"


def rebalance_seen(fingerprint_crc: int) -> str:
    """Set once per membership change so that only one worker reacts to it."""
    return f"{PREFIX}:rebalance:seen:{fingerprint_crc:08x}"


def wake_channel(client_id: str) -> str:
    return f"{PREFIX}:wake:{client_id}"


def stats(sub: str) -> str:
    return f"{PREFIX}:stats:{sub}"


def queue_tag(topic: str, broker: str, queue_id: int) -> str:
    """The Redis Cluster hash tag shared by every key of one message queue."""
    return f"{{{topic}:{broker}:{queue_id}}}"


def queue_log(tag: str) -> str:
    return f"{PREFIX}:{tag}:log"


def queue_next(tag: str) -> str:
    return f"{PREFIX}:{tag}:next"


def queue_ids(tag: str) -> str:
    """Ids of the messages appended idempotently to the queue (``append_entries`` in Lua)."""
    return f"{PREFIX}:{tag}:ids"


def sub_state(tag: str, sub: str) -> str:
    return f"{PREFIX}:{tag}:s:{sub}"


def sub_retries(tag: str, sub: str) -> str:
    return f"{PREFIX}:{tag}:r:{sub}"


def broadcast_sub(group: str, client_id: str) -> str:
    """The private subscription id of one client of a broadcasting group."""
    return f"{group}{BROADCAST_SEP}{client_id}"


def group_of_sub(sub: str) -> str:
    return sub.split(BROADCAST_SEP, 1)[0]


def dlq_topic(group: str) -> str:
    """RocketMQ's dead-letter topic name for a consumer group."""
    return f"{DLQ_PREFIX}{group}"

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
    mqorder:client:<client>                         HASH  client info (subs JSON, pid, host)
    mqorder:assign:<sub>                            HASH  queue key -> assigned client (a read hint)
    mqorder:rebalance:mutex                         STR   serialises concurrent rebalances
    mqorder:rebalance:last                          STR   ms of the last rebalance (stale -> workers run one)
    mqorder:rebalance:seen:<crc>                    STR   one worker reacts to a membership change
    mqorder:topology                                STR   version: bumped by a new topic or subscription
    mqorder:wake:<client>                           CHAN  pub/sub: "a queue of yours has new messages"
    mqorder:wake:{t:b:q}:<client>                   SCHAN the same on a Redis Cluster: a shard channel per queue
    mqorder:nudge:<client>                          STREAM "a request waits for a slot": ends lingering reads
    mqorder:stats:<sub>                             HASH  <queue key>#<counter> -> per-queue consume count
    mqorder:ledger:<group>                          STREAM consumption ledger (opt-in), one per broker
    mqorder:retention:pass                          STR   one worker per interval runs the trim pass
    mqorder:retention:seen                          HASH  sub -> ms it was last seen live (consumed policy)
    mqorder:{t:b:q}:log                             STREAM message log, entry id "<offset>-1"
    mqorder:{t:b:q}:next                            STR   next offset to assign (= max offset + 1)
    mqorder:{t:b:q}:ids                             HASH  msg id -> offset, for idempotent appends only
    mqorder:{t:b:q}:dedup                           HASH  producer dedup key -> offset, within the window
    mqorder:{t:b:q}:dedup:exp                       ZSET  producer dedup key -> end of its window (ms)
    mqorder:{t:b:q}:s:<sub>                         HASH  lock/epoch/offset/pending state of sub on q
    mqorder:{t:b:q}:txn                             ZSET  half message txid -> when to check it back (ms)
    mqorder:{t:b:q}:txn:half                        HASH  "<txid>:h|b|n|t" header, body, checks, prepared ms
    mqorder:{t:b:q}:txn:log                         STREAM how each transaction ended and why (capped)
    mqorder:txn:topics                              SET   topics that ever had half messages (check-back)
    mqorder:{t:b:q}:delay                           ZSET  delayed message member -> due ms
    mqorder:{t:b:q}:delay:msg                       HASH  "<member>:h|b" header, body of delayed messages
    mqorder:{t:b:q}:delay:seq                       STR   sequence of members (send order among equal due times)
    mqorder:{t:b:q}:delay:id:<id>                   STR   due ms of a retry send-back, kept 15 min (its dedup)
    mqorder:delay:queues                            SET   queue keys that ever had delayed messages (the mover)
    mqorder:{t:b:q}:r:<sub>                         HASH  offset -> reconsume times (retrying head)
    mqorder:{t:b:q}:stage:<job>:<run>               LIST  rows one Spark task staged for q until its job commits (TTL)
    mqorder:{t:b:q}:stage:<job>:cursor              HASH  run -> rows of it already published (TTL)
    mqorder:spark:job:<job>                         HASH  report of one Spark write job: counts or refusal (TTL)
    mqorder:spark:job:<job>:runs                    SET   "<queue index>:<run>" staged by the job's tasks (TTL)

A *subscription id* (``sub``) is the consumer group name in clustering mode, and
``<group>%BC%<client>`` in broadcasting mode: each broadcast client then owns a private lane with
its own offsets and an always-granted lock, and the whole engine is reused unchanged.
"""

from __future__ import annotations

import re

PREFIX = "mqorder"

# -- name rules and separators: why each character is reserved is in ``mqorder/names.py`` --------
# Use the patterns with ``fullmatch``: a ``$`` would also accept a trailing newline.

#: Topic and group names: RocketMQ's charset (``^[%|a-zA-Z0-9_-]+$``) plus ``.``, 1 to 127 chars.
NAME_RE = re.compile(r"[%|a-zA-Z0-9_.-]{1,127}")
#: Broker names: the same plus ``@``, which puts a broker in a machine room (``room@name``).
BROKER_RE = re.compile(r"[%|a-zA-Z0-9_.@-]{1,127}")
#: Client ids are Celery node names (``name@host``): anything but whitespace, control characters
#: (C0, DEL and C1: ``\x9b`` is a terminal's CSI as much as ``\x1b[``) and braces, 1 to 255 characters.
CLIENT_RE = re.compile(r"[^\s\x00-\x1f\x7f-\x9f{}]{1,255}")
#: A queue id as written in a queue key: decimal, no sign, no leading zero (one spelling per id).
QUEUE_ID_RE = re.compile(r"0|[1-9][0-9]*")

#: ``topic:broker:qid``: a queue key (assignment field, task argument, hash tag, by_config).
QUEUE_KEY_SEP = ":"
#: ``room@name``: the machine room of a broker (``by_machine_room``); the room is before the first.
MACHINE_ROOM_SEP = "@"
#: ``group%BC%client``: a broadcasting client's private subscription id; cut at the first one.
BROADCAST_SEP = "%BC%"
#: ``<queue key>#<counter>``: a field of the stats hash ``mqorder:stats:<sub>``.
STATS_FIELD_SEP = "#"
#: ``%DLQ%group``: a group's dead-letter topic (RocketMQ's prefix).
DLQ_PREFIX = "%DLQ%"
#: ``%RETRY%group``: where a group's concurrent listeners send failed messages back to, delayed
#: (RocketMQ's retry topic; ``mqorder.consumer.retry``).
RETRY_PREFIX = "%RETRY%"

#: The assignee of a queue that no live client consumes: the rebalance writes it when a lane has no
#: client left, and the lock is then released. Injected into every Lua script as ``NOBODY`` by
#: ``mqorder.store.scripts``, so Python and Lua cannot spell it differently.
NOBODY = "~"


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


def store_id() -> str:
    """The store's own id (``mqorder.store.identity``): processes compare stores by it."""
    return f"{PREFIX}:store:id"


def topology_version() -> str:
    """Bumped when a topic is created or a group subscribes to a topic: workers watch it with their
    heartbeat and rebalance at once, so a first message to a new topic waits no beat."""
    return f"{PREFIX}:topology"


def wake_channel(client_id: str) -> str:
    return f"{PREFIX}:wake:{client_id}"


def wake_prefix(tag: str | None = None) -> str:
    """What the append scripts put before the owner's client id to name its wake-up channel.

    On a plain Redis, ``mqorder:wake:`` (``wake_channel``: one channel per client, classic
    ``PUBLISH``). On a Redis Cluster, ``mqorder:wake:{t:b:q}:`` with the queue's hash tag: the
    channel of one client *for one queue*, a shard channel in the queue's own slot, published
    with ``SPUBLISH`` (``publish_wake`` in ``_append.lua`` picks it by the brace) on the shard that
    holds the queue. A classic ``PUBLISH`` on a cluster is forwarded to every node; a shard
    channel stays on its shard, so a wake-up costs one shard, not all of them.
    """
    return f"{PREFIX}:wake:" if tag is None else f"{PREFIX}:wake:{tag}:"


def shard_wake_channel(tag: str, client_id: str) -> str:
    """The shard channel ``client_id`` subscribes (``SSUBSCRIBE``) to for the queue of ``tag``."""
    return wake_prefix(tag) + client_id


def linger_nudge(client_id: str) -> str:
    """STREAM a client's lingering ConsumeRequests also read (``mqorder.consumer.nudge``): "a request
    of yours waits for a pool slot; give yours back", "this queue just went idle", or a doorbell
    ("a queue your lingering request adopted got a message", ``ring_doorbell`` in
    ``_append.lua``). One per broker."""
    return f"{PREFIX}:nudge:{client_id}"


def stats(sub: str) -> str:
    return f"{PREFIX}:stats:{sub}"


def ledger(group: str) -> str:
    """The consumption ledger of ``group`` on one broker: one entry per handled message (opt-in)."""
    return f"{PREFIX}:ledger:{group}"


def retention_pass() -> str:
    """Held (``SET NX PX``) by the worker running this interval's trim pass: the others skip it.
    Only an economy: trimming is safe with any number of trimmers at once."""
    return f"{PREFIX}:retention:pass"


def lanes_started() -> str:
    """SET of ``<topic>|<sub>``: lanes whose start position ``consume_from_where`` has decided
    (``mqorder.rebalance.start_position``), so a later registration never moves them again."""
    return f"{PREFIX}:lanes_started"


def retention_seen() -> str:
    """HASH subscription id -> when (ms, Redis clock) a live client last consumed it: under the
    ``consumed`` policy a group gone for longer than its topic's ``retention_ms`` stops holding
    data back."""
    return f"{PREFIX}:retention:seen"


def queue_key(topic: str, broker: str, queue_id: int) -> str:
    """``topic:broker:qid``, the one spelling of a queue in stored data (``parse_queue_key`` reads it).

    Unambiguous because neither topic nor broker names may contain ``:``.
    """
    return f"{topic}{QUEUE_KEY_SEP}{broker}{QUEUE_KEY_SEP}{queue_id}"


def parse_queue_key(key: str) -> tuple[str, str, int]:
    """(topic, broker, queue id) of a ``queue_key``; ``ValueError`` for anything else."""
    parts = key.split(QUEUE_KEY_SEP)
    if len(parts) != 3 or not parts[0] or not parts[1] or not QUEUE_ID_RE.fullmatch(parts[2]):
        raise ValueError(f"not a queue key (topic:broker:queue_id): {key!r}")
    return parts[0], parts[1], int(parts[2])


def queue_tag(topic: str, broker: str, queue_id: int) -> str:
    """The Redis Cluster hash tag shared by every key of one message queue: ``{<queue key>}``.

    Names never contain braces, so the tag always ends at the queue key's end.
    """
    return "{" + queue_key(topic, broker, queue_id) + "}"


def queue_log(tag: str) -> str:
    return f"{PREFIX}:{tag}:log"


def queue_next(tag: str) -> str:
    return f"{PREFIX}:{tag}:next"


def queue_gone(tag: str) -> str:
    """Set (for ``GONE_TTL_MS``) by ``mqorder topic delete``: every append to the queue is refused
    (``append_entries`` derives it from ``queue_next``'s name, in the same hash tag) while
    producers may still hold the deleted topic's route, and removed when the topic is created again."""
    return f"{PREFIX}:{tag}:gone"


#: How long a deleted topic's queues refuse appends: well past a producer's route cache (30 s).
GONE_TTL_MS = 10 * 60 * 1000


def queue_ids(tag: str) -> str:
    """Ids of the messages appended idempotently to the queue (``append_entries`` in Lua)."""
    return f"{PREFIX}:{tag}:ids"


def queue_dedup(tag: str) -> str:
    """The producer's dedup window on one queue: dedup key -> offset of the first send
    (``append_entries`` with a window). Unlike ``queue_ids`` it forgets: see ``queue_dedup_expiry``."""
    return f"{PREFIX}:{tag}:dedup"


def queue_dedup_expiry(tag: str) -> str:
    """When each key of ``queue_dedup`` leaves the window (ZSET, ms by Redis's clock): trimmed in the
    same Lua step as every windowed append, and both keys expire a window after the last one."""
    return f"{PREFIX}:{tag}:dedup:exp"


def txn_index(tag: str) -> str:
    """The half messages of one queue awaiting phase two, by when the check-back asks about them."""
    return f"{PREFIX}:{tag}:txn"


def txn_half(tag: str) -> str:
    """The half messages of one queue (header, body, check count, prepared time per txid): never
    in the log, so no consumer sees them until ``txn_end.lua`` commits one."""
    return f"{PREFIX}:{tag}:txn:half"


def txn_log(tag: str) -> str:
    """How each transaction of one queue ended: COMMIT (at which offset) or ROLLBACK, and why."""
    return f"{PREFIX}:{tag}:txn:log"


def delay_schedule(tag: str) -> str:
    """Delayed messages of one queue by due time: stored, but not in the log until the mover
    (``delay_move.lua``) appends them (RocketMQ's ``SCHEDULE_TOPIC_XXXX``)."""
    return f"{PREFIX}:{tag}:delay"


def delay_messages(tag: str) -> str:
    return f"{PREFIX}:{tag}:delay:msg"


def delay_seq(tag: str) -> str:
    return f"{PREFIX}:{tag}:delay:seq"


def delay_dedup(tag: str, send_id: str) -> str:
    """A delayed send made again must not be stored twice: the due time its first call got
    (``delay_schedule.lua``), for a while (``DelayStore.schedule``'s ``dedup_id``)."""
    return f"{PREFIX}:{tag}:delay:id:{send_id}"


def delay_queues() -> str:
    """Queue keys that ever had delayed messages: where the mover looks (never shrinks: bounded by
    the number of queues, and removing one could race a new delayed send)."""
    return f"{PREFIX}:delay:queues"


def txn_topics() -> str:
    """Topics that ever had half messages: where the check-back looks."""
    return f"{PREFIX}:txn:topics"


def sub_state(tag: str, sub: str) -> str:
    """The state HASH of subscription ``sub`` on one queue: its lock, its fencing epoch, its pending
    ConsumeRequest and its committed offset, all in one key so each script decides atomically.

    Every field, who writes it and who reads it (scripts are ``mqorder/store/lua/*.lua``; the shared
    rules ``lock_live``, ``request_pending`` and ``release_lock`` are in ``_lock.lua``). Times are
    ms by Redis's clock (``TIME``); a missing field reads as ``''`` or ``0``.

    ``owner``
        Client id holding the lock, ``''`` when released. The lock is *live* while ``owner`` is set
        and ``lease`` is ahead. Written by ``lock_batch`` (take), ``begin`` (take a free lock of a
        queue assigned to the caller or to nobody yet), ``assign`` (move to the assignee),
        ``finish`` (hand over to the assignee at the end of a run) and ``release_lock``
        (``unlock_batch``; ``assign`` and ``finish`` when the lane goes to ``NOBODY``). Read by
        every script and by ``RebalanceLockManager.lock_entry``.
    ``lease``
        Deadline of the lock. Renewed by ``lock_batch`` (``lock_all``), ``begin``, ``commit`` and
        ``touch``; set by every take or move; 0 on release. Read wherever the lock must be live
        (``lock_batch``, ``begin``, ``assign``, ``finish``, ``sweep``, ``send``).
    ``epoch``
        Fencing epoch: a new one at every grant (``grant_epoch`` in ``_lock.lua``:
        ``max(epoch + 1, now_ms * 1000)``, a clock, so a replica promoted after missing grants
        never repeats one): every change of owner (``lock_batch``, ``begin``, ``assign``,
        ``finish``), the retaking of a lapsed lease even by its own owner, a run lease lapsed
        mid-run before a new request is made pending (``send``, ``sweep``), and an operator's
        offset reset (``reset_offset``, which also releases the lock). Never reset, not even on
        release. ``commit`` and ``touch`` refuse a caller whose epoch is not the current one (a
        paused, replaced holder) or whose lease lapsed; the consumer's lingering read checks it
        too.
    ``assignee``
        The rebalance's choice for the queue: a client id, ``NOBODY`` (no live client consumes
        the lane: the lock is released as soon as no run holds it), or ``''`` (never assigned).
        Written only by ``assign``. Read by ``lock_batch`` and ``begin`` (never take a lock
        assigned to another client), ``commit`` (tells a run it was revoked), ``finish``
        (hand over, release, or dispatch to the assignee) and the lingering read.
    ``run``
        Run lease of the ConsumeRequest running on the queue, 0 when none is. Claimed by
        ``begin``, renewed by ``commit`` and ``touch``; 0 when a run ends (``commit`` when idle,
        ``finish``), when a new request is made pending (``send``, ``sweep``), on a take
        (``lock_batch``, ``assign``) and on release. Read by ``begin`` (no two runs at once),
        ``assign`` (a running owner is not moved), ``unlock_batch`` (a running queue is not
        unlocked unless forced), ``sweep`` (never re-dispatch a running queue) and ``send`` /
        ``sweep`` (a lapsed run, ``run`` > 0 but not ahead, gets a new epoch).
    ``runner``
        Id of the task execution that claimed the run (``begin`` only): the same execution may
        re-enter its live run after a Redis outage, a duplicate delivery of the task gets BUSY.
    ``node``
        The replication id of the primary the queue was last swept on (``master_replid``, passed
        by the sweep's caller): written by ``sweep`` when it differs (the first sweep after a
        failover, or ever). Read by ``sweep`` and copied by ``begin`` into ``run_node``.
    ``run_node``
        ``node`` as it was when the run began (``begin``).
    ``suspect``
        The deadline (``run``) of a live run mark whose ``run_node`` was not this node at the first
        sweep here (``sweep``), and ``suspect_at`` when; ``''`` otherwise. If a sweep 5 s later
        finds the same deadline, the mark was not renewed and is fenced: the promoted replica may
        lack the run's ``finish`` (docs/ARCHITECTURE.md, "A run the promoted replica still thinks
        is running").
    ``pending``
        Token of the queue's one pending ConsumeRequest, ``''`` for none. Set by ``send``
        (waking the owner), ``sweep``, ``assign`` (DISPATCH), ``finish`` (the next request) and
        ``adopt`` (a lingering request of the owner watches the idle queue: ``IdleQueueWatch``;
        the adoption ends through ``finish`` with the same token; an adoption's token starts with
        ``!``, and a ``send`` to such a queue that is not running rings the owner's doorbell:
        ``ring_doorbell`` in ``_append.lua``);
        cleared by ``commit`` and ``finish`` when the queue goes idle, by ``assign`` on a MOVED
        queue with no backlog, and by ``release_lock`` in ``assign`` / ``finish``; *kept* by
        ``unlock_batch`` (the dispatched request stays the queue's one request: see
        ``release_lock`` in ``_lock.lua``). Read by ``begin`` (STALE), ``commit``
        (SUPERSEDED), ``touch``, ``finish`` (STALE), ``send`` and ``sweep`` (no second request
        while one is pending), and the lingering read.
    ``pend_until``
        When the pending request is presumed lost: dispatch time + pending TTL (an adoption:
        2 s, renewed while its request lingers), then the run
        lease while it runs (``begin``, ``commit``, ``touch``); 0 whenever ``pending`` is
        cleared. Read by ``send`` and ``sweep``: after it, they replace the token.
    ``offset``
        Committed consume offset: the next offset to consume. Written by ``commit``, only
        forward and only by the current owner at its epoch, and by ``reset_offset``
        (``mqorder offsets reset``: any value, in the same step as the epoch bump and release that
        fence the running owner). Read by ``begin`` (first pull), ``commit``, ``assign`` /
        ``finish`` / ``sweep`` (backlog means ``next`` > ``offset``), ``MessageLog``
        (``consume_offset``, ``lag``, ``state``) and ``mqorder status``.
    ``done``
        Key-ordered consumption only (``ordering="key"``): the offsets finished *above*
        ``offset`` (which is then the lowest unfinished one), as ``<offset>:r<runs>`` or
        ``<offset>:b<hex>`` (``mqorder.consumer.offset_map``). Written only by ``key_commit``,
        with the offset, fenced like ``commit``; deleted by ``reset_offset``. Read by ``begin``
        (returned to the run, which skips those offsets), and void whenever its base is not the
        current ``offset`` (anything else that moved the offset).
    ``held``
        Key-ordered consumption only: the suspended keys of the last commit, as
        ``<head offset>:<until ms>,...`` (until: the writer's wall clock). Written by
        ``key_commit`` (its ``'u'`` pair), read by ``begin``: the next run keeps each such key
        suspended until then (a run that ends while keys are suspended once let the next run
        retry them at once, and keys reached the DLQ in a fraction of their suspend times).
        Entries below ``offset`` or past their time mean nothing.
    ``commit_ms``
        When ``offset`` last moved: written by ``commit`` in its existing HSET (kept when a commit
        does not move the offset) and by ``reset_offset``. Read only by ``mqorder status``, which
        tells a stuck queue (a backlog waiting since then) from a slow one.
    ``error``
        The last exception a listener of this lane raised, ``<offset>|<ms>|<text>`` (``ms`` by the
        worker's clock, the text cut to 500 characters): written by ``commit`` and ``key_commit``
        with the reconsume counts it goes with, only when a call failed. Never deleted: it is void
        once the offset is below the committed one. Read only by ``mqorder status --key``.
    ``skipped``
        Messages retention trimmed before this subscription consumed them (``time`` policy, or a
        group gone for longer than ``retention_ms``): ``commit`` and ``key_commit`` add them
        (``count_skipped`` in ``_commit.lua``) in the fenced commit that moves past them. Read by
        ``mqorder status``.
    """
    return f"{PREFIX}:{tag}:s:{sub}"


def sub_retries(tag: str, sub: str) -> str:
    return f"{PREFIX}:{tag}:r:{sub}"


def broadcast_sub(group: str, client_id: str) -> str:
    """The private subscription id of one client of a broadcasting group: ``group%BC%client``.

    ``group_of_sub`` cuts it at the first ``%BC%``, which is the separator because a group name
    neither contains ``%BC%`` nor ends with ``%BC`` (``mqorder.names``); the client id may hold
    anything.
    """
    return f"{group}{BROADCAST_SEP}{client_id}"


def group_of_sub(sub: str) -> str:
    """The group of a subscription id: the id itself (clustering) or its part before ``%BC%``."""
    return sub.split(BROADCAST_SEP, 1)[0]


def dlq_topic(group: str) -> str:
    """RocketMQ's dead-letter topic name for a consumer group."""
    return f"{DLQ_PREFIX}{group}"


def retry_topic(group: str) -> str:
    """RocketMQ's retry topic name for a consumer group (concurrent listeners)."""
    return f"{RETRY_PREFIX}{group}"


def stage_run(tag: str, job: str, run: int) -> str:
    """Rows that task ``run`` (a Spark partition) of write job ``job`` staged for one queue.

    In the queue's hash tag, so ``publish_staged.lua`` moves them into the log in one slot; nothing
    reads a run but that script, so a failed job's rows are never visible (they are deleted on
    abort, and expire anyway).
    """
    return f"{PREFIX}:{tag}:stage:{job}:{run}"


def stage_cursor(tag: str, job: str) -> str:
    """How far the commit of job ``job`` got in each run of one queue (``publish_staged.lua``), so
    positions in a run stay absolute while published rows are trimmed from it."""
    return f"{PREFIX}:{tag}:stage:{job}:cursor"


def spark_job(job: str) -> str:
    """The report of one Spark write job (``mqorder.spark``): what its commit stored or refused."""
    return f"{PREFIX}:spark:job:{job}"


def spark_job_runs(job: str) -> str:
    """The runs (``<queue index>:<run>``) a Spark write job's tasks staged: what abort deletes."""
    return f"{PREFIX}:spark:job:{job}:runs"

"""``mqorder status GROUP [TOPIC]``: RocketMQ's ``consumerProgress``, plus what fencing adds.

Per queue of every topic the group subscribes to: the broker, max and committed offsets, lag, the
lock owner with its lease left and fencing epoch, whether a ConsumeRequest is pending or running,
the reconsume count of the head message (the next one to consume), and when the committed offset
last moved (``commit_ms``, written by ``commit.lua`` in the HSET it already does).

A queue is *stuck* when it has a backlog and has been waiting longer than ``stuck_after_ms``
since its offset last moved *or* since its head message was stored, whichever is later: a queue
idle for an hour that just got a message is not stuck, a queue whose head message keeps
suspending is. Reading costs two pipelines per broker (state, then the head messages) and writes
nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mqorder import keys
from mqorder.admin.clocked import clocked_reads
from mqorder.admin.common import Admin
from mqorder.errors import TopicNotFoundError
from mqorder.model import MessageQueue
from mqorder.store.replies import text

#: Default of ``--stuck-after``: a backlog that has not moved for this long is reported stuck.
DEFAULT_STUCK_AFTER_S = 60.0

_STATE_FIELDS = ("owner", "lease", "epoch", "offset", "pending", "pend_until", "run", "assignee", "commit_ms",
                 "skipped")


@dataclass(frozen=True)
class QueueStatus:
    """One queue of one group lane, judged by its broker's clock at ``now_ms``."""

    sub: str
    topic: str
    broker: str
    queue_id: int
    max_offset: int
    committed: int
    owner: str  # holder of a live lock, "" if none
    lease_left_ms: int
    epoch: int
    assignee: str
    pending: bool
    running: bool
    head_reconsume: int | None  # reconsume count of the head message; None when nothing waits
    head_store_ms: int | None
    commit_ms: int | None  # when the committed offset last moved; None if never recorded
    now_ms: int
    stuck: bool
    #: First offset the queue still stores (retention trims below it).
    first_offset: int = 0
    #: Messages retention trimmed before this lane consumed them (counted by its fenced commits).
    skipped: int = 0
    #: A broadcasting lane whose client (worker name) is not live: it waits for that worker to come
    #: back, so its backlog is not "stuck" (``--check`` passes); it lapses under retention.
    client_gone: bool = False

    @property
    def lag(self) -> int:
        """Messages still to consume: what retention already trimmed is not owed any more."""
        return max(0, self.max_offset - max(self.committed, self.first_offset))

    @property
    def waiting_ms(self) -> int | None:
        """How long the backlog has waited without progress (None without a backlog)."""
        return waiting_ms(self.lag, self.commit_ms, self.head_store_ms, self.now_ms)

    @property
    def queue_key(self) -> str:
        return keys.queue_key(self.topic, self.broker, self.queue_id)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["lag"] = self.lag
        out["waiting_ms"] = self.waiting_ms
        out["last_commit_age_ms"] = self.now_ms - self.commit_ms if self.commit_ms else None
        return out


@dataclass
class GroupStatus:
    group: str
    stuck_after_ms: int
    queues: list[QueueStatus] = field(default_factory=list)
    #: Subscribed topics that have no route (subscribed before being created, or deleted).
    missing_topics: list[str] = field(default_factory=list)

    @property
    def stuck(self) -> list[QueueStatus]:
        return [q for q in self.queues if q.stuck]

    @property
    def lag(self) -> int:
        return sum(q.lag for q in self.queues)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group, "stuck_after_ms": self.stuck_after_ms, "lag": self.lag,
            "stuck": len(self.stuck), "missing_topics": self.missing_topics,
            "queues": [q.to_json() for q in self.queues],
        }


def group_status(
    admin: Admin, group: str, topic: str | None = None, stuck_after_s: float = DEFAULT_STUCK_AFTER_S
) -> GroupStatus:
    """The status of every queue ``group`` consumes (of ``topic`` only, if given)."""
    status = GroupStatus(group, int(stuck_after_s * 1000))
    lanes: list[tuple[str, MessageQueue]] = []
    for t, model in sorted(admin.topics_of(group, topic).items()):
        try:
            mqs = admin.route(t).message_queues
        except TopicNotFoundError:
            status.missing_topics.append(t)
            continue
        lanes.extend((sub, mq) for sub in admin.lanes(group, t, model) for mq in mqs)
    by_broker: dict[str, list[tuple[str, MessageQueue]]] = defaultdict(list)
    for lane in lanes:
        by_broker[lane[1].broker_name].append(lane)
    read: dict[tuple[str, MessageQueue], QueueStatus] = {}
    for broker, items in by_broker.items():
        read.update(_read_broker(admin, broker, items, status.stuck_after_ms))
    status.queues = [read[lane] for lane in lanes]
    if any(keys.BROADCAST_SEP in sub for sub, _ in lanes):
        # A broadcasting lane of a worker that stopped (or crashed) stays, holding its offsets and
        # what it has not consumed: a backlog there waits for that worker, not for a stuck queue.
        # It failed `status --check` for good after every scale-down.
        live = {c.client_id for c in admin.consumers_of(group)[0]}
        status.queues = [
            replace(q, client_gone=True, stuck=False)
            if keys.BROADCAST_SEP in q.sub and q.sub.removeprefix(keys.broadcast_sub(group, "")) not in live else q
            for q in status.queues
        ]
    return status


def _read_broker(
    admin: Admin, broker: str, lanes: list[tuple[str, MessageQueue]], stuck_after_ms: int
) -> dict[tuple[str, MessageQueue], QueueStatus]:
    store = admin.brokers.get(broker)
    # Each lane judged by the clock of the Redis holding it (a cluster's nodes each have theirs).
    reads = clocked_reads(store, lanes, lambda lane: lane[1].tag, lambda lane: (
        ("GET", keys.queue_next(lane[1].tag)),
        ("HMGET", keys.sub_state(lane[1].tag, lane[0]), *_STATE_FIELDS),
        ("XRANGE", keys.queue_log(lane[1].tag), "-", "+", "COUNT", 1),
    ))
    states = []
    firsts = []
    for c in reads:
        nxt, raw, first = c.replies
        states.append((int(nxt or 0), dict(zip(_STATE_FIELDS, (text(v) for v in raw), strict=True))))
        firsts.append(int(text(first[0][0]).split("-", 1)[0]) if first else int(nxt or 0))
    # The head message (the next to consume) of every queue with a backlog: its store time and the
    # reconsume count an earlier run recorded for it (commit.lua's retries HASH).
    pipe = store.client.pipeline(transaction=False)
    heads = [i for i, (nxt, st) in enumerate(states) if nxt > max(_int(st["offset"]), firsts[i])]
    for i in heads:
        sub, mq = lanes[i]
        offset = max(_int(states[i][1]["offset"]), firsts[i])
        pipe.xrange(keys.queue_log(mq.tag), min=str(offset), count=1)
        pipe.hget(keys.sub_retries(mq.tag, sub), str(offset))
    head_replies = pipe.execute() if heads else []
    head: dict[int, tuple[int | None, int]] = {}
    for j, i in enumerate(heads):
        entries, retries = head_replies[2 * j], head_replies[2 * j + 1]
        head[i] = (store_ms(entries), _int(text(retries)))
    out = {}
    for i, (sub, mq) in enumerate(lanes):
        nxt, st = states[i]
        now = reads[i].now_ms
        lease = _int(st["lease"])
        live = bool(st["owner"]) and lease > now
        committed = _int(st["offset"])
        head_store, head_retries = head.get(i, (None, 0))
        commit_ms = _int(st["commit_ms"]) or None
        waited = waiting_ms(max(0, nxt - max(committed, firsts[i])), commit_ms, head_store, now)
        out[(sub, mq)] = QueueStatus(
            sub=sub, topic=mq.topic, broker=mq.broker_name, queue_id=mq.queue_id, max_offset=nxt,
            committed=committed, owner=st["owner"] if live else "", lease_left_ms=lease - now if live else 0,
            epoch=_int(st["epoch"]), assignee=st["assignee"],
            pending=bool(st["pending"]) and _int(st["pend_until"]) >= now, running=_int(st["run"]) > now,
            head_reconsume=head_retries if i in head else None, head_store_ms=head_store,
            commit_ms=commit_ms, now_ms=now, stuck=waited is not None and waited > stuck_after_ms,
            first_offset=firsts[i], skipped=_int(st["skipped"]),
        )
    return out


def waiting_ms(lag: int, commit_ms: int | None, head_store_ms: int | None, now_ms: int) -> int | None:
    """How long a backlog has waited without progress: since the offset last moved or the head
    message was stored, whichever is later (None without a backlog or without either time)."""
    since = max(commit_ms or 0, head_store_ms or 0)
    if not lag or not since:
        return None
    return max(0, now_ms - since)


def store_ms(entries: Any) -> int | None:
    """The ``s`` (store time) field of the first entry of an ``XRANGE`` reply."""
    if not entries:
        return None
    fields = entries[0][1]
    if isinstance(fields, dict):
        raw = fields.get(b"s")
    else:
        f = dict(zip(fields[::2], fields[1::2], strict=False))
        raw = f.get(b"s")
    return _int(text(raw)) or None


def _int(value: str) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0

"""``mqorder group delete GROUP [--topic T]``: RocketMQ's ``deleteSubGroup``, Kafka's
``kafka-consumer-groups --delete``.

A group is recorded by its workers (``TopicManager.subscribe``) and never forgotten: a retired
group (its listener removed from the code) went on holding back the ``consumed`` retention of its
topics, showing in ``topic list`` and ``status`` with queues stuck, exporting a lag that never
falls (its alerts fire for ever), and making ``topic delete`` refuse. Deleting it removes
everything stored under it, for all its topics or only ``--topic``:

* meta broker: its entry in ``mqorder:groups``, its lanes in each topic's ``...:subs`` set (what
  the retention pass and producers read), the assignment hints and stats of its lanes, and, when
  the whole group goes, its ``retention:seen`` times;
* each queue (in the queue's hash tag, so each key is in the queue's own slot on a Redis
  Cluster): the state hash (lock, epoch, committed offset) and reconsume counts of each lane;
* when the whole group goes: its retry topic ``%RETRY%<group>`` (only its own failed messages
  wait there, nobody else reads them, as RocketMQ's ``deleteSubGroup`` drops it) and its ledger
  on every broker. Its dead-letter topic ``%DLQ%<group>`` only with ``with_dlq``: dead letters are
  what an operator may still replay to another group, and once gone they are gone
  (RocketMQ deletes it with the group; we keep it unless told).

Refused while a live client (a worker with the group's listener, a PullConsumer) subscribes the
group to a topic being removed: the worker would record the subscription again at the next
topology change (``ClientInstance._restore_subscriptions``) and start from the first stored
message, since its offsets are gone. ``force`` overrides it; a running ConsumeRequest of the
group then loses its state hash, so its next fenced commit is refused.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from mqorder import keys
from mqorder.admin import topics as topic_admin
from mqorder.admin.common import Admin, BadArgumentError, RefusedError
from mqorder.errors import TopicNotFoundError
from mqorder.model import MessageModel, MessageQueue
from mqorder.store.brokers import group_by_broker


@dataclass
class GroupDeleteReport:
    """What ``delete`` removed (or, with ``dry_run``, would remove)."""

    group: str
    #: The subscriptions removed (topic -> CLUSTERING / BROADCASTING).
    topics: dict[str, str]
    #: Whether the group is gone altogether (no subscription of it left).
    whole_group: bool
    live_consumers: list[str]
    #: Subscription ids whose state was removed: the group, and each broadcast client's lane.
    lanes: list[str] = field(default_factory=list)
    #: Per-queue keys removed: ``state`` (lock, epoch, offset) and ``retries`` (reconsume counts).
    keys_by_kind: dict[str, int] = field(default_factory=dict)
    assignment_fields: int = 0
    stats_fields: int = 0
    ledger_keys: int = 0
    #: Topics deleted with the group (its retry topic, its DLQ with ``with_dlq``): their reports.
    deleted_topics: list[topic_admin.DeleteReport] = field(default_factory=list)
    #: The group's DLQ when it exists and was kept (no ``with_dlq``), with its message count.
    dlq_kept: str | None = None
    dlq_messages: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["deleted_topics"] = [t.to_json() for t in self.deleted_topics]
        return out


def delete(
    admin: Admin, group: str, *, topic: str | None = None, force: bool = False, dry_run: bool = False,
    with_dlq: bool = False,
) -> GroupDeleteReport:
    """Delete ``group``'s subscriptions (all, or only ``topic``) and everything stored under them.

    ``GroupNotFoundError`` for an unknown group, ``BadArgumentError`` for a topic it does not
    subscribe to or ``with_dlq`` with a ``topic`` that leaves some of the group; ``RefusedError``
    (nothing changed) while live consumers subscribe the group to a removed topic, unless
    ``force``.
    """
    recorded = admin.group_topics(group)
    subs = admin.topics_of(group, topic)
    whole = set(subs) == set(recorded)
    if with_dlq and not whole:
        raise BadArgumentError(
            f"--with-dlq deletes {keys.dlq_topic(group)!r}, which holds the dead letters of every topic of group "
            f"{group!r}; it also subscribes to {', '.join(sorted(set(recorded) - set(subs)))}: delete the whole "
            "group (no --topic) to drop its DLQ, or replay/keep it"
        )
    live, _, _ = admin.consumers_of(group)
    consumers = sorted(c.client_id for c in live if any(s.group == group and s.topic in subs for s in c.subscriptions))
    report = GroupDeleteReport(group, {t: m.value for t, m in sorted(subs.items())}, whole, consumers, dry_run=dry_run)
    if consumers and not force and not dry_run:
        raise RefusedError(
            f"group {group!r} has live consumer(s) subscribed to {', '.join(sorted(subs))}: {', '.join(consumers)}. "
            "They would record the subscription again and restart from the first stored message. Remove the "
            "group's listener and restart those workers (or close the PullConsumer) first, or pass --force"
        )
    retry = keys.retry_topic(group)
    own = [t for t in subs if not (whole and t == retry)]  # a retry topic goes whole, below
    lanes_of = {t: _lanes(admin, group, t) for t in own}
    report.lanes = sorted({s for lanes in lanes_of.values() for s in lanes})
    _delete_queue_state(admin, lanes_of, report)
    _delete_meta(admin, group, lanes_of, report)
    if whole:
        report.ledger_keys = _delete_ledgers(admin, group, dry_run)
        _delete_group_topics(admin, group, with_dlq, report)
    if not dry_run:
        _unsubscribe(admin, group, list(subs))
        # Workers rebalance at once: nothing of the group is assigned any more.
        admin.brokers.meta.incr(keys.topology_version())
    return report


def _lanes(admin: Admin, group: str, topic: str) -> list[str]:
    """Every subscription id of ``group`` that may hold state on ``topic``: the group itself, and
    each broadcast client's lane recorded in the topic's subs, whatever model the group is recorded
    with now (a listener may have changed model over its life)."""
    return sorted({group, *admin.lanes(group, topic, MessageModel.BROADCASTING)})


def _queues(admin: Admin, topic: str) -> list[MessageQueue]:
    try:
        return admin.route(topic).message_queues
    except TopicNotFoundError:  # subscribed before the topic was created, or deleted since
        return []


def _delete_queue_state(admin: Admin, lanes_of: dict[str, list[str]], report: GroupDeleteReport) -> None:
    """The state hash and reconsume counts of each lane on each queue: one pipeline per broker,
    one key per command (each in its queue's slot on a Redis Cluster)."""
    kinds: dict[str, int] = defaultdict(int)
    work = [(mq, lane) for t, lanes in lanes_of.items() for mq in _queues(admin, t) for lane in lanes]
    for broker, items in group_by_broker(work, lambda w: w[0]).items():
        pipe = admin.brokers.get(broker).client.pipeline(transaction=False)
        names: list[str] = []
        for mq, lane in items:
            for kind, key in (("state", keys.sub_state(mq.tag, lane)), ("retries", keys.sub_retries(mq.tag, lane))):
                (pipe.exists if report.dry_run else pipe.delete)(key)
                names.append(kind)
        for kind, n in zip(names, pipe.execute(), strict=True):
            kinds[kind] += int(n or 0)
    report.keys_by_kind = dict(sorted(kinds.items()))


def _delete_meta(admin: Admin, group: str, lanes_of: dict[str, list[str]], report: GroupDeleteReport) -> None:
    """Each lane's assignment hints and stats fields for the removed topics' queues, and the lanes
    in the topics' subs sets (the retention pass's holders). A whole group's lanes lose their
    whole hashes and their last-seen times (fields of topics deleted long ago included)."""
    meta = admin.brokers.meta
    topics_of_lane: dict[str, set[str]] = defaultdict(set)
    for t, lanes in lanes_of.items():
        for lane in lanes:
            topics_of_lane[lane].add(t)
    assign: dict[str, list[Any]] = {}
    stats: dict[str, list[Any]] = {}
    for lane, topics in topics_of_lane.items():
        assign[lane] = [f for f in meta.hkeys(keys.assignment(lane)) if report.whole_group or _topic_of(f) in topics]
        stats[lane] = [f for f in meta.hkeys(keys.stats(lane))
                       if report.whole_group or _topic_of(f, keys.STATS_FIELD_SEP) in topics]
    report.assignment_fields = sum(len(v) for v in assign.values())
    report.stats_fields = sum(len(v) for v in stats.values())
    if report.dry_run:
        return
    pipe = meta.pipeline(transaction=False)
    for lane, topics in topics_of_lane.items():
        if assign[lane]:
            pipe.hdel(keys.assignment(lane), *assign[lane])
        if stats[lane]:
            pipe.hdel(keys.stats(lane), *stats[lane])
        for t in topics:
            pipe.srem(keys.topic_subs(t), lane)
            # A group created again under the name decides its start (consume_from_where) anew.
            pipe.srem(keys.lanes_started(), f"{t}|{lane}")
        if report.whole_group:
            pipe.hdel(keys.retention_seen(), lane)
    pipe.execute()


def _topic_of(raw_field: bytes | str, cut: str | None = None) -> str:
    """The topic of an assignment field (a queue key) or a stats field (``<queue key>#<counter>``)."""
    f = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
    if cut is not None:
        f = f.rsplit(cut, 1)[0]
    return f.split(keys.QUEUE_KEY_SEP, 1)[0]


def _delete_ledgers(admin: Admin, group: str, dry_run: bool) -> int:
    """The group's consumption ledger on every broker: the trimmer trims only the ledgers of known
    groups, so a deleted group's would stay for ever."""
    n = 0
    for name in admin.brokers.names:
        client = admin.brokers.get(name).client
        n += int((client.exists if dry_run else client.delete)(keys.ledger(group)) or 0)
    return n


def _delete_group_topics(admin: Admin, group: str, with_dlq: bool, report: GroupDeleteReport) -> None:
    """The retry topic always, the DLQ only ``with_dlq`` (otherwise said to be kept)."""
    dlq = keys.dlq_topic(group)
    for name in (keys.retry_topic(group), dlq):
        if not admin.brokers.meta.exists(keys.topic_route(name)):
            continue
        if name == dlq and not with_dlq:
            report.dlq_kept = name
            report.dlq_messages = topic_admin.describe(admin, name).messages
            continue
        # Forced: the group itself is its only subscriber (being deleted); live consumers were
        # checked above.
        report.deleted_topics.append(topic_admin.delete(admin, name, force=True, dry_run=report.dry_run))


def _unsubscribe(admin: Admin, group: str, topics: list[str]) -> None:
    """Remove ``topics`` from the group's record in ``mqorder:groups`` (the whole entry when none is
    left): what ``status``, ``topic list``, the rebalance, the exporter and ``topic delete`` read."""
    meta = admin.brokers.meta
    raw = meta.hget(keys.groups(), group)
    subscriptions = json.loads(raw) if raw else {}
    for t in topics:
        subscriptions.pop(t, None)
    if subscriptions:
        meta.hset(keys.groups(), group, json.dumps(subscriptions, sort_keys=True))
    else:
        meta.hdel(keys.groups(), group)

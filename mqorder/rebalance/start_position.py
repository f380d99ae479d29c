"""Where a new group starts: RocketMQ's ``ConsumeFromWhere`` for a lane that never committed.

By default a lane that has no committed offset on a queue starts at its first stored message
(``CONSUME_FROM_FIRST_OFFSET``): a new group reads the whole retained backlog. RocketMQ's own
default is ``CONSUME_FROM_LAST_OFFSET``, and a group added to a busy topic often wants only what
is sent from now on (a new projection, a new notifier): a listener says so with
``consume_from_where="last_offset"``, and its client, when it registers, sets the lane's offset on
each queue to the queue's end, *only when the lane is new on the topic*: no queue has an offset
for it yet. A lane that ever committed is never moved, so a restart resumes where it stopped; a
queue of a lane that is not new but never got a message keeps starting at its first message.

Per queue, in one script (``_SET_AT_END``): only if the state has no offset, the offset becomes
the queue's next offset; a second worker of the group registering at the same moment sets nothing
more. Messages sent before that instant are not consumed by the lane (as in RocketMQ).
"""

from __future__ import annotations

import logging

import redis

from mqorder import keys
from mqorder.errors import TopicNotFoundError
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager

log = logging.getLogger("mqorder.rebalance")

#: KEYS[1] the lane's state HASH on the queue, KEYS[2] the queue's next counter; returns 1 if set.
_SET_AT_END = """
if redis.call('HEXISTS', KEYS[1], 'offset') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'offset', tonumber(redis.call('GET', KEYS[2]) or 0))
return 1
"""


def start_new_lane_at_end(brokers: BrokerRegistry, topics: TopicManager, sub: str, topic: str) -> int:
    """Set lane ``sub``'s offset on each queue of ``topic`` to the queue's end, if the lane has no
    offset on any of them (it is new on the topic); the number of queues set. A topic that does not
    exist yet is left alone: its messages all come after the lane, which starts at 0 there.

    Decided once per lane and topic (``keys.lanes_started``): a lane whose topic was created after
    it, or whose first messages it has not committed yet, would otherwise be moved to the end by
    its next registration (a restart), skipping what it had not consumed."""
    meta, mark = brokers.meta, f"{topic}|{sub}"
    if meta.sismember(keys.lanes_started(), mark):
        return 0
    try:
        route = topics.describe_topic(topic)
    except TopicNotFoundError:
        meta.sadd(keys.lanes_started(), mark)
        return 0
    by_broker: dict[str, list[str]] = {}
    for mq in route.message_queues:
        by_broker.setdefault(mq.broker_name, []).append(mq.tag)
    for name, tags in by_broker.items():
        pipe = brokers.get(name).client.pipeline(transaction=False)
        for tag in tags:
            pipe.hexists(keys.sub_state(tag, sub), "offset")
        if any(pipe.execute()):
            meta.sadd(keys.lanes_started(), mark)
            return 0  # not new: it committed (or was reset) somewhere; never move it
    done = 0
    for name, tags in by_broker.items():
        client: redis.Redis = brokers.get(name).client
        pipe = client.pipeline(transaction=False)
        for tag in tags:
            pipe.eval(_SET_AT_END, 2, keys.sub_state(tag, sub), keys.queue_next(tag))
        done += sum(int(x) for x in pipe.execute())
    meta.sadd(keys.lanes_started(), mark)  # last: a registration cut short before it decides again
    if done:
        log.info("mqorder: lane %s is new on topic %s: starts at the end of its %d queues (consume_from_where="
                 "last_offset)", sub, topic, done)
    return done

"""The name rules, decided once: what topic, group, broker and client names may hold, and why.

Names are checked once, at the edge (listener registration, topic creation, broker settings,
worker start), with a message that says what is allowed. Downstream, every stored format is built
from names and parsed back; each one is a real encoding only because the character it splits on is
reserved here. The patterns and separators live in ``mqorder/keys.py``; the reasons live here.

The charsets
    *Topics and groups*: RocketMQ's (``^[%|a-zA-Z0-9_-]+$``, at most 127 characters) plus ``.``,
    so a RocketMQ name without ``.`` means the same thing here. *Brokers*: the same plus ``@``.
    *Client ids* are Celery node names (``name@host``, the host as the machine spells it): 1 to
    255 characters, anything but whitespace, control characters and braces.

Reserved, and what for
    ``:``
        Joins topic, broker and queue id in a queue key (``orders:broker-a:3``): the assignment
        hash's field, the ConsumeRequest task argument, the ``by_config`` setting, the Cluster
        hash tag, and the segments of every Redis key. Not in topic or broker names, so
        ``keys.parse_queue_key`` splits a queue key into exactly three parts.
    ``{`` ``}``
        Delimit the Redis Cluster hash tag ``{orders:broker-a:3}``; a brace inside it would send
        one queue's keys to different slots, which no Lua script can then touch at once. Refused
        everywhere, client ids included (a broadcast subscription id holds one and is part of
        per-queue keys).
    ``@``
        Puts a broker in a machine room: ``room@name``, the room being what comes before the
        first ``@`` (``by_machine_room``, as in RocketMQ). Allowed in broker names only, which is
        what gives the room its meaning (and in client ids, where Celery puts it).
    ``%BC%``
        Joins a broadcasting group and a client into that client's private subscription id,
        ``group%BC%client``, which ``keys.group_of_sub`` cuts at the first ``%BC%``. The client id
        may hold anything, so the group must not: a group name neither contains ``%BC%`` nor ends
        with ``%BC`` (``g%BC`` + ``%BC%`` + ``x`` reads as group ``g``).
    ``%DLQ%``
        Starts a group's dead-letter topic, ``%DLQ%group`` (RocketMQ's prefix). A topic may start
        with it only as a dead-letter topic, and then what follows is a valid group name, which
        makes a dead-letter topic up to 127 + 5 characters long.
    ``%RETRY%``
        Starts a group's retry topic, ``%RETRY%group`` (RocketMQ's prefix), where its concurrent
        listeners send failed messages back to; the same rule as ``%DLQ%`` (up to 127 + 7).
    ``#``
        Joins a queue key and a counter name in the fields of the stats hash
        (``orders:broker-a:3#ok``, ``mqorder.consumer.stats``).
    whitespace and control characters
        In no name: they would forge lines in logs and in ``mqorder status``, and hide a name's
        end (a trailing newline was once accepted).
    ``~`` as a whole client id
        Is ``keys.NOBODY``, the assignee of a queue no live client consumes; a client of that name
        would never get a queue (the rebalance would release every lock assigned to it).

``|`` and ``%`` stay allowed, as in RocketMQ: no stored format splits on them (a client's
subscriptions are stored as JSON objects, wake-ups as JSON arrays).
"""

from __future__ import annotations

from mqorder import keys
from mqorder.errors import InvalidNameError

_ALLOWED = "letters, digits and the characters % | _ . - (1 to 127 characters)"
_ALLOWED_BROKER = "letters, digits and the characters % | _ . - @ (1 to 127 characters)"
#: A group ending in this would absorb the start of ``%BC%`` in ``group%BC%client``.
_BROADCAST_SEP_HEAD = keys.BROADCAST_SEP[:-1]


def _str(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} name must be a str, got {type(value).__name__}: {value!r}")
    return value


def check_group(value: object) -> str:
    """Return ``value`` if it is a valid consumer group name, else raise ``InvalidNameError``."""
    group = _str("group", value)
    if not keys.NAME_RE.fullmatch(group):
        raise InvalidNameError(f"invalid group name {group!r}: use only {_ALLOWED}")
    if keys.BROADCAST_SEP in group or group.endswith(_BROADCAST_SEP_HEAD):
        raise InvalidNameError(
            f"invalid group name {group!r}: {keys.BROADCAST_SEP!r} is reserved (it joins a broadcasting "
            f"group and a client id), so a group may neither contain it nor end with {_BROADCAST_SEP_HEAD!r}"
        )
    return group


def check_broker(value: object) -> str:
    """Return ``value`` if it is a valid broker name (``room@name`` allowed), else raise."""
    broker = _str("broker", value)
    if not keys.BROKER_RE.fullmatch(broker):
        raise InvalidNameError(f"invalid broker name {broker!r}: use only {_ALLOWED_BROKER}")
    return broker


def check_topic(value: object, *, allow_dlq: bool = False, allow_retry: bool = False) -> str:
    """Return ``value`` if it is a valid topic name, else raise ``InvalidNameError``.

    ``allow_dlq`` admits dead-letter topics, ``%DLQ%`` followed by a valid group name;
    ``allow_retry`` admits retry topics, ``%RETRY%`` followed by a valid group name.
    """
    topic = _str("topic", value)
    for prefix, allowed, what in ((keys.DLQ_PREFIX, allow_dlq, "dead-letter"),
                                  (keys.RETRY_PREFIX, allow_retry, "retry")):
        if not topic.startswith(prefix):
            continue
        if not allowed:
            raise InvalidNameError(
                f"topic {topic!r} starts with {prefix!r}, which is reserved for {what} "
                "topics; choose another name"
            )
        try:
            check_group(topic[len(prefix) :])
        except InvalidNameError as exc:
            raise InvalidNameError(
                f"invalid {what} topic {topic!r}: {prefix!r} must be followed by a group name ({exc})"
            ) from None
        return topic
    if not keys.NAME_RE.fullmatch(topic):
        raise InvalidNameError(f"invalid topic name {topic!r}: use only {_ALLOWED}")
    return topic


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid ``kind`` name (``topic``, ``group`` or ``broker``), else raise."""
    if kind == "group":
        return check_group(value)
    if kind == "broker":
        return check_broker(value)
    if kind == "topic":
        return check_topic(value)
    raise ValueError(f"unknown kind of name {kind!r}")


def check_client_id(value: object) -> str:
    """Return ``value`` if it is a valid client id (a Celery node name), else raise."""
    if not isinstance(value, str) or not keys.CLIENT_RE.fullmatch(value):
        raise InvalidNameError(
            f"invalid client id {value!r}: 1 to 255 characters, no whitespace, control characters or braces"
        )
    if value == keys.NOBODY:
        raise InvalidNameError(f"invalid client id {value!r}: it is reserved for 'no client' (keys.NOBODY)")
    return value


def machine_room(broker_name: str) -> str:
    """The machine room of a broker named ``room@name``: what comes before the first ``@``.

    A broker name without ``@`` is its own room, as in RocketMQ's ``brokerName.split("@")[0]``.
    """
    return broker_name.split(keys.MACHINE_ROOM_SEP, 1)[0]

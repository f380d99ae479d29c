"""Validation of topic, group, broker and client names.

Names end up inside Redis keys and Cluster hash tags; a ``{`` or a space there would silently put
a queue's keys in different slots, so names are checked once, at the edge, with a message that says
what is allowed.
"""

from __future__ import annotations

from mqorder import keys
from mqorder.errors import InvalidNameError

_ALLOWED = "letters, digits and the characters % | _ . - (1 to 127 characters)"


def check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid ``kind`` name (topic, group, broker), else raise."""
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} name must be a str, got {type(value).__name__}: {value!r}")
    if not keys.NAME_RE.fullmatch(value):
        raise InvalidNameError(f"invalid {kind} name {value!r}: use only {_ALLOWED}")
    if kind != "topic" and keys.BROADCAST_SEP in value:
        raise InvalidNameError(f"invalid {kind} name {value!r}: {keys.BROADCAST_SEP!r} is reserved")
    return value


def check_topic(value: object, *, allow_dlq: bool = False) -> str:
    topic = check_name("topic", value)
    if topic.startswith(keys.DLQ_PREFIX) and not allow_dlq:
        raise InvalidNameError(
            f"topic {topic!r} starts with {keys.DLQ_PREFIX!r}, which is reserved for dead-letter "
            "topics; choose another name"
        )
    return topic


def check_client_id(value: object) -> str:
    if not isinstance(value, str) or not keys.CLIENT_RE.fullmatch(value):
        raise InvalidNameError(
            f"invalid client id {value!r}: 1 to 255 characters, no whitespace and no braces"
        )
    return value

"""How long a topic keeps its messages: RocketMQ's ``fileReservedTime``, Kafka's ``retention.ms``.

A queue's stream would otherwise grow for ever (5,000 msg/s of 1 KiB is ~430 GB of Redis memory a
day). Each topic has a retention rule: the ``MQORDER_RETENTION_*`` defaults, overridden per topic
at ``create_topic(..., retention=...)`` / ``mqorder topic create`` or later with
``TopicManager.update_retention`` / ``mqorder topic retention``. Overrides are stored in the
topic's route hash as ``retention_*`` fields; a field that is absent follows the default, so
changing ``MQORDER_RETENTION_MS`` changes every topic that did not choose its own.

Two policies:

``time`` (RocketMQ, Kafka)
    Trim entries older than ``retention_ms`` whatever was consumed. A group that falls behind the
    first stored offset moves forward to it (fenced, in order) and counts what it skipped.
``consumed``
    Trim only what every group holding the topic has consumed (the lowest committed offset of
    every clustering group subscribed to it, and of every broadcast client), and only once it is
    older than ``retention_min_ms`` (kept for replay). A group whose last worker went away more
    than ``retention_ms`` ago stops holding data back; a topic no group holds follows ``time``.

``retention_max_messages`` caps each queue at that many messages: under ``time`` whatever was
consumed (Kafka's ``retention.bytes``, counted in messages); under ``consumed`` it may trim a
consumed message before ``retention_min_ms``, never an unconsumed one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from mqorder.errors import ConfigError

#: The longest retention anyone may ask for (a year): a typo of a few zeros is refused.
MAX_RETENTION_MS = 366 * 24 * 3600 * 1000
#: Route hash field prefix of the per-topic overrides.
FIELD_PREFIX = "retention_"


class RetentionPolicy(StrEnum):
    TIME = "time"
    CONSUMED = "consumed"


@dataclass(frozen=True)
class RetentionRule:
    """The effective rule of one topic: every value resolved (defaults applied)."""

    policy: RetentionPolicy
    retention_ms: int
    retention_min_ms: int
    #: Most messages kept per queue; 0: no cap.
    retention_max_messages: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value, "retention_ms": self.retention_ms,
            "retention_min_ms": self.retention_min_ms, "retention_max_messages": self.retention_max_messages or None,
        }


@dataclass(frozen=True)
class TopicRetention:
    """A topic's own choices; ``None`` means "the default" (``MQORDER_RETENTION_*``)."""

    policy: RetentionPolicy | None = None
    retention_ms: int | None = None
    retention_min_ms: int | None = None
    #: 0 explicitly removes a default cap.
    retention_max_messages: int | None = None

    @classmethod
    def of(
        cls, *, policy: object = None, retention_ms: object = None, retention_min_ms: object = None,
        retention_max_messages: object = None,
    ) -> TopicRetention:
        """Validate user input (keyword arguments or CLI options); ``ConfigError`` says what is wrong."""
        return cls(
            policy=check_policy(policy) if policy is not None else None,
            retention_ms=_check_ms("retention_ms", retention_ms, minimum=1000) if retention_ms is not None else None,
            retention_min_ms=(
                _check_ms("retention_min_ms", retention_min_ms, minimum=0) if retention_min_ms is not None else None
            ),
            retention_max_messages=(
                _check_count(retention_max_messages) if retention_max_messages is not None else None
            ),
        )

    def merged(self, other: TopicRetention) -> TopicRetention:
        """These choices with ``other``'s given values on top (an update keeps what it does not name)."""
        return TopicRetention(**{
            f.name: getattr(other, f.name) if getattr(other, f.name) is not None else getattr(self, f.name)
            for f in fields(self)
        })

    def to_fields(self) -> dict[str, str]:
        """The route hash fields of the values given (absent ones follow the default)."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[_field(f.name)] = str(v.value if isinstance(v, RetentionPolicy) else v)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[str, str]) -> TopicRetention:
        """Read the stored overrides back; a value this version cannot read follows the default."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = raw.get(_field(f.name))
            if v is None or v == "":
                continue
            try:
                values[f.name] = RetentionPolicy(v) if f.name == "policy" else int(v)
            except ValueError:
                continue
        return cls(**values)

    def resolve(self, defaults: RetentionRule) -> RetentionRule:
        """The effective rule; ``ConfigError`` if the combination makes no sense."""
        retention_ms = self.retention_ms if self.retention_ms is not None else defaults.retention_ms
        rule = RetentionRule(
            policy=self.policy or defaults.policy,
            retention_ms=retention_ms,
            # A default replay window is cut to a shorter retention; one the topic chose is checked.
            retention_min_ms=(
                self.retention_min_ms if self.retention_min_ms is not None
                else min(defaults.retention_min_ms, retention_ms)
            ),
            retention_max_messages=(
                self.retention_max_messages if self.retention_max_messages is not None
                else defaults.retention_max_messages
            ),
        )
        check_rule(rule)
        return rule


def _field(name: str) -> str:
    return name if name.startswith(FIELD_PREFIX) else FIELD_PREFIX + name


def field_names() -> list[str]:
    """Every route hash field a retention override may use (what ``describe_topic`` reads)."""
    return [_field(f.name) for f in fields(TopicRetention)]


def check_policy(value: object) -> RetentionPolicy:
    if isinstance(value, RetentionPolicy):
        return value
    if isinstance(value, str):
        try:
            return RetentionPolicy(value.strip().lower())
        except ValueError:
            pass
    raise ConfigError(
        f"retention policy must be 'time' (trim what is older than retention_ms, consumed or not) or "
        f"'consumed' (trim only what every group has consumed), got {value!r}"
    )


def _check_ms(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_RETENTION_MS:
        raise ConfigError(
            f"{name} must be a whole number of milliseconds from {minimum:,} to {MAX_RETENTION_MS:,} "
            f"(a year), got {value!r}; e.g. 259200000 for RocketMQ's 72 h"
        )
    return value


def _check_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"retention_max_messages must be a whole number >= 0 (0: no cap per queue), got {value!r}"
        )
    return value


def check_rule(rule: RetentionRule) -> RetentionRule:
    if rule.retention_min_ms > rule.retention_ms:
        raise ConfigError(
            f"retention_min_ms ({rule.retention_min_ms:,} ms) must not exceed retention_ms "
            f"({rule.retention_ms:,} ms): what is kept for replay cannot outlive the retention itself"
        )
    return rule

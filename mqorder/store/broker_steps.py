"""``BrokerSteps``: each broker's part of a step over several brokers, kept apart.

A deployment with several brokers (``MQORDER_BROKERS``) runs its periodic steps (lock renewal,
sweeps, rebalances, the delay mover) broker after broker. One broker down must not cost the others
their part: raising at the first failing broker threw away what the brokers before it had done and
skipped the ones after it, for as long as the outage lasted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from mqorder.errors import BrokerUnavailableError, ConfigError

log = logging.getLogger(__name__)


class BrokerSteps:
    """Each broker's part of a step over several brokers, kept apart: one broker down must not
    cost the others theirs. The scripts of the brokers before a failing one have run by then (a
    sweep armed a pending token, a rebalance moved a queue), so raising threw their replies away:
    the healthy brokers' queues were neither dispatched nor renewed for the whole outage.

    A broker's failure is logged and its part skipped (its queues are tried again at the next
    sweep, ``lock_all`` or rebalance); if *every* broker tried failed, the first error is raised,
    as a single-broker deployment always saw it."""

    def __init__(self, what: str, part: str = "broker") -> None:
        self.what = what
        #: What each part is called in the log: a broker, or a lane or client whose step spans
        #: brokers of its own (a rebalance's lanes, ``lock_all``'s clients).
        self.part = part
        self.ok = 0
        self.failed: list[tuple[str, Exception]] = []

    @contextmanager
    def of(self, broker_name: str) -> Iterator[None]:
        try:
            yield
        except (redis.RedisError, redis.exceptions.RedisClusterException, BrokerUnavailableError, ConfigError,
                OSError) as exc:
            self.failed.append((broker_name, exc))
        else:
            self.ok += 1

    def settle(self) -> None:
        if not self.failed:
            return
        if not self.ok:
            raise self.failed[0][1]
        for name, exc in self.failed:
            log.warning("%s: %s %r failed (%s: %s); the other %ss' part is done, its queues are tried again "
                        "next time", self.what, self.part, name, type(exc).__name__, exc, self.part)

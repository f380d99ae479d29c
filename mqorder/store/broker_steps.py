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
from typing import Any

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
        #: (broker, calls failed, calls, first error) of a broker whose calls failed in part
        #: (``Scripts.run_each``: a Redis Cluster shard down, the others answering).
        self.partial: list[tuple[str, int, int, Exception]] = []

    @contextmanager
    def of(self, broker_name: str) -> Iterator[None]:
        try:
            yield
        except (redis.RedisError, redis.exceptions.RedisClusterException, BrokerUnavailableError, ConfigError,
                OSError) as exc:
            self.failed.append((broker_name, exc))
        else:
            self.ok += 1

    def partly(self, broker_name: str, replies: list[Any]) -> list[Any]:
        """``replies`` of ``Scripts.run_each`` with each failed call's error as None, noted for
        ``settle`` to log: the calls that ran are used, the others tried again next time."""
        errors = [r for r in replies if isinstance(r, Exception)]
        if not errors:
            return replies
        self.missed(broker_name, len(errors), len(replies), errors[0])
        return [None if isinstance(r, Exception) else r for r in replies]

    def missed(self, broker_name: str, bad: int, total: int, exc: Exception) -> None:
        """``bad`` of a broker's ``total`` parts failed, first with ``exc``: logged by ``settle``."""
        self.partial.append((broker_name, bad, total, exc))

    def settle(self) -> None:
        for name, bad, total, exc in self.partial:
            log.warning("%s: %d of %d calls on broker %r failed (%s: %s: a Redis Cluster shard down, or an error of the script); the rest "
                        "is done, those queues are tried again next time", self.what, bad, total, name,
                        type(exc).__name__, exc)
        if not self.failed:
            return
        if not self.ok:
            raise self.failed[0][1]
        for name, exc in self.failed:
            log.warning("%s: %s %r failed (%s: %s); the other %ss' part is done, its queues are tried again "
                        "next time", self.what, self.part, name, type(exc).__name__, exc, self.part)

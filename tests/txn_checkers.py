"""Transaction checkers loaded by the test workers (``MQORDER_LISTENERS=...,tests.txn_checkers``).

The "local transaction" of a test producer is a Redis key ``local:<msg id>`` it writes before it
is killed; the checker answers from it: COMMIT, ROLLBACK, or UNKNOWN while it is absent.
"""

from __future__ import annotations

import os

import redis

from mqorder.client.transaction import LocalTransactionState
from mqorder.client.transaction_check import transaction_checker
from mqorder.model import MessageExt

_r: redis.Redis | None = None


def r() -> redis.Redis:
    global _r
    if _r is None or _r.connection_pool.pid != os.getpid():
        _r = redis.Redis.from_url(os.environ["MQORDER_REDIS_URL"])
    return _r


@transaction_checker(topic="t-order")
def check_local(msg: MessageExt) -> LocalTransactionState:
    r().incr(f"checked:{msg.msg_id}")
    state = r().get(f"local:{msg.msg_id}")
    if state == b"COMMIT":
        return LocalTransactionState.COMMIT
    if state == b"ROLLBACK":
        return LocalTransactionState.ROLLBACK
    return LocalTransactionState.UNKNOWN

"""``KeyLanes.ready_count`` is kept as lanes change (the dispatcher asks it at every turn; at
``key_concurrency`` 256 counting busy keys each time was a tenth of an async run's CPU): random
sequences of every lane operation agree with counting it from scratch."""

from __future__ import annotations

import random

import pytest

from mqorder.consumer.key_lanes import KeyLanes
from mqorder.model import MessageExt


def msg(offset: int, key: int) -> MessageExt:
    return MessageExt(msg_id=str(offset), topic="t", broker_name="broker-a", queue_id=0, queue_offset=offset,
                      body=b"", keys=[], tags=None, properties={}, born_timestamp=0, store_timestamp=0, key_hash=key)


def counted(lanes: KeyLanes) -> int:
    held = {k for k in lanes.busy | set(lanes.blocked) if k in lanes.lanes}
    return len(lanes.lanes) - len(held)


@pytest.mark.parametrize("seed", range(20))
def test_ready_count_matches_a_count_from_scratch_through_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    lanes = KeyLanes()
    offset, now = 0, 0.0
    running: dict[int, list[MessageExt]] = {}
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            lanes.put(msg(offset, rng.randrange(12)))
            offset += 1
        elif op < 0.6:
            got = lanes.take(rng.choice([1, 2, 3]))
            if got is not None:
                running[got[0]] = got[1]
        elif op < 0.75 and running:
            key = rng.choice(list(running))
            running.pop(key)
            lanes.done(key)
        elif op < 0.85 and running:
            key = rng.choice(list(running))
            lanes.retry(key, running.pop(key), now + rng.random())
        elif op < 0.9 and running:
            key = rng.choice(list(running))
            running.pop(key)
            lanes.release(key)  # a fenced or cancelled call: settled without handing the lane out
        else:
            now += rng.random() * 0.5
            lanes.unblock(now)
        assert lanes.ready_count() == counted(lanes)
        assert not lanes.busy & set(lanes.blocked)

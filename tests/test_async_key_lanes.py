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


@pytest.mark.parametrize("seed", range(10))
def test_a_whole_read_recorded_at_once_leaves_the_tracker_as_offset_by_offset(seed: int) -> None:
    """``OffsetTracker.pulled_all`` (a read's bookkeeping in one step) against ``pulled`` one offset
    at a time, through random reads, finishes and retention gaps; it declines (recording nothing)
    when a previous owner's finished offsets are still to skip or the read overlaps."""
    from mqorder.consumer.offset_map import OffsetTracker

    rng = random.Random(seed)
    inherited = {o for o in range(5, 60) if rng.random() < 0.2} if seed % 2 else set()
    a, b = OffsetTracker(5, set(inherited)), OffsetTracker(5, set(inherited))
    nxt = 5
    for _ in range(200):
        if rng.random() < 0.5:
            nxt += rng.choice([0, 0, 0, 3])  # a retention gap now and then
            start = nxt - (rng.randrange(3) if rng.random() < 0.1 else 0)  # an overlapping read
            read = list(range(start, start + rng.randrange(1, 9)))
            nxt = max(nxt, read[-1] + 1)
            before = (list(a.unfinished), a.pulled_to, a.base)
            if not a.pulled_all(read):
                assert (list(a.unfinished), a.pulled_to, a.base) == before
                for o in read:
                    a.pulled(o)
            for o in read:
                b.pulled(o)
        elif a.unfinished:
            o = rng.choice(a.unfinished)
            a.finish(o)
            b.finish(o)
        assert (a.unfinished, a.pulled_to, a.base, a.inherited) == (b.unfinished, b.pulled_to, b.base, b.inherited)
        assert a.encoded() == b.encoded()

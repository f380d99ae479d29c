"""``bench.trickle``: the in-process trickle pass, and the design property it measures.

At a trickle every message reaches a lingering ConsumeRequest through its blocking read, and since
the commit of one message carries the read that brings the next (and ``switch.lua`` behind it),
a trickling message costs the engine one round trip. The pass asserts nothing about speed; this
test holds it to that count, which a pass whose sends never reached the read (the bench before its
group was subscribed: each message found by the watch's next refresh) or an extra round trip per
message in the engine would both break.
"""

from __future__ import annotations

from bench.trickle import floor_pass, trickle_pass
from mqorder.testing.embedded import RedisServer


def test_a_trickling_message_costs_the_engine_one_round_trip() -> None:
    with RedisServer() as srv:
        out = trickle_pass(srv.url, messages=300, queues=8, seed=1)
    assert out["messages"] == 300
    # Script loading and the first adoption add a few round trips to the pass, not one per message.
    assert 0.95 <= out["engine_round_trips_per_msg"] <= 1.05, out
    # Every send found the lingering read (a doorbell or its own queue's log): none woke a task.
    assert out["wakes_per_msg"] == 0, out


def test_the_floor_pass_reads_each_message_in_one_round_trip() -> None:
    """``floor_pass`` (the bare loop ``--floor`` compares the engine with) is the same shape: every
    message reaches its blocking read, one round trip of the engine's four commands each."""
    with RedisServer() as srv:
        out = floor_pass(srv.url, messages=300, queues=8, seed=1)
    assert out["messages"] == 300
    assert 0.95 <= out["engine_round_trips_per_msg"] <= 1.05, out
    assert 3.9 <= out["engine_commands_per_msg"] <= 4.1, out

"""The one append path (``QueueAppender`` and ``send.lua``) against a real redis-server:
offsets, idempotency by id, wake-ups, and the wake-up payload's format."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from mqorder import keys
from mqorder.codec import encode_header
from mqorder.model import MessageModel, MessageQueue
from mqorder.store.append import AppendRequest, QueueAppender, QueueSendKeys
from mqorder.store.log import MessageLog
from mqorder.store.topics import TopicManager
from mqorder.store.wake import WakeUp

MQ = MessageQueue("t", "broker-a", 0)
MQ1 = MessageQueue("t", "broker-a", 1)


def entries(*bodies: str) -> list[tuple[bytes, bytes]]:
    return [(encode_header(f"id-{b}"), b.encode()) for b in bodies]


def stored_bodies(app: QueueAppender, mq: MessageQueue = MQ) -> list[bytes]:
    return [m.body for m in MessageLog(app.brokers).read(mq, 0, 1000)]


def test_plain_append_assigns_contiguous_offsets(appender: QueueAppender) -> None:
    a = appender.append(MQ, entries("a", "b"))
    b = appender.append(MQ, entries("c"))
    assert (a.offsets, a.stored, b.offsets) == ([0, 1], 2, [2])
    assert stored_bodies(appender) == [b"a", b"b", b"c"]


def test_idempotent_append_skips_ids_already_stored_and_reports_their_offsets(appender: QueueAppender) -> None:
    first = appender.append(MQ, entries("a", "b"), ids=["x", "y"])
    again = appender.append(MQ, entries("a", "b", "c"), ids=["x", "y", "z"])  # a retried writer
    assert (first.offsets, first.stored) == ([0, 1], 2)
    assert (again.offsets, again.stored, again.duplicates) == ([0, 1, 2], 1, 2)
    assert stored_bodies(appender) == [b"a", b"b", b"c"]


def test_an_id_repeated_within_one_call_is_stored_once(appender: QueueAppender) -> None:
    reply = appender.append(MQ, entries("a", "a2", "b"), ids=["x", "x", "y"])
    assert (reply.offsets, reply.stored) == ([0, 0, 1], 2)
    assert stored_bodies(appender) == [b"a", b"b"]


def test_ids_are_per_queue(appender: QueueAppender) -> None:
    replies = appender.append_many(
        [AppendRequest(MQ, entries("a"), ["x"]), AppendRequest(MQ1, entries("b"), ["x"])]
    )
    assert [r.offsets for r in replies] == [[0], [0]]
    assert stored_bodies(appender, MQ1) == [b"b"]


def test_plain_and_idempotent_appends_share_one_offset_sequence(appender: QueueAppender) -> None:
    appender.append(MQ, entries("a"))
    assert appender.append(MQ, entries("b"), ids=["y"]).offsets == [1]
    assert appender.append(MQ, entries("c")).offsets == [2]
    assert appender.append(MQ, entries("b"), ids=["y"]).offsets == [1]


def _owner_listening(appender: QueueAppender, r: redis.Redis) -> redis.client.PubSub:
    """Group "g" subscribes to "t" and w1 holds ``MQ``'s live lock: w1's wake channel, listened to."""
    TopicManager(appender.brokers).subscribe("g", "t", MessageModel.CLUSTERING)
    sec, _ = r.time()
    r.hset(keys.sub_state(MQ.tag, "g"), mapping={"owner": "w1", "lease": (sec + 60) * 1000})
    ps = r.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(keys.wake_channel("w1"))
    ps.get_message(timeout=1)
    return ps


def test_append_wakes_an_idle_owner_once_and_not_for_duplicates(appender: QueueAppender, r: redis.Redis) -> None:
    ps = _owner_listening(appender, r)
    assert appender.append(MQ, entries("a"), ids=["x"]).woken == ["w1"]
    wake = WakeUp.decode(ps.get_message(timeout=2)["data"])
    assert (wake.sub, wake.mq_key) == ("g", MQ.key)
    assert r.hget(keys.sub_state(MQ.tag, "g"), "pending").decode() == wake.token
    r.hset(keys.sub_state(MQ.tag, "g"), mapping={"pending": "", "pend_until": 0})
    assert appender.append(MQ, entries("a"), ids=["x"]).woken == []  # nothing new: nobody to wake
    ps.close()


def test_a_single_plain_append_takes_the_next_offset_and_wakes_like_any_append(appender: QueueAppender,
                                                                               r: redis.Redis) -> None:
    """``append_one`` (a trickle's ``send_orderly``): the same script, offsets and wake-up as
    ``append``, its reply read without the reply object."""
    ps = _owner_listening(appender, r)
    assert appender.append(MQ, entries("a", "b")).offsets == [0, 1]
    wake = WakeUp.decode(ps.get_message(timeout=2)["data"])
    r.hset(keys.sub_state(MQ.tag, "g"), mapping={"pending": "", "pend_until": 0})  # that request ended
    header, = (h for h, _ in entries("c"))
    offset, store_ms = appender.append_one(MQ, header, b"c")
    assert offset == 2 and abs(store_ms - r.time()[0] * 1000) < 5_000
    again = WakeUp.decode(ps.get_message(timeout=2)["data"])
    assert (again.sub, again.mq_key) == ("g", MQ.key) and again.token != wake.token
    assert r.hget(keys.sub_state(MQ.tag, "g"), "pending").decode() == again.token
    assert appender.append_one(MQ, header, b"d")[0] == 3  # a request is pending now: nobody woken
    assert ps.get_message(timeout=0.3) is None
    assert stored_bodies(appender) == [b"a", b"b", b"c", b"d"]
    ps.close()


def test_bad_append_requests_are_refused_before_anything_is_written(appender: QueueAppender) -> None:
    with pytest.raises(ValueError, match="ids for"):
        appender.append(MQ, entries("a", "b"), ids=["x"])
    with pytest.raises(ValueError, match="at most"):
        appender.append(MQ, entries(*[str(i) for i in range(1001)]))
    assert stored_bodies(appender) == []


@given(st.text(), st.text(), st.text())
def test_wake_payload_round_trips_any_strings(sub: str, mq_key: str, token: str) -> None:
    assert WakeUp.decode(WakeUp(sub, mq_key, token).encode()) == WakeUp(sub, mq_key, token)


@given(st.lists(st.text(), max_size=3), st.text(min_size=1), st.integers(0, 999))
def test_a_queues_preformatted_wake_tail_is_what_encoding_each_wake_up_gives(subs: list[str], topic: str, qid: int) -> None:
    """``QueueSendKeys`` encodes each subscription's payload once and appends the send's token: the
    bytes must be ``WakeUp.encode()``'s own for any names (quotes, backslashes, non-ASCII), and a
    new subscription list (``SUBS_TTL``) must give its own keys and payloads."""
    mq = MessageQueue(topic, "broker-a", qid)
    qk = QueueSendKeys(mq, on_cluster=False)
    for token, subs_now in (("ab12", subs), ("cd34", [*subs, "later"])):
        state_keys, args = qk.wake_tail(list(subs_now), token)
        assert state_keys == [keys.sub_state(mq.tag, s) for s in subs_now]
        expected: list[object] = []
        for i, s in enumerate(subs_now):
            expected += [f"{token}.{i}", WakeUp(s, mq.key, f"{token}.{i}").encode()]
        assert args == expected


@pytest.mark.parametrize("junk", [b"", b"a\x1fb\x1fc", b"[1,2,3]", b'["a","b"]', b"\xff"])
def test_a_stranger_on_the_wake_channel_is_refused_clearly(junk: bytes) -> None:
    with pytest.raises(ValueError, match="not a wake-up payload"):
        WakeUp.decode(junk)

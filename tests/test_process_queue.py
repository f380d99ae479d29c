"""Unit tests of ProcessQueue, the client-side snapshot of one message queue (no Redis, no Celery)."""

from __future__ import annotations

import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mqorder.model import MessageExt
from mqorder.process_queue import ProcessQueue


def msg(offset: int, body: bytes | None = None) -> MessageExt:
    if body is None:
        body = b"x" * (offset % 7 + 1)
    return MessageExt(f"id-{offset}", "T", "broker-a", 0, offset, body, [], None, {}, 0, 0)


def msgs(*offsets: int) -> list[MessageExt]:
    return [msg(o) for o in offsets]


def offsets(ms: list[MessageExt]) -> list[int]:
    return [m.queue_offset for m in ms]


# -- ordering -------------------------------------------------------------------------------------


def test_take_returns_lowest_offsets_first_even_when_put_out_of_order() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(5, 1, 3))
    pq.put_messages(msgs(4, 2))
    assert offsets(pq.take_messages(2)) == [1, 2]
    assert offsets(pq.take_messages(10)) == [3, 4, 5]
    assert pq.take_messages(10) == []


def test_take_hands_out_the_same_message_objects_that_were_put() -> None:
    pq = ProcessQueue()
    m = msg(7, b"payload")
    pq.put_messages([m])
    assert pq.take_messages(1)[0] is m


# -- commit ---------------------------------------------------------------------------------------


def test_commit_returns_max_consumed_offset_plus_one() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(10, 11, 12, 13))
    pq.take_messages(3)
    assert pq.commit() == 13
    pq.take_messages(3)
    assert pq.commit() == 14


def test_commit_with_nothing_consuming_returns_minus_one() -> None:
    pq = ProcessQueue()
    assert pq.commit() == -1
    pq.put_messages(msgs(0, 1))
    assert pq.commit() == -1  # put but not taken
    pq.take_messages(2)
    assert pq.commit() == 2
    assert pq.commit() == -1  # already committed


def test_msg_count_and_size_follow_put_take_and_commit() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(0, b"a"), msg(1, b"bb"), msg(2, b"cccc")])
    assert (pq.msg_count, pq.msg_size, pq.queue_offset_max) == (3, 7, 2)
    pq.take_messages(2)
    assert (pq.msg_count, pq.msg_size) == (3, 7)  # taken but not committed still counts
    pq.commit()
    assert (pq.msg_count, pq.msg_size) == (1, 4)
    pq.take_messages(5)
    pq.commit()
    assert (pq.msg_count, pq.msg_size) == (0, 0)
    assert pq.queue_offset_max == 2


# -- putting messages back ------------------------------------------------------------------------


def test_rollback_puts_consuming_back_and_they_are_taken_again_first() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(0, 1, 2, 3, 4))
    assert offsets(pq.take_messages(2)) == [0, 1]
    pq.rollback()
    assert pq.consuming == {}
    assert pq.commit() == -1
    assert (pq.msg_count, pq.msg_size) == (5, sum(len(m.body) for m in msgs(0, 1, 2, 3, 4)))
    assert offsets(pq.take_messages(3)) == [0, 1, 2]


def test_suspended_message_blocks_later_offsets() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(*range(10)))
    batch = pq.take_messages(3)
    assert offsets(batch) == [0, 1, 2]
    pq.make_message_to_consume_again(batch)
    pq.put_messages(msgs(10, 11, 12))  # a pull lands meanwhile
    assert pq.commit() == -1  # nothing of the suspended batch may be committed
    assert offsets(pq.take_messages(1)) == [0]
    assert offsets(pq.take_messages(100)) == list(range(1, 13))


def test_partial_consume_again_keeps_commit_below_requeued_offsets() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(0, 1, 2, 3))
    batch = pq.take_messages(3)
    pq.make_message_to_consume_again(batch[1:])  # offsets 1 and 2 go back, 0 stays consuming
    assert pq.commit() == 1
    assert offsets(pq.take_messages(10)) == [1, 2, 3]


# -- put_messages ---------------------------------------------------------------------------------


def test_duplicate_offsets_in_put_messages_are_ignored() -> None:
    pq = ProcessQueue()
    first = msg(1, b"first")
    pq.put_messages([first, msg(1, b"second"), msg(2, b"zz")])
    assert (pq.msg_count, pq.msg_size) == (2, len(b"first") + 2)
    pq.put_messages([msg(1, b"third"), msg(2, b"again")])  # already pending
    assert (pq.msg_count, pq.msg_size) == (2, len(b"first") + 2)
    taken = pq.take_messages(1)
    assert taken[0] is first
    pq.put_messages([msg(1, b"fourth")])  # already consuming
    assert (pq.msg_count, pq.msg_size) == (2, len(b"first") + 2)
    assert offsets(pq.take_messages(10)) == [2]


# -- flow control, lock expiry, clear -------------------------------------------------------------


def test_is_full_at_pull_threshold_for_queue() -> None:
    threshold = 1000  # the settings default of pull_threshold_for_queue
    pq = ProcessQueue()
    pq.put_messages(msgs(*range(threshold - 1)))
    assert not pq.is_full(threshold)
    pq.put_messages(msgs(threshold - 1))
    assert pq.is_full(threshold)
    pq.take_messages(1)
    assert pq.is_full(threshold)  # taken but uncommitted messages still count
    pq.commit()
    assert not pq.is_full(threshold)


def test_is_full_on_size_threshold() -> None:
    pq = ProcessQueue()
    pq.put_messages([msg(0, b"x" * 600)])
    assert not pq.is_full(1000, 1000)
    assert not pq.is_full(1000)  # no size threshold given
    pq.put_messages([msg(1, b"x" * 400)])
    assert pq.is_full(1000, 1000)


def test_lock_expires_after_lock_expire_ms() -> None:
    pq = ProcessQueue(lock_expire_ms=20)
    pq.mark_locked()
    assert not pq.is_lock_expired()
    time.sleep(0.05)
    assert pq.is_lock_expired()
    pq.mark_locked()
    assert not pq.is_lock_expired()


def test_lock_does_not_expire_within_default_lifetime() -> None:
    pq = ProcessQueue()
    pq.mark_locked()
    time.sleep(0.05)
    assert not pq.is_lock_expired()


def test_clear_forgets_everything() -> None:
    pq = ProcessQueue()
    pq.put_messages(msgs(0, 1, 2, 3))
    pq.take_messages(2)
    pq.clear()
    assert (pq.msg_count, pq.msg_size, pq.queue_offset_max) == (0, 0, -1)
    assert not pq.msg_tree and not pq.consuming
    assert pq.commit() == -1
    assert pq.take_messages(10) == []
    pq.put_messages(msgs(2))
    assert offsets(pq.take_messages(10)) == [2]


# -- model-based property -------------------------------------------------------------------------


class ProcessQueueMachine(RuleBasedStateMachine):
    """Drives a ProcessQueue and a trivially correct model side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.pq = ProcessQueue()
        self.pending: dict[int, MessageExt] = {}  # put, not handed out
        self.consuming: dict[int, MessageExt] = {}  # handed out, not committed
        self.requeued: set[int] = set()

    @rule(offs=st.lists(st.integers(0, 60), max_size=8))
    def put(self, offs: list[int]) -> None:
        batch = msgs(*offs)
        self.pq.put_messages(batch)
        for m in batch:
            if m.queue_offset not in self.pending and m.queue_offset not in self.consuming:
                self.pending[m.queue_offset] = m

    @rule(k=st.integers(1, 6))
    def take(self, k: int) -> None:
        got = offsets(self.pq.take_messages(k))
        expected = sorted(self.pending)[:k]
        assert got == expected
        if self.requeued and got:
            # after a make_again, the next take starts at the smallest offset not handed out, which
            # is never later than the smallest message put back
            assert got[0] == min(self.pending)
            assert got[0] <= min(self.requeued)
            assert min(self.requeued) in got or len(got) == k
        self.requeued = set()
        for o in got:
            self.consuming[o] = self.pending.pop(o)

    @rule()
    def commit(self) -> None:
        expected = max(self.consuming) + 1 if self.consuming else -1
        assert self.pq.commit() == expected
        self.consuming.clear()

    @precondition(lambda self: self.consuming)
    @rule()
    def make_again_whole_batch(self) -> None:
        outstanding = min([*self.pending, *self.consuming])
        self.pq.make_message_to_consume_again(list(self.consuming.values()))
        self.requeued = set(self.consuming)
        self.pending.update(self.consuming)
        self.consuming.clear()
        # nothing is consuming, so the next message handed out is the lowest uncommitted one
        assert self.pq.offsets()[0] == outstanding

    @precondition(lambda self: self.consuming)
    @rule(data=st.data())
    def make_again_some(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.consuming)), min_size=1, unique=True))
        self.pq.make_message_to_consume_again([self.consuming[o] for o in chosen])
        for o in chosen:
            self.pending[o] = self.consuming.pop(o)
        self.requeued = set(chosen)

    @rule()
    def rollback(self) -> None:
        self.pq.rollback()
        self.pending.update(self.consuming)
        self.consuming.clear()

    @invariant()
    def bookkeeping_matches_model(self) -> None:
        held = {**self.pending, **self.consuming}
        assert self.pq.msg_count == len(held)
        assert self.pq.msg_size == sum(len(m.body) for m in held.values())
        assert self.pq.offsets() == sorted(self.pending)
        assert sorted(self.pq.msg_tree) == sorted(self.pending)
        assert sorted(self.pq.consuming) == sorted(self.consuming)


ProcessQueueMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_process_queue_model = ProcessQueueMachine.TestCase

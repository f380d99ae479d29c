"""The chaos suite inside ``make test``.

* A short smoke: the same runner and checker as ``make chaos``, one combined run (3 prefork
  workers, beat, ~20 s of traffic at 300 msg/s, one ``kill -9`` of a queue owner with a restart,
  two deletions of the Celery direct queues).
* The checker fed records with an injected violation (overlapping calls, an offset out of order,
  a call after its run's commit was refused, a stale call with no refusal, a beat that sent
  nothing) still reports it; the fencing records come from a real engine run whose commit Redis
  refused, written by the chaos listener and its ``consume_refused`` hook.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from chaos import listeners, records
from chaos.checker import Result, RunData, check
from chaos.evidence import Event
from chaos.records import Entry, Published, Refusal
from chaos.scenarios import SMOKE, run
from chaos.traffic import Ack
from mqorder import Producer
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import get_listener
from mqorder.model import MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager

pytestmark = pytest.mark.chaos_smoke

MQ = MessageQueue(listeners.TOPIC, "broker-a", 0)


@pytest.mark.timeout(150)
def test_chaos_smoke_kill_and_lost_tasks_keep_order_and_lose_nothing() -> None:
    t0 = time.monotonic()
    res = run(SMOKE, drain_timeout=40)
    assert res.produced > 3000
    assert res.violations == []
    assert res.lost == []
    assert res.dup_unexplained == []
    assert res.overlaps_forbidden == []
    assert res.calls_after_refusal == []
    assert res.fault_kinds.get("kill") == 1 and res.fault_kinds.get("delete-tasks") == 2
    assert res.failovers and not res.no_failover
    assert res.problems == []
    assert time.monotonic() - t0 < 90


# -- the checker on records with injected violations ----------------------------------------------


def call(run_id: str, offset: int, start: float, *, epoch: int = 1, client: str = "c1", pid: int = 1,
         still_owner: bool | None = True, queue: int = 0, seq: int | None = None) -> Entry:
    """One listener call of one message of key ``k<queue>`` (seq = offset + 1), 0.5 s long."""
    return Entry(key=f"k{queue}", seq=offset + 1 if seq is None else seq, queue=queue, offset=offset, epoch=epoch,
                 client=client, pid=pid, start=start, end=start + 0.5, reconsume=0, status=records.SUCCESS,
                 still_owner=still_owner, run=run_id)


def refusal(run_id: str, at: float, *, epoch: int = 1, reason: str = records.FENCED, queue: int = 0) -> Refusal:
    return Refusal(group=listeners.GROUP, topic=listeners.TOPIC, queue=queue, client="c1", pid=1, run=run_id,
                   epoch=epoch, reason=reason, current_epoch=epoch + 1, current_owner="c2", offset=0, at=at)


def checked(entries: list[Entry], refusals: list[Refusal] = (), **kw: Any) -> Result:  # type: ignore[assignment]
    """The checker over ``entries``, every (key, seq) of which was acknowledged (nothing lost)."""
    acks = {(e.key, e.seq): Ack(e.key, e.seq, e.queue, e.offset, 0.0) for e in entries}
    data = RunData(
        scenario="t", fsync="always", entries=entries, acks=list(acks.values()), unknown=[], poison=[], dlq=[],
        events=kw.pop("events", []), samples=kw.pop("samples", []), refusals=list(refusals), published=kw.pop("published", []),
        beats=kw.pop("beats", []), drained=True, batch=32, max_reconsume=3, suspend_s=1.0, **kw,
    )
    return check(data)


def test_checker_passes_a_clean_handover_between_epochs() -> None:
    res = checked([call("a", 0, 10.0), call("a", 1, 10.6), call("b", 2, 12.0, epoch=2, client="c2", pid=2)])
    assert res.problems == [] and res.handled == 3 and res.overlaps == 0


def test_checker_reports_two_overlapping_calls_of_one_queue() -> None:
    res = checked([call("a", 0, 10.0), call("b", 1, 10.2, client="c2", pid=2)])
    assert res.overlaps == 1 and len(res.overlaps_forbidden) == 1
    assert "both at epoch 1" in res.overlaps_forbidden[0]
    assert not res.passed


def test_an_overlap_is_allowed_only_with_a_refusal_record_and_a_stale_still_owner() -> None:
    stale, new = call("a", 0, 10.0, still_owner=False), call("b", 1, 10.2, epoch=2, client="c2", pid=2)
    ok = checked([stale, new], [refusal("a", 10.6)])
    assert (ok.overlaps_allowed, ok.stale_commit_refused, ok.stale_refused_own_run) == (1, 1, 1)
    assert ok.problems == [] and ok.refusals == {"FENCED": 1}

    unrefused = checked([stale, new])
    assert len(unrefused.overlaps_forbidden) == 1 and "no refused commit recorded" in unrefused.overlaps_forbidden[0]
    assert any("whose commit was not refused" in p for p in unrefused.problems)

    blind = checked([dataclasses.replace(stale, still_owner=True), new], [refusal("a", 10.6)])
    assert any("ctx.still_owner() said True" in p for p in blind.problems)

    backward_only = checked([stale, new], [refusal("a", 10.6, reason=records.BACKWARD)])
    assert backward_only.overlaps_forbidden and backward_only.refusals == {"BACKWARD": 1}


def test_a_same_epoch_overlap_needs_a_superseded_record_after_the_older_call_started() -> None:
    # Two runs of the one owner at one epoch (the sweep replaced the first one's token): another
    # pool process of the same client. Two clients at one epoch are never allowed (test_chaos_failover).
    older, newer = call("a", 0, 10.0, still_owner=False), call("b", 1, 10.2, pid=2)
    assert checked([older, newer], [refusal("a", 10.4, reason=records.SUPERSEDED)]).problems == []
    late = checked([older, newer], [refusal("a", 9.0, reason=records.SUPERSEDED)])
    assert late.overlaps_forbidden and not late.passed


def test_checker_reports_an_offset_out_of_order_in_one_run() -> None:
    res = checked([call("a", 0, 10.0), call("a", 2, 10.6), call("a", 1, 11.2)])
    assert any("run a on queue 0: offset 1 (epoch 1) handed out after offset 2" in v for v in res.violations)
    assert any("key k0: seq 3 handled" in v for v in res.violations)
    assert not res.passed


def test_checker_reports_a_call_of_a_run_after_its_commit_was_refused() -> None:
    res = checked([call("a", 0, 10.0), call("a", 1, 11.0)], [refusal("a", 10.7)])
    assert len(res.calls_after_refusal) == 1 and "offset 1" in res.calls_after_refusal[0]
    assert not res.passed
    assert checked([call("a", 0, 10.0), call("a", 1, 11.0)], [refusal("a", 11.6)]).problems == []


def test_beat_check_counts_rebalances_from_each_beats_publish_records() -> None:
    entries = [call("a", i, 10.0 + i) for i in range(12)]
    events = [Event(11.0, "beat-kill", "beat"), Event(16.0, "beat-start", "beat", fault=False)]
    sent = [Published("beat0", "mqorder.rebalance", 7, 10.5), Published("beat1", "mqorder.lock_all", 8, 17.0)]
    silent = checked(entries, events=events, published=sent, beats=["beat0", "beat1"], enforce={"beat"})
    assert silent.beat["rebalances_sent_per_beat"] == [1, 0]
    assert any("sent no rebalance" in p for p in silent.problems)
    sent.append(Published("beat1", "mqorder.rebalance", 8, 18.0))
    again = checked(entries, events=events, published=sent, beats=["beat0", "beat1"], enforce={"beat"})
    assert again.beat["rebalances_sent_per_beat"] == [1, 1] and again.problems == []


# -- records written by a real engine run --------------------------------------------------------


def test_a_refused_commit_is_recorded_by_the_hook_and_proves_the_overlap(settings, chaos_ledger) -> None:
    p = Producer(settings=settings)
    p.create_topic(listeners.TOPIC, queues=1)
    for s in (1, 2, 3):
        p.send_orderly(listeners.TOPIC, f'{{"k": "k0", "s": {s}}}'.encode(), sharding_key="k0")
    p.close()
    eng = ConsumerEngine(settings, "c1")
    locks = RebalanceLockManager(eng.brokers)
    spec = get_listener(listeners.GROUP, listeners.TOPIC)
    assert spec is not None and any(isinstance(h, listeners.RefusalRecorder) for h in spec.hooks)

    def handover_then_handle(msgs, ctx):
        if msgs[0].queue_offset == 1:  # the queue moves to c2 while c1's run is in its second call
            locks.assign(listeners.GROUP, [(MQ, "c2", "other")], dead_clients=["c1"])
        return listeners.handle(msgs, ctx)

    assert locks.assign(listeners.GROUP, [(MQ, "c1", "tok0")])[MQ] == "DISPATCH"
    try:
        ConsumeRequest(eng, dataclasses.replace(spec, func=handover_then_handle), listeners.GROUP, MQ, "tok0").run()
    finally:
        eng.brokers.close()
    entries = records.read_all(chaos_ledger.lrange(records.LEDGER, 0, -1), Entry)
    (rec,) = records.read_all(chaos_ledger.lrange(records.REFUSALS, 0, -1), Refusal)

    assert [e.offset for e in entries] == [0, 1, 2] and {e.run for e in entries} == {rec.run} != {""}
    assert [e.still_owner for e in entries] == [True, False, False]
    assert (rec.reason, rec.client, rec.current_owner) == ("FENCED", "c1", "c2") and rec.current_epoch > rec.epoch
    assert {e.epoch for e in entries} == {rec.epoch} and rec.at >= entries[-1].end
    assert checked(entries, [rec]).problems == []

    # c2 redelivers offset 1 while c1's call on it is still running: allowed only thanks to the record.
    stale = entries[1]
    redelivery = call("r2", 1, stale.start + 0.001, epoch=rec.current_epoch, client="c2", pid=2, seq=2)
    allowed = checked([*entries, redelivery], [rec])
    assert allowed.overlaps_allowed >= 1 and allowed.overlaps_forbidden == []
    assert checked([*entries, redelivery]).overlaps_forbidden

    # The refused run handing out one more message: a commit after the refusal.
    after = dataclasses.replace(entries[-1], offset=3, seq=4, start=rec.at + 0.01, end=rec.at + 0.02)
    assert checked([*entries, after], [rec]).calls_after_refusal

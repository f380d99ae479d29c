"""The chaos checker's rules for failovers of the Redis primary (``chaos.failover_checks``), fed
records with and without the faults they must catch; and how the report shows a Sentinel row.

No Redis here: the records are built by hand, as the listener and the faults write them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import redis

from chaos import listeners, records, report
from chaos.checker import DUP_WINDOW, Result, RunData, check
from chaos.evidence import Event, Sample
from chaos.failover_checks import REPLICATION_WINDOW
from chaos.records import Entry, Refusal
from chaos.runner import last_error
from chaos.traffic import Ack, why
from mqorder.errors import BrokerRefusedError, ReplicasBehindError

#: The primary is killed at T; Sentinel's new primary answers 3 s later.
T = 1000.0


def call(key: str, seq: int, offset: int, start: float, *, queue: int = 0, epoch: int = 1, client: str = "c1",
         pid: int = 1, run: str = "a", still_owner: bool | None = True, length: float = 0.01) -> Entry:
    return Entry(key=key, seq=seq, queue=queue, offset=offset, epoch=epoch, client=client, pid=pid, start=start,
                 end=start + length, reconsume=0, status=records.SUCCESS, still_owner=still_owner, run=run)


def kill(t: float = T, **info: Any) -> Event:
    """A ``primary-kill`` event as ``Faults.kill_primary`` records it."""
    return Event(t, "primary-kill", "node-0:1", t_end=t + 10, info={"lost_at": t, "promoted_at": t + 3,
                                                                    "promoted_s": 3.0, **info})


def checked(entries: list[Entry], acks: list[Ack], *, events: list[Event], refusals: list[Refusal] = (),  # type: ignore[assignment]
            samples: list[Sample] = (), send_wait: int = 1, **kw: Any) -> Result:  # type: ignore[assignment]
    data = RunData(
        scenario="t", fsync="everysec", entries=entries, acks=acks, unknown=kw.pop("unknown", []), poison=[], dlq=[],
        events=events, samples=list(samples), refusals=list(refusals), published=[], beats=[], drained=True,
        batch=32, max_reconsume=3, suspend_s=1.0, send_wait=send_wait, **kw,
    )
    return check(data)


def ack(key: str, seq: int, offset: int, t: float, queue: int = 0) -> Ack:
    return Ack(key, seq, queue, offset, t)


def steady(until: float, *, queue: int = 0, key: str = "k0", start: float = T - 5, step: float = 0.2,
           epoch: int = 1, client: str = "c1", run: str = "a") -> tuple[list[Entry], list[Ack]]:
    """Messages of one key, each acknowledged and handled 10 ms later, from ``start`` to ``until``."""
    entries, acks = [], []
    t, n = start, 0
    while t < until:
        n += 1
        acks.append(ack(key, n, n - 1, t, queue))
        entries.append(call(key, n, n - 1, t + 0.01, queue=queue, epoch=epoch, client=client, run=run))
        t += step
    return entries, acks


# -- loss windows ----------------------------------------------------------------------------------


def test_a_send_acknowledged_without_waiting_right_before_the_kill_may_be_lost_and_is_counted_apart() -> None:
    before, acks = steady(T)
    lost = ack("k0", len(acks) + 1, len(acks), T - 0.1)  # acknowledged, then gone with the primary
    after = [call("k0", lost.seq + 1, lost.offset, T + 5, epoch=2, client="c2", run="b")]
    acks += [lost, ack("k0", lost.seq + 1, lost.offset, T + 4.9)]
    res = checked(before + after, acks, events=[kill()], send_wait=0)
    assert len(res.lost_replication) == 1 and res.lost == [] and res.replication_gaps == 1
    assert res.violations == [] and res.problems == []

    # The same loss with sends that waited for a replica is a loss, and its gap an order violation.
    waited = checked(before + after, acks, events=[kill()], send_wait=1)
    assert len(waited.lost) == 1 and waited.lost_replication == [] and waited.violations
    assert not waited.passed


def test_the_replication_window_is_only_the_last_second_before_the_primary_was_lost() -> None:
    before, acks = steady(T - 3)
    early = ack("k0", len(acks) + 1, len(acks), T - 1 - REPLICATION_WINDOW - 0.5)  # not in the last second
    acks += [early, ack("k9", 1, 0, T - 0.05, queue=1)]  # the last ack before the kill
    res = checked(before + [call("k9", 1, 0, T + 5, queue=1, run="z")], acks, events=[kill()], send_wait=0)
    assert len(res.lost) == 1 and "k0#" in res.lost[0] and res.lost_replication == []


def test_after_a_failover_to_a_stale_replica_every_ack_since_it_went_stale_is_in_the_window() -> None:
    before, acks = steady(T - 8, start=T - 15)
    stale_since = T - 8
    missed = [ack("k0", len(acks) + 1 + i, len(acks) + i, T - 7 + i) for i in range(5)]
    acks += missed
    res = checked(before, acks, events=[Event(stale_since, "replica-pause", "node-1:2", t_end=T),
                                        kill(stale_since=stale_since)], send_wait=1)
    assert len(res.lost_replication) == 5 and res.lost == [] and res.problems == []


# -- consumption resumed ------------------------------------------------------------------------------


def test_consumption_resumed_counts_new_messages_and_new_runs_not_a_run_still_calling_its_buffer() -> None:
    before, acks = steady(T)
    n = len(acks)
    buffered = call("k0", n + 1, n, T + 0.5)  # run "a" calls a message it read before the kill
    acks.append(ack("k0", n + 1, n, T - 0.02))
    resumed = call("k0", n + 2, n + 1, T + 6.0)  # same run, a message sent after the kill
    acks.append(ack("k0", n + 2, n + 1, T + 5.9))
    res = checked(before + [buffered, resumed], acks, events=[kill()], enforce={"redis_failover"})
    assert res.redis_failovers == [6.0] and res.problems == []
    (ev,) = res.redis_failover_events
    assert ev["send_resumed_s"] == 5.9 and ev["resumed_max_s"] == 6.0 and ev["never"] == []

    new_run = dataclasses.replace(buffered, start=T + 4.0, run="b")  # a run started after the kill
    assert checked(before + [new_run, resumed], acks, events=[kill()]).redis_failovers == [4.0]


def test_consumption_resumed_over_the_target_or_never_fails_the_run() -> None:
    before, acks = steady(T)
    n = len(acks)
    acks.append(ack("k0", n + 1, n, T + 11.9))
    late = checked(before + [call("k0", n + 1, n, T + 12.0, run="b")], acks, events=[kill()],
                   enforce={"redis_failover"})
    assert any("over the 10s target" in p for p in late.problems)
    never = checked(before, acks[:-1] + [ack("k1", 1, 0, T + 2, queue=1)],
                    events=[kill()], enforce={"redis_failover"})
    assert any("had no listener call after the primary-kill" in p for p in never.problems)
    # A queue that resumes only after the next failover did resume: its figure runs to that call.
    acks2 = [*acks[:-1], ack("k1", 1, 0, T + 2, queue=1)]
    later = [*before, call("k1", 1, 0, T + 40, queue=1, run="q")]
    res = checked(later, acks2, events=[kill(), kill(T + 30)])
    assert [e["resumed_max_s"] for e in res.redis_failover_events] == [40.0, 10.0]
    assert not any("no listener call" in p for p in res.problems)


# -- the fence ----------------------------------------------------------------------------------------


def test_an_epoch_first_used_after_a_promotion_must_be_above_every_epoch_used_before_it() -> None:
    before, acks = steady(T, epoch=50)
    n = len(acks)
    acks.append(ack("k0", n + 1, n, T + 4.9))
    above = call("k0", n + 1, n, T + 5, epoch=60, client="c2", run="b")
    ok = checked(before + [above], acks, events=[kill()])
    assert ok.fence["new_epochs"] == 1 and ok.fence["below_count"] == 0 and ok.problems == []
    below = checked(before + [dataclasses.replace(above, epoch=40)], acks, events=[kill()])
    assert below.fence["below_count"] == 1 and any("at or below one used before it" in p for p in below.problems)


def test_one_epoch_of_a_queue_used_by_two_clients_is_a_violation_with_or_without_a_failover() -> None:
    res = checked([call("k0", 1, 0, 10.0), call("k0", 2, 1, 20.0, client="c2", pid=2, run="b")],
                  [ack("k0", 1, 0, 9.0), ack("k0", 2, 1, 19.0)], events=[])
    assert any("used by two clients" in p for p in res.problems)
    # The same two clients at two epochs: a handover, nothing to say.
    assert checked([call("k0", 1, 0, 10.0), call("k0", 2, 1, 20.0, epoch=2, client="c2", pid=2, run="b")],
                   [ack("k0", 1, 0, 9.0), ack("k0", 2, 1, 19.0)], events=[]).problems == []


def test_a_lost_grant_seen_again_in_the_lock_table_after_the_promotion_is_a_violation() -> None:
    before, acks = steady(T, epoch=70)
    lost = kill(lost_grants=[{"queue": 0, "owner": "c1", "epoch": 70, "kept_owner": "c0", "kept_epoch": 60}],
                lost_commits=1, lost_appends=3)
    sample: Sample = (T + 5, 0, "c1", 70, 0, 0, 0, "", 0, 0)
    res = checked(before, acks, events=[lost], samples=[sample])
    assert res.fence["lost_grants"] == 1 and res.fence["lost_appends"] == 3
    assert any("lost lock grant(s) back in the lock table" in p for p in res.problems)
    kept: Sample = (T + 5, 0, "c0", 80, 0, 0, 0, "", 0, 0)  # a new grant above the lost one
    clean = checked(before, acks, events=[lost], samples=[kept])
    assert clean.problems == [] and clean.fence["reappeared"] == []


# -- redeliveries, overlaps, offsets --------------------------------------------------------------------


def test_a_message_handled_in_the_loss_window_may_be_redelivered_however_late_its_queue_resumes() -> None:
    before, acks = steady(T)
    last = before[-1]
    assert T - last.start < REPLICATION_WINDOW
    late = DUP_WINDOW + 30  # the queue resumed long after the failover (a lease left to lapse)
    again = dataclasses.replace(last, start=T + late, epoch=2, client="c2", run="b")
    res = checked(before + [again], acks, events=[kill()], send_wait=0)
    assert res.dup_failover == 1 and res.dup_unexplained == [] and res.problems == []
    # Handled long before the kill: its commit cannot have been lost; the redelivery is unexplained.
    old = dataclasses.replace(before[0], start=T + late, epoch=2, client="c2", run="b")
    assert checked(before + [old], acks, events=[kill()], send_wait=0).dup_unexplained


def test_overlaps_at_one_epoch_are_counted_and_fail_a_sentinel_row_two_epochs_after_a_failover_do_not() -> None:
    first = call("k0", 1, 0, T + 4.0, length=1.0, still_owner=False, run="a")
    second = call("k0", 2, 1, T + 4.5, epoch=2, client="c2", pid=2, run="b")
    acks = [ack("k0", 1, 0, T + 3.5), ack("k0", 2, 1, T + 4.4)]
    fenced = [Refusal(group=listeners.GROUP, topic=listeners.TOPIC, queue=0, client="c1", pid=1, run="a", epoch=1,
                      reason=records.FENCED, current_epoch=2, current_owner="c2", offset=1, at=T + 5.1)]
    two = checked([first, second], acks, events=[kill()], refusals=fenced, enforce={"no_same_epoch_overlap"})
    assert (two.overlaps, two.overlaps_allowed, two.failover_overlaps, two.same_epoch_overlaps) == (1, 1, 1, 0)
    assert two.problems == []
    same = checked([first, dataclasses.replace(second, epoch=1)], acks, events=[kill()], refusals=fenced,
                   enforce={"no_same_epoch_overlap"})
    assert same.same_epoch_overlaps == 1
    assert any("at one epoch" in p for p in same.problems) and same.overlaps_forbidden


def test_a_committed_offset_lower_after_a_failover_is_a_note_not_a_violation() -> None:
    before, acks = steady(T)
    s1: Sample = (T - 1, 0, "c1", 1, 0, 20, 0, "", 0, 0)
    s2: Sample = (T + 4, 0, "c1", 1, 0, 18, 0, "", 0, 0)
    res = checked(before, acks, events=[kill()], samples=[s1, s2])
    assert res.offset_backward == [] and any("across a Redis failover" in n for n in res.notes)
    plain = checked(before, acks, events=[], samples=[s1, s2])
    assert plain.offset_backward and not plain.passed


# -- unknown sends and the report ------------------------------------------------------------------------


def test_an_unknown_send_names_the_refusal_redis_gave() -> None:
    assert why(BrokerRefusedError("send failed: ... refused the write: NOREPLICAS Not enough good replicas")) == \
        "BrokerRefusedError:NOREPLICAS"
    assert why(redis.ReadOnlyError("READONLY You can't write against a read only replica.")) == "ReadOnlyError:READONLY"
    assert why(ReplicasBehindError("only 0 of 1 replica acknowledged")) == "ReplicasBehindError"


def test_the_report_shows_a_sentinel_row_with_its_failover_figures_and_fence() -> None:
    before, acks = steady(T)
    n = len(acks)
    acks.append(ack("k0", n + 1, n, T + 4.9))
    res = checked(before + [call("k0", n + 1, n, T + 5, epoch=9, client="c2", run="b")], acks, events=[kill()],
                  unknown=[("k0", n + 1, T + 1, "MasterNotFoundError")])
    d = report.compact(res, title="t", env={}, quick=False, seconds=60, sentinel={"wait_replicas (sends)": "1"})
    row = report._row(d)
    assert "5.00‡" in row and "| pass |" in row
    text = "\n".join(report._details(d))
    assert "settings: wait_replicas (sends) 1" in text
    assert "primary-kill 1 of node-0:1: Sentinel's new primary answered after 3.00 s" in text
    assert "MasterNotFoundError 1" in text and "fence: 1 epochs first used" in text
    assert "sentinel-async" in report.render({"sentinel-async": {**d, "scenario": "sentinel-async"}})


def test_a_worker_that_died_by_itself_is_reported_with_the_last_exception_its_log_shows(tmp_path: Path) -> None:
    log = tmp_path / "w1.log"
    log.write_text("[..: CRITICAL/MainProcess] Unrecoverable error: server:ResponseError\nTraceback (most recent call last):\n"
                   '  File "kombu/transport/redis.py", line 1479, in _brpop_read\n'
                   "redis.exceptions.ResponseError: NOREPLICAS Not enough good replicas to write.\n")
    assert last_error(log) == "redis.exceptions.ResponseError: NOREPLICAS Not enough good replicas to write."
    assert last_error(tmp_path / "missing.log") == ""
    crash = Event(T, "crash", "w1", fault=False, info={"returncode": 1, "last_error": last_error(log)})
    before, acks = steady(T)
    res = checked(before, acks, events=[crash])
    assert res.crashes == [f"w1 exited by itself (code 1) at {T:.3f}: {last_error(log)}"] and not res.passed

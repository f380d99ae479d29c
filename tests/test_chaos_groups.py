"""The chaos suite with several consumer groups in the same workers (``groups-kill``): each group's
listener records apart, the lock table of each group is sampled apart, the faults name each
group's queues, the checker judges every group alike and fails the run with any of them, and the
report gives each group a row (the scenario itself runs in ``make chaos``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from chaos import listeners, records, report
from chaos.checker import Result, RunData, check, group_events, merge_groups
from chaos.evidence import Event, Monitor
from chaos.records import Entry, Refusal
from chaos.scenarios import SCENARIOS, _group_data, groups_kill, switch_note
from chaos.traffic import EXTRA_KEY_PREFIX, EXTRA_RATE_SHARE, Ack, Traffic
from mqorder import keys
from mqorder.consumer.context import ConsumeOrderlyContext
from mqorder.consumer.listener import get_listener
from mqorder.model import MessageExt, MessageQueue
from mqorder.testing import isolated_listeners

pytestmark = pytest.mark.chaos_smoke

T = 1000.0
B, C = "chaos-b", "chaos-c"


def call(key: str, seq: int, queue: int, start: float, *, client: str = "c1", pid: int = 1, epoch: int = 1,
         run: str = "a") -> Entry:
    return Entry(key=key, seq=seq, queue=queue, offset=seq - 1, epoch=epoch, client=client, pid=pid, start=start,
                 end=start + 0.01, reconsume=0, status=records.SUCCESS, still_owner=True, run=run)


def data(entries: list[Entry], *, acks: list[Ack] | None = None, group: str = "", **kw: Any) -> RunData:
    """RunData of one group whose every entry was acknowledged (unless ``acks`` says otherwise)."""
    if acks is None:
        acks = [Ack(e.key, e.seq, e.queue, e.offset, e.start - 0.01) for e in entries]
    return RunData(scenario="t", fsync="always", entries=entries, acks=acks, unknown=kw.pop("unknown", []), poison=[], dlq=[],
                   events=kw.pop("events", []), samples=[], refusals=kw.pop("refusals", []), published=[], beats=[],
                   drained=True, batch=32, max_reconsume=3, suspend_s=1.0, group=group, **kw)


def kill(queues: list[int], group_queues: dict[str, list[int]]) -> Event:
    """A ``kill`` of client c1 as ``Faults.kill_worker`` records it in a run with several groups."""
    return Event(T, "kill", "w1", queues=queues, info={"client": "c1", "group_queues": group_queues})


# -- the checker ----------------------------------------------------------------------------------


def test_group_events_name_each_groups_own_queues_and_leave_the_chaos_groups_and_other_faults() -> None:
    events = [kill([0, 1], {B: [2], C: [5, 7]}), Event(T + 7, "restart", "w1")]
    assert group_events(events, C)[0].queues == [5, 7] and group_events(events, B)[0].queues == [2]
    assert group_events(events, listeners.GROUP)[0].queues == [0, 1]
    assert group_events(events, C)[1] is events[1]
    assert events[0].queues == [0, 1]  # the run's own log is left as it was


def test_a_groups_failover_is_measured_over_the_queues_it_owned_not_the_chaos_groups() -> None:
    # c1 owned chaos-c's queue 5 (and chaos's 0 and 1); c2 takes queue 5 over 2.5 s after the kill.
    entries = [call("c0001", 1, 5, T - 1), call("c0001", 2, 5, T + 2.5, client="c2", pid=2, epoch=2, run="b")]
    events = [kill([0, 1], {C: [5]})]
    assert check(data(entries, events=group_events(events, C), group=C)).failovers == [2.5]
    blind = check(data(entries, events=events, group=C))  # judged over chaos's queue ids instead
    assert any("queue 0 never resumed" in p for p in blind.problems)


def test_a_message_never_sent_to_the_groups_topic_is_a_stranger_only_in_a_run_with_groups() -> None:
    # chaos-c's message run with the chaos group's listener: it lands in the chaos group's records.
    mine, stranger = call("k0001", 1, 0, T), call("c0001", 1, 0, T + 1, run="b")
    acks = [Ack("k0001", 1, 0, 0, T - 1)]
    res = check(data([mine, stranger], acks=acks, group=listeners.GROUP))
    assert len(res.strangers) == 1 and "c0001#1" in res.strangers[0]
    assert any("never sent to group chaos's topic" in p for p in res.problems)
    # A send that raised may be stored: not a stranger.
    unknown = check(data([mine, stranger], acks=acks, group=listeners.GROUP, unknown=[("c0001", 1, T, "x")]))
    assert unknown.strangers == []
    # A run of the chaos group alone keeps its checks as they were.
    assert check(data([mine, stranger], acks=acks)).strangers == []


def test_merge_groups_fails_the_run_with_any_groups_problem_named_by_its_group() -> None:
    main = check(data([call("k0001", 1, 0, T)], group=listeners.GROUP))
    lost = check(data([], acks=[Ack("k0001", 1, 0, 0, T)], group=B))
    fine = check(data([call("c0001", 1, 3, T)], group=C))
    assert main.passed and not lost.passed and fine.passed
    merged = merge_groups(main, {B: lost, C: fine})
    assert merged is main and merged.groups == {B: lost, C: fine} and not merged.passed
    assert merged.problems == [f"group {B}: {p}" for p in lost.problems]
    assert merged.handled == 1 and merged.lost == []  # the chaos group's own figures


def test_each_group_is_judged_by_its_own_refusals_acks_and_queues() -> None:
    # Overlapping calls of chaos's queue 0. chaos-b's FENCED record at that queue and epoch says
    # nothing of the chaos group's call, though the checker, which knows queues and epochs, would
    # take it for the proof: the chaos group is handed only its own.
    stale = dataclasses.replace(call("k0001", 1, 0, T), end=T + 0.5, still_owner=False)
    newer = call("k0001", 2, 0, T + 0.2, client="c2", pid=2, epoch=2, run="b")
    theirs = Refusal(group=B, topic=listeners.TOPIC, queue=0, client="c1", pid=1, run="x", epoch=1,
                     reason=records.FENCED, current_epoch=2, current_owner="c2", offset=0, at=T + 0.6)
    ours = dataclasses.replace(theirs, group=listeners.GROUP, run="a")
    mqs = [MessageQueue(listeners.TOPIC, "broker-a", 0)]
    traffic = Traffic("redis://localhost:1/0", None, mqs, rate=300, n_keys=5,  # type: ignore[arg-type]
                      groups={B: mqs, C: [MessageQueue(C, "broker-a", 0)]})
    traffic.producer.acks += [Ack("k0001", 1, 0, 0, T - 1), Ack("k0001", 2, 0, 1, T - 1)]
    traffic.others[C].acks.append(Ack("c0001", 1, 0, 0, T - 1))
    c = SimpleNamespace(traffic=traffic, evidence=SimpleNamespace(samples_of=lambda g: []))
    run = data([], acks=traffic.acks, refusals=[theirs, ours], events=[kill([0], {B: [], C: [0]})])

    mine = _group_data(run, listeners.GROUP, listeners.TOPIC, [stale, newer], [], c)  # type: ignore[arg-type]
    assert (mine.scenario, mine.group, mine.refusals) == ("t", listeners.GROUP, [ours])
    assert check(mine).overlaps_forbidden == []
    only_theirs = _group_data(dataclasses.replace(run, refusals=[theirs]), listeners.GROUP, listeners.TOPIC,
                              [stale, newer], [], c)  # type: ignore[arg-type]
    assert only_theirs.refusals == [] and check(only_theirs).overlaps_forbidden
    assert check(dataclasses.replace(only_theirs, refusals=[theirs])).overlaps_forbidden == []  # the confusion
    b = _group_data(run, B, listeners.TOPIC, [], [], c)  # type: ignore[arg-type]
    assert (b.scenario, b.refusals, b.acks, b.events[0].queues) == (f"t/{B}", [theirs], traffic.acks, [])
    own = _group_data(run, C, C, [], [], c)  # type: ignore[arg-type]
    assert (own.refusals, [a.key for a in own.acks], own.events[0].queues, own.poison) == ([], ["c0001"], [0], [])


# -- the scenario, traffic and monitor ------------------------------------------------------------


def test_groups_kill_runs_the_kill_timeline_with_the_extra_groups_and_no_other_scenario_does() -> None:
    sc = SCENARIOS["groups-kill"]
    assert sc.script is groups_kill and sc.enforce == SCENARIOS["kill"].enforce
    assert sc.groups == {B: listeners.TOPIC, C: C} == listeners.EXTRA_GROUPS
    assert [s.name for s in SCENARIOS.values() if s.groups] == ["groups-kill"]


TOPICS = {listeners.GROUP: listeners.TOPIC, **listeners.EXTRA_GROUPS}


def test_switch_note_counts_task_executions_that_ran_queues_of_several_groups() -> None:
    runners = {
        "t1/a": {(listeners.GROUP, 3), (B, 3)},  # one chaos queue in two groups: its shared stream
        "t2/b": {(listeners.GROUP, 3), (C, 3)},  # queue id 3 of two topics: two streams
        "t3/c": {(B, 1), (B, 2)},  # one group only
        "t4/d": {(listeners.GROUP, 0)},
    }
    note, crossed = switch_note(runners, TOPICS)
    assert crossed == 2
    assert note.startswith("task executions seen in the lock table: 4, of which 2 ran queues of two or more groups")
    assert f"{listeners.GROUP} and {B} 1, {listeners.GROUP} and {C} 1" in note
    assert "1 of them one queue in two groups of its topic" in note
    assert switch_note({"t3/c": {(B, 1), (B, 2)}}, TOPICS)[1] == 0


def test_traffic_sends_to_each_other_topic_with_keys_of_its_own() -> None:
    mqs = [MessageQueue(listeners.TOPIC, "broker-a", i) for i in range(2)]
    own = [MessageQueue(C, "broker-a", i) for i in range(2)]
    t = Traffic("redis://localhost:1/0", None, mqs, rate=300, n_keys=5,  # type: ignore[arg-type]
                groups={B: mqs, C: own})
    assert list(t.others) == [C]  # chaos-b reads the chaos topic's traffic
    other = t.others[C]
    assert other.topic == C and other.rate == 300 * EXTRA_RATE_SHARE
    assert other.keys[0] == f"{EXTRA_KEY_PREFIX}0000" and t.producer.keys[0] == "k0000"
    assert [p.topic for p in t.producers] == [listeners.TOPIC, C]
    assert Traffic("redis://localhost:1/0", None, mqs, rate=300, n_keys=5).others == {}  # type: ignore[arg-type]


def test_the_monitor_samples_each_groups_lock_table_apart(redis_url: str, r: redis.Redis) -> None:
    chaos_q = MessageQueue(listeners.TOPIC, "broker-a", 0)
    own_q = MessageQueue(C, "broker-a", 0)
    r.hset(keys.sub_state(chaos_q.tag, listeners.GROUP), mapping={"owner": "c1", "epoch": 3, "offset": 10})
    r.hset(keys.sub_state(chaos_q.tag, B), mapping={"owner": "c2", "epoch": 4, "offset": 7})
    r.hset(keys.sub_state(own_q.tag, C), mapping={"owner": "c3", "epoch": 5, "offset": 1, "runner": "t1/x"})
    r.hset(keys.sub_state(chaos_q.tag, B), "runner", "t1/x")
    m = Monitor(redis_url, [chaos_q], interval=0.05, groups={B: [chaos_q], C: [own_q]})
    m.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (m.samples and all(m.group_samples.values())):
            time.sleep(0.05)
    finally:
        m.stop_event.set()
        m.join(5)
    assert {(s[1], s[2], s[3], s[5]) for s in m.samples} == {(0, "c1", 3, 10)}
    assert {(s[1], s[2], s[3], s[5]) for s in m.group_samples[B]} == {(0, "c2", 4, 7)}
    assert {(s[1], s[2], s[3], s[5]) for s in m.group_samples[C]} == {(0, "c3", 5, 1)}
    assert m.runners == {"t1/x": {(B, 0), (C, 0)}}  # one task execution ran queues of two groups
    assert len(m.samples[0]) == 10  # the samples of every run, groups or not, keep their shape
    alone = Monitor(redis_url, [chaos_q])
    assert "runner" not in alone.fields  # a run of the chaos group alone samples what it did


# -- the listeners --------------------------------------------------------------------------------


def _msg(topic: str, key: str, seq: int) -> MessageExt:
    return MessageExt(msg_id="m", topic=topic, broker_name="broker-a", queue_id=2, queue_offset=seq - 1,
                      body=f'{{"k": "{key}", "s": {seq}}}'.encode(), keys=[], tags=None, properties={},
                      born_timestamp=0, store_timestamp=0)


def _ctx(topic: str, group: str) -> ConsumeOrderlyContext:
    return ConsumeOrderlyContext(MessageQueue(topic, "broker-a", 2), epoch=9, client_id="c1", group=group,
                                 still_owner=lambda: True, suspend_current_queue_time_millis=1000, run_id="r1")


def test_each_groups_listener_records_into_its_own_list(chaos_ledger: redis.Redis) -> None:
    with isolated_listeners():
        listeners._register_groups("queue")
        specs = {g: get_listener(g, t) for g, t in listeners.EXTRA_GROUPS.items()}
        assert all(s is not None and any(isinstance(h, listeners.RefusalRecorder) for h in s.hooks)
                   for s in specs.values())
        assert specs[B].func is not specs[C].func  # type: ignore[union-attr]
        for g, t in listeners.EXTRA_GROUPS.items():
            spec = specs[g]
            assert spec is not None
            spec.func([_msg(t, f"{g}-key", 1)], _ctx(t, g))
    listeners.handle([_msg(listeners.TOPIC, "k0001", 1)], _ctx(listeners.TOPIC, listeners.GROUP))
    got = {name: records.read_all(chaos_ledger.lrange(name, 0, -1), Entry)
           for name in (records.LEDGER, records.group_ledger(B), records.group_ledger(C))}
    assert [e.key for e in got[records.LEDGER]] == ["k0001"]
    assert [(e.key, e.epoch, e.run, e.queue) for e in got[records.group_ledger(B)]] == [(f"{B}-key", 9, "r1", 2)]
    assert [e.key for e in got[records.group_ledger(C)]] == [f"{C}-key"]


def test_extra_groups_refuse_the_concurrent_listener() -> None:
    with isolated_listeners(), pytest.raises(ValueError, match="concurrent"):
        listeners._register_groups("concurrent")


# -- the report -----------------------------------------------------------------------------------


def test_the_report_gives_each_group_a_row_under_the_scenarios(tmp_path: Path) -> None:
    main = check(data([call("k0001", 1, 0, T)], group=listeners.GROUP))
    main.scenario = "groups-kill"
    b = check(data([], acks=[Ack("k0001", 1, 0, 0, T)], group=B))
    b.scenario = f"groups-kill/{B}"
    merge_groups(main, {B: b})
    title = SCENARIOS["groups-kill"].title
    rows = {"groups-kill": report.compact(main, title=report.group_title(title, main), env={}, quick=False,
                                          seconds=1),
            b.scenario: report.compact(b, title=report.group_title(title, b, B), env={}, quick=False, seconds=1)}
    doc = tmp_path / "RELIABILITY.md"
    text = report.write(rows, doc).read_text()
    assert "| groups-kill | 1 | 1 |" in text and "| groups-kill/chaos-b | 1 | 0 |" in text
    assert f"this row: group {listeners.GROUP}'s calls, failing if any group's check failed" in text
    assert f"### groups-kill/{B}: {title}; this row: group {B}'s calls" in text
    assert f"- groups-kill: group {B}: 1 acknowledged message(s) lost" in text
    # A single-group result keeps its title.
    assert report.group_title(title, Result("kill")) == title

"""The consumption ledger read by Spark and the ordering audit, on real Spark and a real redis-server.

Ledgers are either written by real prefork workers (``MQORDER_LEDGER=1``) consuming what Spark
published, or built record by record with the engine's own writer (``LedgerBuffer`` and
``ledger.lua``) from the messages really stored, so that a swapped pair, a missing message and a
duplicate are placed exactly where the assertions expect them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

pytest.importorskip("pyspark")

from mqorder import Producer, keys
from mqorder.consumer.ledger import FIELDS, LedgerBuffer, LedgerOutcome
from mqorder.model import MessageExt
from mqorder.store.log import MessageLog
from mqorder.store.scripts import Scripts

pytestmark = pytest.mark.spark

TOPIC, GROUP = "t-audit", "g-audit"


def _stored(p: Producer, topic: str) -> list[list[MessageExt]]:
    log = MessageLog(p.brokers)
    return [log.read(mq, 0, 10**6) for mq in p.describe_topic(topic).message_queues]


class LedgerWriter:
    """Writes ledger records as the engine does (``LedgerBuffer`` → ``ledger.lua``), at chosen times."""

    def __init__(self, client: redis.Redis, group: str = GROUP) -> None:
        self.client = client
        self.buf = LedgerBuffer(group, "c1@test", "run1", 1_000_000)
        self.scripts = Scripts(client)
        self.clock = time.time() * 1000  # after every message's born time

    def handle(self, msg: MessageExt, outcome: LedgerOutcome = LedgerOutcome.SUCCESS, epoch: int = 1) -> None:
        self.clock += 10
        self.buf.note([msg], outcome, self.clock, self.clock + 2, epoch)

    def flush(self) -> None:
        self.buf.flush(self.scripts)


def _publish(p: Producer, topic: str, per_key: dict[str, list[int]]) -> None:
    """Bodies ``{"k": key, "s": seq}`` in the order given (keys interleaved)."""
    longest = max(len(v) for v in per_key.values())
    for i in range(longest):
        p.send_orderly_batch(topic, [(k, json.dumps({"k": k, "s": seqs[i]}).encode())
                                     for k, seqs in per_key.items() if i < len(seqs)])


@pytest.fixture
def producer(settings) -> Producer:
    p = Producer(settings=settings)
    yield p
    p.close()


def test_the_ledger_reads_as_a_typed_dataframe_from_every_broker(spark, producer: Producer, r: redis.Redis,
                                                                 redis_url: str) -> None:
    producer.create_topic(TOPIC, queues=2)
    _publish(producer, TOPIC, {"a": [1, 2, 3], "b": [1, 2]})
    w = LedgerWriter(r)
    msgs = [m for q in _stored(producer, TOPIC) for m in q]
    for i, m in enumerate(msgs):
        w.handle(m)
        w.flush()
        time.sleep(0.002 * (i % 2))  # records over a few ms, so slices by time are not empty
    r.xadd(keys.ledger(GROUP), {"r": b"not json"})
    df = (spark.read.format("mqorder").option("ledger", GROUP).option("redisUrl", redis_url)
          .option("maxRowsPerPartition", 2).load())
    assert df.columns == [*FIELDS, "entry"]
    assert dict(df.dtypes)["offset"] == "bigint" and dict(df.dtypes)["start_ms"] == "double"
    rows = df.orderBy("entry").collect()
    assert len(rows) == len(msgs) + 1
    assert rows[-1]["outcome"] is None and rows[-1]["entry"]  # kept, flagged by its null outcome
    assert sorted((x["queue"], x["offset"], x["key"]) for x in rows[:-1]) == sorted(
        (m.queue_id, m.queue_offset, m.keys[0]) for m in msgs)
    assert df.rdd.getNumPartitions() >= 2  # cut by id range
    narrow = (spark.read.format("mqorder").schema("offset BIGINT, outcome STRING").option("ledger", GROUP)
              .option("redisUrl", redis_url).load())  # only these columns are parsed and shipped
    assert sorted(tuple(x) for x in narrow.collect() if x.outcome) == sorted((m.queue_offset, "SUCCESS") for m in msgs)


def test_no_ledger_for_the_group_says_how_to_switch_it_on(spark, redis_url: str) -> None:
    from mqorder.spark.ledger import LedgerNotFoundError, read_ledger

    with pytest.raises(LedgerNotFoundError, match="MQORDER_LEDGER=1"):
        read_ledger("nobody", redis_url=redis_url)


@pytest.mark.parametrize(("stored", "committed", "extent", "start", "expected"), [
    # [earliest, next) = [0, 10) throughout; Extent(delivered below / from committed, lowest, highest)
    ((0, 10), 10, (10, 0, 0, 9), "stored", (0, 0, 0, 0)),  # every message delivered
    ((0, 10), 6, (6, 0, 0, 5), "stored", (0, 0, 4, 0)),  # 6..9 not reached yet: pending
    ((0, 10), 6, (5, 0, 0, 5), "stored", (1, 0, 4, 0)),  # one of 0..5 never delivered: a gap
    ((0, 10), 4, (4, 3, 0, 8), "stored", (0, 2, 1, 0)),  # 4..8 has 3 delivered: 2 holes; 9 pending
    ((0, 10), 6, (3, 0, 3, 5), "stored", (3, 0, 4, 0)),  # the ledger starts at 3: 0..2 are gaps...
    ((0, 10), 6, (3, 0, 3, 5), "ledger", (0, 0, 4, 3)),  # ...or unaudited, from the ledger's start
    ((5, 10), 10, (5, 0, 5, 9), "stored", (0, 0, 0, 0)),  # retention trimmed 0..4: not stored, not owed
    ((0, 10), 8, (0, 0, None, None), "ledger", (0, 0, 2, 8)),  # no record of the queue at all
])
def test_phase_one_counts_unread_stored_messages_by_subtraction(stored, committed, extent, start,
                                                                expected) -> None:
    from mqorder.spark.audit_frames import Extent, unseen
    from mqorder.spark.audit_model import QueueInfo

    q = QueueInfo(0, "broker-a", 0, max_offset=stored[1], committed=committed, earliest=stored[0])
    u = unseen(q, Extent(*extent), start)
    assert (u.gaps, u.holes, u.pending, u.unaudited) == expected


def test_a_clean_ledger_is_audited_from_the_ledger_alone_counting_the_pending(spark, producer: Producer,
                                                                             r: redis.Redis,
                                                                             redis_url: str) -> None:
    from mqorder.client.selector import queue_index
    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=2)
    _publish(producer, TOPIC, {"a": [1, 2, 3], "b": [1, 2], "d": [1, 2]})
    assert {queue_index(k, 2) for k in "abd"} == {0, 1}  # both queues hold messages
    w = LedgerWriter(r)
    queues = _stored(producer, TOPIC)
    for q, msgs in enumerate(queues):
        for m in msgs[:-1]:  # the last message of each queue is not consumed yet
            w.handle(m)
        mq = producer.describe_topic(TOPIC).message_queues[q]
        r.hset(keys.sub_state(mq.tag, GROUP), "offset", len(msgs) - 1)
    w.flush()
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert rep.ok and not rep.read_stored  # nothing to name: the stored messages were not read
    assert (rep.messages_stored, rep.messages_succeeded, rep.pending, rep.gap_count) == (7, 5, 2, 0)
    assert [(q.stored, q.pending, q.lag) for q in rep.queues] == [(len(m), 1, 1) for m in queues]


def test_a_record_without_its_queue_id_is_malformed_not_matched_by_its_broker_name_alone(spark, producer: Producer,
                                                                                      r: redis.Redis,
                                                                                      redis_url: str) -> None:
    """A damaged record whose broker field reads ``<broker>:<queue id>`` and that has no queue id
    must not be taken for a delivery of that queue (the queue lookup joins the two with ``:``)."""
    import orjson

    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=2)
    _publish(producer, TOPIC, {"a": [1, 2], "b": [1, 2]})
    w = LedgerWriter(r)
    queues = _stored(producer, TOPIC)
    for q, msgs in enumerate(queues):
        for m in msgs:
            w.handle(m)
        r.hset(keys.sub_state(producer.describe_topic(TOPIC).message_queues[q].tag, GROUP), "offset", len(msgs))
    mq0 = producer.describe_topic(TOPIC).message_queues[0]
    w.buf.records.append(orjson.dumps({
        "group": GROUP, "topic": TOPIC, "broker": f"{mq0.broker_name}:{mq0.queue_id}", "offset": 0, "key": "a",
        "born_ms": 1, "start_ms": w.clock + 10, "end_ms": w.clock + 11, "epoch": 1, "outcome": "SUCCESS"}))
    w.flush()
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert rep.malformed_records == 1
    assert rep.ok and rep.duplicates_other == 0 and rep.duplicates_epoch_change == 0
    assert rep.messages_succeeded == sum(len(m) for m in queues)


def test_a_message_in_the_dead_letter_topic_alone_is_dead_lettered_not_a_gap(spark, producer: Producer,
                                                                            r: redis.Redis, redis_url: str) -> None:
    """A dead letter the ledger has no record of (its DLQ record lost, say) is found by its
    ``ORIGIN_*`` properties in ``%DLQ%<group>``, written by the engine's own ``DeadLetterWriter``."""
    from mqorder.consumer.dlq import DeadLetterWriter
    from mqorder.spark import audit
    from mqorder.store.append import QueueAppender
    from mqorder.store.topics import TopicManager

    producer.create_topic(TOPIC, queues=1)
    _publish(producer, TOPIC, {"a": [1, 2, 3]})
    (msgs,) = _stored(producer, TOPIC)
    w = LedgerWriter(r)
    for m in (msgs[0], msgs[2]):
        w.handle(m)
    w.flush()
    mq = producer.describe_topic(TOPIC).message_queues[0]
    r.hset(keys.sub_state(mq.tag, GROUP), "offset", 3)
    dead = DeadLetterWriter(QueueAppender(producer.brokers, pending_ttl_ms=0, timeout=3.0), TopicManager(producer.brokers),
                            producer.brokers.default_name, "c1@test")
    dead.send(GROUP, msgs[1], "poison", epoch=1)
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert (rep.gap_count, rep.messages_dead_lettered, rep.messages_succeeded) == (0, 1, 2)
    assert rep.ok and rep.read_stored


def test_a_ledger_switched_on_late_shows_gaps_from_the_first_stored_message_or_unaudited_from_its_start(
        spark, producer: Producer, r: redis.Redis, redis_url: str) -> None:
    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=1)
    _publish(producer, TOPIC, {"a": [1, 2, 3, 4, 5, 6]})
    (msgs,) = _stored(producer, TOPIC)
    w = LedgerWriter(r)
    for m in msgs[3:]:  # offsets 0..2 were consumed before the ledger was on (or lost)
        w.handle(m)
    w.flush()
    mq = producer.describe_topic(TOPIC).message_queues[0]
    r.hset(keys.sub_state(mq.tag, GROUP), "offset", 6)
    strict = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert not strict.ok and strict.read_stored
    assert [(g.key, g.offset, g.reason, g.msg_id) for g in strict.gaps] == [
        ("a", o, "below the committed offset 6", msgs[o].msg_id) for o in range(3)]
    assert "--start ledger" in strict.failures()[-1]
    lenient = audit(spark, TOPIC, GROUP, redis_url=redis_url, start="ledger")
    assert lenient.ok and not lenient.read_stored
    assert (lenient.unaudited, lenient.gap_count, lenient.messages_succeeded, lenient.start) == (3, 0, 3, "ledger")


def _faulty_ledger(p: Producer, r: redis.Redis) -> dict[str, tuple[int, int]]:
    """One queue; keys a, b, c, d, e. Key a: offsets of seq 2 and 3 delivered swapped. Key b: seq 2
    never delivered (seq 3 is). Key c: seq 1 handled twice under one epoch. Key d: its body field
    ``s`` goes 1, 3, 2 (published so). Key e: seq 2 handled again after an epoch change. Returns
    {name: (key's offset)} of the messages the audit must name."""
    p.create_topic(TOPIC, queues=1)
    _publish(p, TOPIC, {"a": [1, 2, 3, 4], "b": [1, 2, 3], "c": [1, 2], "d": [1, 3, 2], "e": [1, 2]})
    (msgs,) = _stored(p, TOPIC)
    at = {(m.keys[0], json.loads(m.body)["s"]): m for m in msgs}
    w = LedgerWriter(r)
    swapped = [at["a", 3], at["a", 2]]
    for m in msgs:
        if (m.keys[0], json.loads(m.body)["s"]) in (("a", 2), ("a", 3)):
            if m is at["a", 2]:
                for x in swapped:
                    w.handle(x)
            continue
        if m is at["b", 2]:
            continue
        w.handle(m)
        if m is at["c", 1]:
            w.handle(m)
    w.handle(at["e", 2], epoch=2)
    w.flush()
    return {"a2": (0, at["a", 2].queue_offset), "a3": (0, at["a", 3].queue_offset),
            "b2": (0, at["b", 2].queue_offset), "b3": (0, at["b", 3].queue_offset), "c1": (0, at["c", 1].queue_offset),
            "d2": (0, at["d", 2].queue_offset), "d3": (0, at["d", 3].queue_offset),
            "e2": (0, at["e", 2].queue_offset)}


def test_the_audit_names_a_swapped_pair_a_missing_message_and_the_duplicates(spark, producer: Producer,
                                                                             r: redis.Redis, redis_url: str,
                                                                             tmp_path: Path) -> None:
    from mqorder.spark import audit

    where = _faulty_ledger(producer, r)
    rep = audit(spark, TOPIC, GROUP, order_field="s", redis_url=redis_url, report_dir=tmp_path)
    assert not rep.ok and rep.read_stored
    assert [(v.key, v.queue, v.offset, v.after_offset) for v in rep.violations] == [
        ("a", 0, where["a2"][1], where["a3"][1])]
    assert [(g.key, g.queue, g.offset) for g in rep.gaps] == [("b", 0, where["b2"][1])]
    assert rep.gaps[0].reason == f"offset {where['b3'][1]} of its key succeeded"
    assert sorted((d.key, d.offset, d.kind, d.epochs) for d in rep.duplicates) == [
        ("c", where["c1"][1], "same_epoch", [1]), ("e", where["e2"][1], "epoch_change", [1, 2])]
    # the body field goes down where key d was published so, and where key a was delivered swapped
    assert [(d.key, d.offset, d.value, d.after_offset, d.after_value) for d in rep.domain_violations] == [
        ("a", where["a2"][1], "2", where["a3"][1], "3"), ("d", where["d2"][1], "2", where["d3"][1], "3")]
    assert (rep.violation_count, rep.gap_count, rep.duplicates_other, rep.duplicates_epoch_change,
            rep.domain_violation_count) == (1, 1, 1, 1, 2)
    assert rep.messages_stored == 14 and rep.messages_succeeded == 13 and rep.pending == 0
    assert rep.latency.count == 13 and rep.latency.p50_ms is not None
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["ok"] is False and out["gap_count"] == 1 and out["gaps"][0]["key"] == "b"
    md = (tmp_path / "report.md").read_text()
    assert "**FAIL**" in md and f"| `a` | 0 | {where['a2'][1]} | {where['a3'][1]} |" in md
    for png in ("latency.png", "throughput.png", "lag.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_key_lanes_are_the_sharding_key_hash_of_plain_send_orderly_messages(spark, producer: Producer,
                                                                            r: redis.Redis, redis_url: str) -> None:
    """``send_orderly(topic, body, sharding_key)`` stores no message key, only the key's hash (``h``),
    which a key-ordered listener orders by: key a's first message may wait (suspended) while key b's
    later ones succeed. The audit's key lanes must be those hashes: one lane per queue (the messages'
    empty first key) read b's success as a's order violation and a's wait as a gap."""
    from mqorder.client.selector import key_hash
    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=1)
    for k, s in (("a", 1), ("b", 1), ("a", 2), ("b", 2), ("c", 1), ("c", 2)):
        producer.send_orderly(TOPIC, json.dumps({"s": s}).encode(), sharding_key=k)
    (msgs,) = _stored(producer, TOPIC)
    assert not any(m.keys for m in msgs)  # no message key: the hash is all there is
    a1, b1, a2, b2, c1, c2 = msgs
    w = LedgerWriter(r)
    for m in (b1, b2):
        w.handle(m)
    w.handle(a1, LedgerOutcome.SUSPEND)
    for m in (c2, c1):  # c's pair delivered swapped: c's violation, named by its hash
        w.handle(m)
    w.flush()
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url, max_listed=10)
    assert [(v.key, v.key_hash, v.offset, v.after_offset) for v in rep.violations] == [
        (None, key_hash("c"), c1.queue_offset, c2.queue_offset)]
    assert (rep.gap_count, rep.pending, rep.messages_succeeded) == (0, 2, 4)
    assert rep.key_lanes == "key_hash"


def test_a_ledger_written_before_key_hashes_audits_lanes_by_first_key(spark, producer: Producer, r: redis.Redis,
                                                                   redis_url: str) -> None:
    """Records without ``key_hash`` (an older engine's) are still audited per first key, stored
    messages included (one lane rule for both, or each message would fall in two lanes)."""
    import orjson

    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=1)
    _publish(producer, TOPIC, {"a": [1, 2], "b": [1, 2]})
    (msgs,) = _stored(producer, TOPIC)
    at = {(m.keys[0], json.loads(m.body)["s"]): m for m in msgs}
    w = LedgerWriter(r)
    for m in (at["b", 1], at["a", 2], at["a", 1]):  # b's first, then a's pair swapped; b's second unread
        w.handle(m)
    w.buf.records = [orjson.dumps({f: v for f, v in orjson.loads(x).items() if f != "key_hash"})
                     for x in w.buf.records]
    w.flush()
    mq = producer.describe_topic(TOPIC).message_queues[0]
    r.hset(keys.sub_state(mq.tag, GROUP), "offset", 4)
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert rep.key_lanes == "first_key"
    assert [(v.key, v.offset) for v in rep.violations] == [("a", at["a", 1].queue_offset)]
    assert [(g.key, g.offset, g.reason) for g in rep.gaps] == [
        ("b", at["b", 2].queue_offset, "below the committed offset 4")]


def test_a_ledger_an_older_worker_still_writes_to_is_audited_by_first_key(spark, producer: Producer,
                                                                         r: redis.Redis, redis_url: str) -> None:
    """A rolling upgrade: a new worker wrote the stream's first record, an old one the later ones.
    Audited by hash, the old records of ``send_orderly`` messages (no first key) fell in the queue's
    keyless lane while their stored rows were in their keys' lanes, each message in two lanes. By
    first key for all (records and stored rows alike), as before the upgrade: such messages are
    then checked in their queue's order, which key b overtaking key a breaks (the old engine's
    records cannot say more), and nothing is a gap."""
    import orjson

    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=1)
    for k in ("a", "b", "a"):
        producer.send_orderly(TOPIC, json.dumps({"k": k}).encode(), sharding_key=k)
    (msgs,) = _stored(producer, TOPIC)
    a1, b1, a2 = msgs
    w = LedgerWriter(r)
    w.handle(a1)
    w.flush()
    w.handle(a2)
    w.handle(b1)  # key b after key a's later message: key order allows it
    w.buf.records = [orjson.dumps({f: v for f, v in orjson.loads(x).items() if f != "key_hash"})
                     for x in w.buf.records]
    w.flush()
    r.hset(keys.sub_state(producer.describe_topic(TOPIC).message_queues[0].tag, GROUP), "offset", 3)
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert rep.key_lanes == "first_key"
    assert (rep.gap_count, rep.messages_succeeded, rep.violation_count) == (0, 3, 1)


# -- the CLI, end to end --------------------------------------------------------------------------


def _cli(*args: str):
    from typer.testing import CliRunner

    from mqorder.cli import app

    return CliRunner().invoke(app, ["pipeline", *args], catch_exceptions=False)


def _caught_up(log: MessageLog, p: Producer, topic: str, group: str) -> bool:
    return all(log.lag(group, mq) == 0 for mq in p.describe_topic(topic).message_queues)


@pytest.mark.e2e
def test_publish_consume_with_prefork_workers_then_audit_passes(spark, cluster, producer: Producer, r: redis.Redis,
                                                                 tmp_path: Path) -> None:
    import random

    from mqorder.spark import read_ledger
    from tests.support import wait_for

    producer.create_topic("t-order", queues=4)
    producer.create_topic("t-suspend", queues=1)
    r.hset("ctl:g-suspend", "suspend:k2:3", 99)  # poison: dead-lettered after 2 reconsumes
    items = [(f"k{i}", s) for i in range(30) for s in range(1, 9)]
    random.Random(7).shuffle(items)  # the file is not in order: --order-by must put it so
    (tmp_path / "t-order.csv").write_text("k,s\n" + "".join(f"{k},{s}\n" for k, s in items))
    cluster.start_worker("w1", MQORDER_LEDGER="1")
    cluster.start_worker("w2", MQORDER_LEDGER="1")
    res = _cli("publish", str(tmp_path / "t-order.csv"), "--topic", "t-order", "--key", "k", "--order-by", "s")
    assert res.exit_code == 0, res.output
    assert "published 240 of 240 rows" in res.output
    # The poison-message topic is small: the producer sends it (20 messages, k2's third one poison).
    producer.send_orderly_batch("t-suspend", [(f"k{i}", json.dumps({"k": f"k{i}", "s": s}).encode())
                                              for s in range(1, 5) for i in range(5)])
    log = MessageLog(producer.brokers)
    wait_for(lambda: all(_caught_up(log, producer, t, t.replace("t-", "g-")) for t in ("t-order", "t-suspend")),
             timeout=90,
             what="both groups caught up")

    res = _cli("audit", "--topic", "t-order", "--group", "g-order", "--report", str(tmp_path / "order"),
               "--order-field", "s")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output
    rep = json.loads((tmp_path / "order" / "report.json").read_text())
    assert (rep["violation_count"], rep["gap_count"], rep["domain_violation_count"], rep["pending"]) == (0, 0, 0, 0)
    assert (rep["messages_stored"], rep["messages_succeeded"], rep["latency"]["count"]) == (240, 240, 240)
    assert {q["lag"] for q in rep["queues"]} == {0} and len(rep["queues"]) == 4
    assert 0 <= rep["latency"]["p50_ms"] <= rep["latency"]["p99_ms"]
    # A misspelt --order-field passed (exit 0), its only trace a count in report.md.
    typo = _cli("audit", "--topic", "t-order", "--group", "g-order", "--report", str(tmp_path / "typo"),
                "--order-field", "sequ")
    assert typo.exit_code == 1, typo.output
    assert "no stored message has a body field 'sequ' (240 without it)" in " ".join(typo.output.split())

    res = _cli("audit", "--topic", "t-suspend", "--group", "g-suspend", "--report", str(tmp_path / "suspend"))
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "suspend" / "report.json").read_text())
    assert (rep["messages_succeeded"], rep["messages_dead_lettered"], rep["gap_count"]) == (19, 1, 0)

    out = tmp_path / "ledger.parquet"
    res = _cli("export", "--topic", "t-order", "--ledger", "g-order", "--out", str(out))
    assert res.exit_code == 0, res.output
    records = read_ledger("g-order", topic="t-order", redis_url=cluster.url)
    assert spark.read.parquet(str(out)).count() == len(records) >= 240
    res = _cli("export", "--topic", "t-order", "--out", str(tmp_path / "messages.parquet"))
    assert res.exit_code == 0 and "exported 240 rows" in res.output, res.output


def test_the_cli_audit_exits_1_on_a_gap_below_the_committed_offset_and_counts_the_pending(
        spark, producer: Producer, r: redis.Redis, tmp_path: Path) -> None:
    producer.create_topic(TOPIC, queues=1)
    _publish(producer, TOPIC, {"a": [1], "b": [1], "c": [1], "d": [1]})
    (msgs,) = _stored(producer, TOPIC)
    w = LedgerWriter(r)
    w.handle(msgs[0])
    w.handle(msgs[2], LedgerOutcome.DLQ)
    w.flush()
    mq = producer.describe_topic(TOPIC).message_queues[0]
    r.hset(keys.sub_state(mq.tag, GROUP), "offset", 3)  # the group committed offsets 0..2
    res = _cli("audit", "--topic", TOPIC, "--group", GROUP, "--report", str(tmp_path))
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output and "key 'b' queue 0 offset 1 (below the committed offset 3)" in " ".join(
        res.output.split())
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [(g["key"], g["offset"], g["reason"]) for g in rep["gaps"]] == [("b", 1, "below the committed offset 3")]
    assert (rep["pending"], rep["messages_dead_lettered"], rep["queues"][0]["lag"]) == (1, 1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lag.png", "latency.png", "report.json", "report.md",
                                                          "throughput.png"]


def test_the_cli_refuses_bad_input_before_starting_spark(producer: Producer, redis_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    producer.create_topic(TOPIC, queues=1)
    (tmp_path / "rows.txt").write_text("k,s\n")
    (tmp_path / "rows.csv").write_text("k,s\n")
    cases = [
        (["publish", str(tmp_path / "missing.csv"), "--topic", TOPIC, "--key", "k", "--order-by", "s"], "does not exist"),
        (["publish", str(tmp_path / "rows.txt"), "--topic", TOPIC, "--key", "k", "--order-by", "s"],
         "unsupported extension '.txt'"),
        (["publish", str(tmp_path / "rows.csv"), "--topic", "nope", "--key", "k", "--order-by", "s"],
         "mqorder topic create nope"),
        (["audit", "--topic", TOPIC, "--group", "g-none", "--report", str(tmp_path / "r")], "MQORDER_LEDGER=1"),
        (["export", "--topic", TOPIC, "--out", str(tmp_path / "x.csv")], "must end with .parquet"),
        (["export", "--topic", TOPIC, "--ledger", "g-none", "--out", str(tmp_path / "x.parquet")], "MQORDER_LEDGER=1"),
        # The key's name as text: Rich made ":ledger:" an emoji ("mqorder📒g-none").
        (["export", "--topic", TOPIC, "--ledger", "g-none", "--out", str(tmp_path / "x.parquet")],
         "kept in mqorder:ledger:g-none"),
    ]
    for args, message in cases:
        res = _cli(*args)
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
    from mqorder.settings import get_settings

    monkeypatch.setenv("MQORDER_REDIS_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    res = _cli("audit", "--topic", TOPIC, "--group", GROUP, "--report", str(tmp_path / "r"))
    assert res.exit_code == 2 and "cannot reach Redis" in res.output and "Start redis-server" in " ".join(res.output.split())

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

from mqorder import Producer, keys  # noqa: E402
from mqorder.consumer.ledger import FIELDS, LedgerBuffer, LedgerOutcome  # noqa: E402
from mqorder.model import MessageExt  # noqa: E402
from mqorder.store.log import MessageLog  # noqa: E402

TOPIC, GROUP = "t-audit", "g-audit"


def _stored(p: Producer, topic: str) -> list[list[MessageExt]]:
    log = MessageLog(p.brokers)
    return [log.read(mq, 0, 10**6) for mq in p.describe_topic(topic).message_queues]


class LedgerWriter:
    """Writes ledger records as the engine does (``LedgerBuffer`` → ``ledger.lua``), at chosen times."""

    def __init__(self, client: redis.Redis, group: str = GROUP) -> None:
        self.client = client
        self.buf = LedgerBuffer(group, "c1@test", "run1", 1_000_000)
        self.clock = time.time() * 1000  # after every message's born time

    def handle(self, msg: MessageExt, outcome: LedgerOutcome = LedgerOutcome.SUCCESS, epoch: int = 1) -> None:
        self.clock += 10
        self.buf.note([msg], outcome, self.clock, self.clock + 2, epoch)

    def flush(self) -> None:
        self.buf.flush(self.client)


def _publish(p: Producer, topic: str, per_key: dict[str, list[int]]) -> None:
    """Bodies ``{"k": key, "s": seq}`` in the order given (keys interleaved)."""
    longest = max(len(v) for v in per_key.values())
    for i in range(longest):
        p.send_orderly_batch(topic, [(k, json.dumps({"k": k, "s": seqs[i]}).encode())
                                     for k, seqs in per_key.items() if i < len(seqs)])


@pytest.fixture
def producer(settings) -> Producer:  # noqa: ANN001
    p = Producer(settings=settings)
    yield p
    p.close()


def test_the_ledger_reads_as_a_typed_dataframe_from_every_broker(spark, producer: Producer, r: redis.Redis,
                                                                 redis_url: str) -> None:  # noqa: ANN001
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


def test_no_ledger_for_the_group_says_how_to_switch_it_on(spark, redis_url: str) -> None:  # noqa: ANN001
    from mqorder.spark.ledger import LedgerNotFoundError, read_ledger

    with pytest.raises(LedgerNotFoundError, match="MQORDER_LEDGER=1"):
        read_ledger("nobody", redis_url=redis_url)


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
                                                                             tmp_path: Path) -> None:  # noqa: ANN001
    from mqorder.spark import audit

    where = _faulty_ledger(producer, r)
    rep = audit(spark, TOPIC, GROUP, order_field="s", redis_url=redis_url, report_dir=tmp_path)
    assert not rep.ok
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


def test_a_message_below_the_committed_offset_without_a_record_is_a_gap_one_above_is_pending(
        spark, producer: Producer, r: redis.Redis, redis_url: str) -> None:  # noqa: ANN001
    from mqorder.spark import audit

    producer.create_topic(TOPIC, queues=1)
    _publish(producer, TOPIC, {"a": [1], "b": [1], "c": [1], "d": [1]})
    (msgs,) = _stored(producer, TOPIC)
    w = LedgerWriter(r)
    w.handle(msgs[0])
    w.handle(msgs[2], LedgerOutcome.DLQ)
    w.flush()
    mq = producer.describe_topic(TOPIC).message_queues[0]
    r.hset(keys.sub_state(mq.tag, GROUP), "offset", 3)  # the group committed offsets 0..2
    rep = audit(spark, TOPIC, GROUP, redis_url=redis_url)
    assert [(g.key, g.offset, g.reason) for g in rep.gaps] == [("b", 1, "below the committed offset 3")]
    assert (rep.pending, rep.messages_dead_lettered, rep.queues[0].lag) == (1, 1, 1)
    assert rep.failures() and "key 'b' queue 0 offset 1" in rep.failures()[0]

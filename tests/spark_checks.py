"""Checks shared by the tests of Spark's modes (standalone cluster, Spark Connect): each one runs
jobs in a driver process (``tests.spark_cluster.SparkDriver``) and checks what Redis holds after."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
import redis

from mqorder import Producer
from mqorder.client.selector import queue_index
from mqorder.consumer.ledger import LedgerBuffer, LedgerOutcome
from mqorder.store.log import MessageLog
from mqorder.store.scripts import Scripts
from tests.spark_cluster import DriverError, SparkDriver
from tests.spark_support import staged_keys, stored


def check_written(url: str, topic: str, n: int, keys: int) -> None:
    """Every row once, each key in its producer queue and in ``ts`` order."""
    per_key: dict[str, list[int]] = defaultdict(list)
    queues = stored(url, topic)
    for index, msgs in queues.items():
        for _, key, _, body in msgs:
            assert key is not None and queue_index(key, len(queues)) == index
            per_key[key].append(json.loads(body)["ts"])
    assert sum(len(v) for v in per_key.values()) == n
    assert len(per_key) == keys
    for key, ts in per_key.items():
        assert ts == sorted(set(ts)), key  # in order, nothing twice
    assert sorted(t for ts in per_key.values() for t in ts) == list(range(n))


def check_stream(driver: SparkDriver, url: str, tmp: Path, opts: dict[str, str]) -> None:
    """readStream → writeStream in micro-batches, twice from one checkpoint with new rows between:
    the sink holds every source message once, each key's in its source order."""
    with Producer(url) as p:
        p.create_topic("src", queues=3)
        p.create_topic("dst", queues=2)
        p.send_orderly_batch("src", [(f"k{i % 8}", f"a{i}".encode()) for i in range(120)])
        first = driver.call("stream", source="src", sink="dst", checkpoint=str(tmp / "ckpt"), opts=opts,
                            max_per_trigger=70)
        p.send_orderly_batch("src", [(f"k{i % 8}", f"b{i}".encode()) for i in range(40)])
    second = driver.call("stream", source="src", sink="dst", checkpoint=str(tmp / "ckpt"), opts=opts,
                         max_per_trigger=70)
    assert (first["rows"], second["rows"]) == (120, 40)
    assert first["batches"] >= 2  # maxOffsetsPerTrigger: 120 messages in batches of at most 70
    source = {(q, off): (key, body.decode()) for q, msgs in stored(url, "src").items() for off, key, _, body in msgs}
    src_order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (q, off), (key, _) in sorted(source.items()):
        src_order[key].append((q, off))
    sink_order: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for _, msgs in sorted(stored(url, "dst").items()):
        for _, key, _, body in msgs:
            b = json.loads(body)
            assert source[(b["src_queue"], b["src_offset"])] == (key, b["src_body"])
            sink_order[key].append((b["src_queue"], b["src_offset"]))
    assert sink_order == src_order  # every message once, each key's in its source order


class LedgerWriter:
    """Ledger records as the engine writes them (``LedgerBuffer`` → ``ledger.lua``)."""

    def __init__(self, client: redis.Redis, group: str) -> None:
        self.buf, self.scripts, self.clock = LedgerBuffer(group, "c1@test", "run1", 1_000_000), Scripts(client), 0.0

    def handle_all(self, p: Producer, topic: str) -> int:
        log, n = MessageLog(p.brokers), 0
        self.clock = time.time() * 1000
        for mq in p.describe_topic(topic).message_queues:
            for m in log.read(mq, 0, 10**6):
                self.clock += 5
                self.buf.note([m], LedgerOutcome.SUCCESS, self.clock, self.clock + 1, 1)
                n += 1
        self.buf.flush(self.scripts)
        return n


def check_refusals(driver: SparkDriver, url: str, r: redis.Redis, opts: dict[str, str]) -> None:
    """An unknown topic, a missing key column and null keys, through ``df.write`` (Spark's error
    carries mqorder's, found by ``mqorder.spark.errors``) and ``publish`` (which raises it):
    nothing published, nothing left staged."""
    with Producer(url) as p:
        p.create_topic("sa-bad", queues=2)
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="nope", opts=opts)
    assert err.value.mqorder is not None and err.value.mqorder[0] == "TopicNotFoundError"
    assert "mqorder topic create nope" in err.value.mqorder[1]
    assert "JVM stacktrace" not in err.value.message and "\tat org.apache" not in err.value.message
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="sa-bad", opts=opts, key="customer")
    assert err.value.mqorder == ("ConfigError", "key column 'customer' is not in the DataFrame; its columns are: "
                                                "k, ts, body")
    with pytest.raises(DriverError) as err:
        driver.call("bad_write", topic="sa-bad", opts=opts, null_key_every=4, via_publish=True)
    assert err.value.kind == "JobRefusedError"  # publish raises mqorder's own error, whatever the mode
    assert "10 rows have a null key ('k')" in err.value.message and "onNull" in err.value.message
    assert stored(url, "sa-bad") == {0: [], 1: []} and staged_keys(r) == []


def check_write(driver: SparkDriver, url: str, r: redis.Redis, opts: dict[str, str]) -> None:
    """``df.write`` then ``publish`` of the same rows: stored once, in order, nothing left staged."""
    with Producer(url) as p:
        p.create_topic("sa-write", queues=4)
    report = driver.call("write_then_publish", topic="sa-write", n=600, keys=13, opts=opts)
    # The staged df.write stored every row; publish of the same rows found every id stored.
    assert (report["rows"], report["stored"], report["duplicates"]) == (600, 0, 600)
    check_written(url, "sa-write", 600, 13)
    assert staged_keys(r) == []


def check_read(driver: SparkDriver, url: str, opts: dict[str, str]) -> None:
    """A batch read of offset ranges per queue gives exactly the stored messages of the ranges."""
    with Producer(url) as p:
        p.create_topic("sa-read", queues=3)
        p.send_orderly_batch("sa-read", [(f"k{i % 9}", f"m{i}".encode()) for i in range(150)])
    everything = stored(url, "sa-read")
    rows = driver.call("read", topic="sa-read", opts=opts, starting='{"0": 5, "2": 10}',
                       ending='{"0": 20, "1": -1, "2": -1}')
    expected = sorted([q, off, key, body.decode()] for q, msgs in everything.items() for off, key, _, body in msgs
                      if {0: 5 <= off < 20, 1: True, 2: off >= 10}[q])
    assert rows == expected and len(rows) > 50

"""The pieces under the Spark writer, on real Redis and without a Spark session: the order-preserving
sort keys, the encoding of a partition, and the staging area (stage.lua, publish_staged.lua)."""

from __future__ import annotations

import json
import math
import random
import struct

import pyarrow as pa
import pytest
import redis

from mqorder import Producer, keys
from mqorder.model import MessageQueue
from mqorder.spark.encoding import _enc_bytes, _enc_float, _enc_int, _enc_str, encode_partition
from mqorder.spark.options import Connection
from mqorder.spark.plan import QueueRef, WritePlan
from mqorder.spark.staging import StagingArea
from mqorder.spark.writer import StagedRuns, _Staging
from mqorder.store.log import MessageLog
from tests.spark_support import staged_keys

pytest.importorskip("pyspark")


# -- order-preserving bytes ------------------------------------------------------------------------


def test_sort_keys_order_like_the_values() -> None:
    rnd = random.Random(1)
    ints = [-(2**63), -1, 0, 1, 2**63 - 1, *(rnd.randrange(-(2**63), 2**63) for _ in range(300))]
    assert sorted(ints) == sorted(ints, key=_enc_int)
    floats = [-math.inf, -1e300, -1.5, -0.0, 0.0, 5e-324, 1.0, 1e300, math.inf,
              *(struct.unpack(">d", rnd.randbytes(8))[0] for _ in range(300))]
    floats = [f for f in floats if not math.isnan(f)]
    assert sorted(floats) == sorted(floats, key=_enc_float)
    assert _enc_float(-0.0) == _enc_float(0.0)
    assert _enc_float(math.nan) > _enc_float(math.inf)  # NaN sorts last, as in Spark
    texts = ["", "a", "a\x00", "a\x00b", "ab", "b", "é", "日本", "\x00", "\x00\x00", "🚀"]
    assert sorted(t.encode() for t in texts) == sorted((t.encode() for t in texts), key=_enc_bytes)
    # A sort key is the value's bytes then the message id: the id never changes the value order.
    assert _enc_str("a") + b"zzzz" < _enc_str("a\x00") + b"0000" < _enc_str("ab") + b"0000"


# -- one partition ---------------------------------------------------------------------------------


def plan(queues: int = 4, **kw: object) -> WritePlan:
    base = dict(topic="t", queues=tuple(QueueRef(i, "broker-a", i) for i in range(queues)), key="k",
                key_kind="string", order_by="o", order_kind="int", body="b", body_kind="binary", id_column=None,
                json_columns=("k", "o", "b"), on_null="fail", staging_ttl_ms=60_000, stage_chunk=100,
                job_id="j1", conn=Connection("redis://127.0.0.1:1/0", max_message_size=64))
    base.update(kw)
    return WritePlan(**base)  # type: ignore[arg-type]


def table(rows: list[tuple]) -> pa.Table:
    k, o, b = zip(*rows, strict=True) if rows else ((), (), ())
    return pa.table({"k": pa.array(k, pa.string()), "o": pa.array(o, pa.int64()), "b": pa.array(b, pa.binary())})


def test_a_partition_is_grouped_by_queue_ordered_and_given_deterministic_ids() -> None:
    rows = [("x", 3, b"c"), ("y", 1, b"a"), ("x", 1, b"a"), ("x", 2, b"b"), ("x", 2, b"b"), ("", 0, b"e")]
    enc = encode_partition(table(rows), plan())
    again = encode_partition(table(list(reversed(rows))), plan())
    ids = {q: [mid for _, mid, _, _ in run] for q, run in enc.runs.items()}
    assert ids == {q: [mid for _, mid, _, _ in run] for q, run in again.runs.items()}
    for run in enc.runs.values():
        assert [sk for sk, *_ in run] == sorted(sk for sk, *_ in run)
    xs = [(h, b) for run in enc.runs.values() for _, _, h, b in run if b'"k":["x"]' in h]
    assert [b for _, b in xs] == [b"a", b"b", b"b", b"c"]  # x's rows in o order, the twin kept
    x_ids = [mid for run in enc.runs.values() for _, mid, h, _ in run if b'"k":["x"]' in h]
    assert len(set(x_ids)) == 4 and x_ids[2] == x_ids[1] + ".1"  # identical rows: distinct messages
    assert enc.rows == 6 and not enc.refusal
    # A stream prefixes the batch id: the same row in two micro-batches is two messages.
    b7 = encode_partition(table(rows), plan(), id_prefix="7.")
    assert all(mid.startswith("7.") for run in b7.runs.values() for _, mid, _, _ in run)


def test_bad_rows_are_counted_not_dropped() -> None:
    t = pa.table({"k": pa.array(["a", None, None, "b"], pa.string()), "o": pa.array([1, 2, None, 4], pa.int64()),
                  "b": pa.array([b"x", b"y", b"z", b"w" * 65], pa.binary())})
    enc = encode_partition(t, plan())
    assert (enc.refusal.null_key, enc.refusal.null_order, enc.refusal.too_large, enc.refusal.largest) == (2, 1, 1, 65)
    assert enc.runs == {}
    text = enc.refusal.describe("k", "o", 64)
    assert "2 rows have a null key ('k')" in text and "1 rows are over max_message_size 64 bytes" in text
    skip = encode_partition(t, plan(on_null="skip", conn=Connection("redis://x:1/0", max_message_size=100)))
    assert (skip.skipped_nulls, skip.rows, sum(len(r) for r in skip.runs.values())) == (2, 2, 2)


# -- staging on real Redis -------------------------------------------------------------------------


@pytest.fixture
def area(redis_url: str):
    with Producer(redis_url) as p:
        p.create_topic("t", queues=2)
        yield StagingArea(p.brokers, "t", [QueueRef(i, "broker-a", i) for i in range(2)], "job1", ttl_ms=60_000)


def staged_row(v: int, tag: str = "") -> tuple[bytes, str, bytes, bytes]:
    mid = f"id{v}{tag}"
    return (_enc_int(v) + mid.encode(), mid, b'{"i":"%s","b":1}' % mid.encode(), b"%d" % v)


def bodies(area: StagingArea, index: int) -> list[int]:
    return [int(m.body) for m in MessageLog(area.brokers).read(area.mq(index), 0, 10**6)]


def test_staging_is_idempotent_by_position_and_refuses_a_different_input(area: StagingArea) -> None:
    rows = [staged_row(v) for v in range(100)]
    area.register(0, [0])
    assert area.stage(0, 0, rows[:30], chunk=7) == 30  # a first attempt dies after 30 rows
    assert area.stage(0, 0, rows, chunk=9) == 70  # its retry stages only the rest
    assert area.stage(0, 0, rows, chunk=100) == 0  # a concurrent copy finishing last adds nothing
    with pytest.raises(redis.ResponseError, match="MQORDER_STAGE_MISMATCH"):
        area.stage(0, 0, [staged_row(0, "other")], chunk=10)
    assert bodies(area, 0) == []  # nothing is visible before the commit


def test_publish_merges_runs_in_order_and_a_repeat_stores_nothing(area: StagingArea, r: redis.Redis) -> None:
    rnd = random.Random(4)
    values = rnd.sample(range(-5000, 5000), 900)
    runs = [sorted(values[i::3]) for i in range(3)]  # three tasks' partitions of one queue
    for run, vals in enumerate(runs):
        area.register(run, [1])
        area.stage(1, run, [staged_row(v) for v in vals], chunk=50)
    totals = area.publish({1: {0, 1, 2}}, chunk=64)  # many calls: the merge resumes between them
    assert (totals.stored, totals.duplicates) == (900, 0)
    assert bodies(area, 1) == sorted(values)
    assert staged_keys(r) == [b"mqorder:spark:job:job1:runs"]  # runs are gone once published
    # The job's rows staged again (a re-run) publish nothing new, by id.
    area.stage(1, 0, [staged_row(v) for v in runs[0]], chunk=50)
    again = area.publish({1: {0}})
    assert (again.stored, again.duplicates) == (0, 300)
    assert bodies(area, 1) == sorted(values)


def test_abort_drops_every_registered_run(area: StagingArea, r: redis.Redis) -> None:
    for run in range(3):
        area.register(run, [0, 1])
        for q in (0, 1):
            area.stage(q, run, [staged_row(v) for v in range(run * 10, run * 10 + 10)], chunk=4)
    assert len(staged_keys(r)) == 7
    assert area.drop() == 6
    assert staged_keys(r) == []
    assert bodies(area, 0) == bodies(area, 1) == []
    assert r.ttl(area.run_key(0, 0)) == -2


def test_staged_runs_expire(area: StagingArea, r: redis.Redis) -> None:
    area.register(0, [0])
    area.stage(0, 0, [staged_row(1)], chunk=1)
    assert 0 < r.pttl(area.run_key(0, 0)) <= 60_000
    assert 0 < r.pttl("mqorder:spark:job:job1:runs") <= 60_000


def test_a_publish_wakes_the_owner_of_an_idle_queue(area: StagingArea, r: redis.Redis) -> None:
    """Staged rows enter the log through the one append path, wake-ups included."""
    from mqorder import keys

    mq = MessageQueue("t", "broker-a", 0)
    area.appender.topics.add_sub("t", "g")
    r.hset(keys.sub_state(mq.tag, "g"), mapping={"owner": "w1", "lease": 2**50})
    sub = r.pubsub()
    sub.subscribe(keys.wake_channel("w1"))
    sub.get_message(timeout=1)
    area.register(0, [0])
    area.stage(0, 0, [staged_row(v) for v in range(5)], chunk=5)
    area.publish({0: {0}})
    msg = sub.get_message(timeout=2)
    assert msg is not None and b'"t:broker-a:0"' in msg["data"]
    assert r.hget(keys.sub_state(mq.tag, "g"), "pending")
    sub.close()


def test_the_reader_turns_every_stored_entry_into_a_row_even_a_damaged_one(redis_url: str, r: redis.Redis) -> None:
    from mqorder import keys
    from mqorder.spark.reader import QueueRange, QueueRef, read_range

    with Producer(redis_url) as p:
        p.create_topic("mixed", queues=1)
        p.send_orderly("mixed", b"plain", sharding_key="a", keys="a")
        p.send_orderly("mixed", b"props", sharding_key="a", keys=["a", "b"], tags="T", properties={"x": "1"})
        mq = p.describe_topic("mixed").message_queues[0]
    log_key = keys.queue_log(mq.tag)
    r.xadd(log_key, {"h": b"not json", "b": b"junk", "s": b"5"}, id="2-1")
    r.xadd(log_key, {"h": b'{"i": 7, "b": "x", "k": "a"}', "b": b"odd"}, id="3-1")
    r.set(keys.queue_next(mq.tag), 4)
    for start in (0, 2):  # a page with only well-formed headers takes the fast path; a mixed one the careful one
        batches = list(read_range(Connection(redis_url), QueueRange("mixed", QueueRef(0, "broker-a", 0), start, 4)))
        rows = pa.Table.from_batches(batches).to_pylist()
        assert [row["offset"] for row in rows] == list(range(start, 4))
        by_off = {row["offset"]: row for row in rows}
        if start == 0:
            assert (by_off[0]["key"], by_off[0]["body"], by_off[0]["properties"]) == ("a", b"plain", [])
            assert (by_off[1]["tags"], by_off[1]["properties"]) == ("T", [("x", "1")])
            assert by_off[0]["born_timestamp"] is not None
        assert (by_off[2]["msg_id"], by_off[2]["body"], by_off[2]["store_timestamp"].year) == (None, b"junk", 1970)
        assert (by_off[3]["msg_id"], by_off[3]["key"], by_off[3]["born_timestamp"], by_off[3]["body"]) == \
            (None, None, None, b"odd")
    only_good = list(read_range(Connection(redis_url), QueueRange("mixed", QueueRef(0, "broker-a", 0), 0, 1)))
    assert pa.Table.from_batches(only_good).column("key").to_pylist() == ["a"]


def test_the_merge_compares_sort_keys_byte_by_byte_whatever_their_length(area: StagingArea) -> None:
    """String orderBy values: shared prefixes, bytes over 0x7f, keys shorter and longer than 8 bytes."""
    rnd = random.Random(8)
    alphabet = [b"a", b"b", b"\x00", b"\x7f", b"\x80", b"\xff", "é".encode()]
    values = sorted({b"".join(rnd.choice(alphabet) for _ in range(rnd.randrange(0, 20))) for _ in range(600)})
    shuffled = values[:]
    rnd.shuffle(shuffled)

    def row(v: bytes) -> tuple[bytes, str, bytes, bytes]:
        mid = v.hex() or "empty"
        return (_enc_bytes(v) + mid.encode(), mid, b'{"i":"%s","b":1}' % mid.encode(), v)

    for run in range(4):
        area.register(run, [0])
        area.stage(0, run, sorted((row(v) for v in shuffled[run::4]), key=lambda t: t[0]), chunk=33)
    area.publish({0: {0, 1, 2, 3}}, chunk=50)
    assert [m.body for m in MessageLog(area.brokers).read(area.mq(0), 0, 10**6)] == values


def test_fast_header_parse_keeps_one_row_per_header_with_or_without_keys() -> None:
    from mqorder.spark.reader import _headers_arrow, _headers_python

    heads = [b'{"i":"a","b":1,"k":["x"]}', b'{"i":"b","b":2}', b'{"i":"c","b":3,"k":[]}',
             b'{"i":"d","b":4,"k":["y","z"],"t":"T"}']
    fast = _headers_arrow(heads)
    assert fast is not None
    assert [c.to_pylist() for c in fast] == [c.to_pylist() for c in _headers_python(heads)]
    assert fast[1].to_pylist() == ["x", None, None, "y"]
    assert _headers_arrow([*heads, b'{"i":"e","b":5,"p":{"x":"1"}}']) is None  # properties: the careful path


def test_a_commit_stopped_half_way_resumes_and_leaves_nothing_for_good(area: StagingArea, r: redis.Redis) -> None:
    from mqorder import keys

    area.register(0, [0])
    area.stage(0, 0, [staged_row(v) for v in range(50)], chunk=50)
    mq = area.mq(0)
    cursor = keys.stage_cursor(mq.tag, area.job)
    # One publish call of 20 rows, as a commit that dies right after it would leave things.
    kl, args = area._publish_call(0, [0], 20)
    area.brokers.default.scripts.load("publish_staged")
    reply = area.brokers.default.scripts.publish_staged(keys=kl, args=args)
    assert [int(x) for x in reply[:3]] == [20, 0, 30]
    assert r.hget(cursor, "0") == b"20" and 0 < r.pttl(cursor) <= 60_000  # expires with its run
    # A zombie attempt of the task stages its whole run again: positions stay absolute, nothing is added.
    assert area.stage(0, 0, [staged_row(v) for v in range(50)], chunk=50) == 0
    totals = area.publish({0: {0}})
    assert (totals.stored, totals.duplicates) == (30, 0)
    assert bodies(area, 0) == list(range(50))
    assert r.exists(cursor, area.run_key(0, 0)) == 0


def test_max_offsets_per_trigger_is_shared_over_the_queues_with_a_backlog() -> None:
    from mqorder.spark.streaming import cap

    start, latest = {0: 10, 1: 0, 2: 7}, {0: 110, 1: 5, 2: 7}
    end = cap(start, latest, 40)
    assert sum(end[i] - start[i] for i in start) == 40
    assert all(start[i] <= end[i] <= latest[i] for i in start)
    assert end == {0: 45, 1: 5, 2: 7} == cap(start, latest, 40)  # the small backlog is taken whole
    assert cap(start, latest, 10_000) == latest


def test_max_offsets_per_trigger_below_the_queue_count_serves_every_queue_in_turn() -> None:
    """With fewer rows than queues with a backlog, each trigger served the lowest indexes first:
    queues 2 and 3 were never read while 0 and 1 had a backlog (found by a review)."""
    from mqorder.spark.streaming import cap

    start, latest = {0: 0, 1: 0, 2: 0, 3: 0}, {i: 1000 for i in range(4)}
    for _ in range(50):
        nxt = cap(start, latest, 2)
        assert sum(nxt.values()) - sum(start.values()) == 2 and nxt == cap(start, latest, 2)
        start = nxt
    assert start == {0: 25, 1: 25, 2: 25, 3: 25}


def test_a_date_order_by_is_encoded_in_date_order() -> None:
    """pyarrow casts date32 to int32 only: a DATE orderBy, accepted by the plan, failed every write
    task with ArrowNotImplementedError (found by a review)."""
    import datetime

    t = pa.table({"k": pa.array(["a", "a", "a"], pa.string()),
                  "o": pa.array([datetime.date(2024, 1, 2), datetime.date(1969, 12, 31), datetime.date(2024, 1, 1)],
                                pa.date32()),
                  "b": pa.array([b"2", b"0", b"1"], pa.binary())})
    enc = encode_partition(t, plan(queues=1, order_kind="date"))
    assert [b for _, _, _, b in enc.runs[0]] == [b"0", b"1", b"2"]


def test_ledger_and_audit_index_reads_refuse_unknown_options_listing_the_known_ones() -> None:
    from mqorder.errors import ConfigError
    from mqorder.spark.ledger import ledger_options
    from mqorder.spark.stored_index import FORMAT, index_options

    with pytest.raises(ConfigError, match=r"unknown ledger read option\(s\) 'bogus'.*known options: ledger, topic, "
                                          r"redisUrl, brokers, maxRowsPerPartition"):
        ledger_options({"ledger": "g", "bogus": "1"})
    with pytest.raises(ConfigError, match=rf"'orderby'.*format\('{FORMAT}'\).*known options: topic, redisUrl, "
                                          r"brokers, orderField"):
        index_options({"topic": "t", "orderBy": "seq"})


def test_the_spark_writer_stores_the_key_hash_the_producer_stores() -> None:
    """Key-ordered listeners read header ``h``: a row published from Spark must carry the same
    ``crc32(utf8(key))`` as a ``send_orderly`` of that key, an empty key included."""
    import json
    import zlib

    from mqorder.client.selector import key_hash

    enc = encode_partition(table([("acct-1", 1, b"a"), ("é", 2, b"b"), ("", 3, b"c")]), plan())
    got = {bytes(b): json.loads(h)["h"] for run in enc.runs.values() for _, _, h, b in run}
    assert got == {b"a": zlib.crc32(b"acct-1"), b"b": key_hash("é"), b"c": key_hash("")}


class _Committer(_Staging):
    def __init__(self, wp: WritePlan) -> None:
        self.plan = wp


def test_a_micro_batch_replayed_after_its_commit_was_killed_half_way_publishes_the_rest(redis_url: str) -> None:
    """The first commit published 10 of 100 rows and died; Spark replays the batch under the same
    job id. Once the commit counted only what was still staged and failed with a false "staged
    rows ... expired" (found by a review); now the cursor's rows count as already stored."""
    with Producer(redis_url) as p:
        p.create_topic("t", queues=1)
        wp = plan(queues=1, conn=Connection(redis_url, max_message_size=1 << 20), job_id="streamx3")
        wp = type(wp)(**{**wp.__dict__, "queues": (QueueRef(0, "broker-a", 0),)})
        rows = [("k", i, b"%d" % i) for i in range(100)]
        enc = encode_partition(table(rows), wp, id_prefix="3.")
        w = _Committer(wp)
        brokers = wp.conn.registry()
        area = w._area(brokers, "streamx3")
        area.register(0, enc.runs)
        area.stage(0, 0, enc.runs[0], chunk=100)
        # the first commit: one publish call of 10 rows, then the driver is killed (no abort)
        broker = brokers.get("broker-a")
        broker.scripts.run_pipelined("publish_staged", [area._publish_call(0, [0], 10)])
        # restart: Spark replays batch 3 with the same rows; the task stages again (nothing new)
        area.register(0, enc.runs)
        assert area.stage(0, 0, enc.runs[0], chunk=100) == 0
        msg = StagedRuns("streamx3", 0, 0, {0: 100}, 0, {0: 1000})
        try:
            w._commit([msg], "streamx3", batch_id=3)
        finally:
            report = {k.decode(): json.loads(v) for k, v in brokers.meta.hgetall(keys.spark_job("streamx3")).items()}
            brokers.close()
        assert report["status"] == "published", report
        assert (report["stored"], report["duplicates"]) == (90, 10)
        mq = MessageQueue("t", "broker-a", 0)
        assert [m.body for m in MessageLog(p.brokers).read(mq, 0, 200)] == [b"%d" % i for i in range(100)]


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_identical_rows_of_different_tasks_are_distinct_messages_and_a_rerun_stores_none(
        area: StagingArea, chunk: int) -> None:
    """A plain df.write with identical rows (same key, orderBy, body) in two partitions stored one
    message for both: each task numbered its own twins only, and the second task's row had the
    first one's id. The commit now numbers them over the queue; a re-run cut into other partitions
    gets the same ids (chunk 1: every group of twins spans publish calls)."""
    twins = [("x", 1, b"a"), ("x", 2, b"b"), ("x", 2, b"b"), ("y", 2, b"b"), ("x", 3, b"c")]
    p = plan(queues=2)

    def commit(parts: list[list[tuple]]) -> tuple[int, int]:
        for run, rows in enumerate(parts):
            enc = encode_partition(table(rows), p)
            area.register(run, enc.runs)
            for q, staged in enc.runs.items():
                area.stage(q, run, staged, chunk=50)
        totals = area.publish({q: set(range(len(parts))) for q in range(2)}, chunk=chunk)
        return totals.stored, totals.duplicates

    # The rows of two tasks: x@2:b four times (once in the first task, three times in the second),
    # x@1:a twice (once in each), y@2:b and x@3:c once.
    first, second = twins[:2], twins[1:] + [twins[1], twins[0]]
    assert commit([first, second]) == (8, 0)
    stored = [m for q in range(2) for m in MessageLog(area.brokers).read(area.mq(q), 0, 100)]
    assert len({m.msg_id for m in stored}) == 8
    by_key: dict[str, list[bytes]] = {}
    for m in stored:
        by_key.setdefault(m.keys[0], []).append(m.body)
    assert by_key == {"x": [b"a", b"a", b"b", b"b", b"b", b"b", b"c"], "y": [b"b"]}  # in orderBy order
    # The same rows again, in three partitions cut elsewhere (a re-run of the job): nothing new.
    area.job = "job2"
    rows = first + second
    assert commit([rows[:4], rows[4:7], rows[7:]]) == (0, 8)
    # The same rows once more, with one more twin: exactly that one is new.
    area.job = "job3"
    assert commit([rows[:5], rows[5:] + [twins[1]]]) == (1, 8)

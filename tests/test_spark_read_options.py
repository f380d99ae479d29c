"""``minPartitions`` is checked the same way by every reader that takes it (the topic reader, the
ledger read and the audit's stored index): an integer in [1, 100,000], else a ``ConfigError``
naming the option and what it must be. No Spark session: the options are parsed before planning."""

from __future__ import annotations

import pytest

from mqorder.errors import ConfigError
from mqorder.spark.ledger import ledger_options
from mqorder.spark.options import read_options
from mqorder.spark.stored_index import index_options

URL = {"redisUrl": "redis://127.0.0.1:1/0"}  # never connected to: parsing only
PARSERS = {
    "topic": lambda extra: read_options({"topic": "t", **URL, **extra}, streaming=False).min_partitions,
    "ledger": lambda extra: ledger_options({"ledger": "g", **URL, **extra}).min_partitions,
    "index": lambda extra: index_options({"topic": "t", **URL, **extra}).min_partitions,
}


@pytest.mark.parametrize("reader", sorted(PARSERS))
@pytest.mark.parametrize("bad", ["0", "-3", "x", "²", "1.5", "100001", "100000000"])
def test_a_bad_min_partitions_is_refused_saying_what_it_must_be(reader: str, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"minPartitions=.*(must be an integer|out of range \[1, 100000\])"):
        PARSERS[reader]({"minPartitions": bad})


@pytest.mark.parametrize("reader", sorted(PARSERS))
def test_a_good_min_partitions_is_taken(reader: str) -> None:
    assert PARSERS[reader]({"minPartitions": "7"}) == 7


def test_a_batch_range_whose_start_is_past_its_end_is_refused(redis_url: str) -> None:
    """Once an empty DataFrame without a word (Kafka's source refuses it; found by a review)."""
    from mqorder import Producer
    from mqorder.spark.reader import MQOrderReader

    with Producer(redis_url) as p:
        p.create_topic("t", queues=2)
        p.send_orderly_batch("t", [("k", b"x")] * 100)

    def reader(starting: str, ending: str) -> MQOrderReader:
        return MQOrderReader(read_options({"topic": "t", "redisUrl": redis_url, "startingOffsets": starting,
                                           "endingOffsets": ending}, streaming=False))

    with pytest.raises(ConfigError, match=r"startingOffsets is past endingOffsets .*queue 1: 50 > 10"):
        reader('{"1": 50}', '{"1": 10, "0": 3}')
    reader('{"1": 10}', '{"1": 10}')  # an empty range given as such, and latest as a start, are fine
    reader("latest", "latest")


def test_kafka_style_offsets_naming_another_topic_say_so() -> None:
    """``{"other": {"0": 5}}`` for a read of topic t said "'other' is not a queue index": found by a
    walk-through that copied the option from another job."""
    from mqorder.spark.reader import QueueRef, parse_offsets

    spans = [QueueRef(i, "broker-a", i) for i in range(2)]
    with pytest.raises(ConfigError, match=r"startingOffsets names topic\(s\) \['other'\], but this read is of topic 't'"):
        parse_offsets('{"other": {"0": 5}}', "t", spans, -2, "startingOffsets")
    assert parse_offsets('{"t": {"1": 5}}', "t", spans, -2, "startingOffsets") == {0: -2, 1: 5}


@pytest.mark.parametrize("reader", sorted(PARSERS))
def test_a_redis_url_option_without_a_scheme_is_named_as_the_option(reader: str) -> None:
    """It was reported as MQORDER_REDIS_URL's, a variable the user had not set."""
    with pytest.raises(ConfigError, match=r"^option redisUrl='127\.0\.0\.1:6379' has scheme") as info:
        PARSERS[reader]({"redisUrl": "127.0.0.1:6379"})
    assert "MQORDER_REDIS_URL" not in str(info.value)


def test_a_ledger_read_of_a_topic_that_does_not_exist_is_refused(redis_url: str) -> None:
    """It read 0 records, which the audit then reported as an empty ledger, not as the typo."""
    from mqorder import Producer, keys
    from mqorder.errors import TopicNotFoundError
    from mqorder.spark.ledger import LedgerReader, ledger_streams

    with Producer(redis_url) as p:
        p.create_topic("orders", queues=2)
        p.brokers.get("broker-a").client.xadd(keys.ledger("g"), {"r": b"{}"})
        assert ledger_streams(p.brokers, "g"), "the test's ledger is not where the reader looks"
    with pytest.raises(TopicNotFoundError, match=r"option topic 'ordres' names no topic .* leave the option out"):
        LedgerReader(ledger_options({"ledger": "g", "topic": "ordres", "redisUrl": redis_url}))
    assert LedgerReader(ledger_options({"ledger": "g", "topic": "orders", "redisUrl": redis_url})).slices

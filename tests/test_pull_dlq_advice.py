"""A pull consumer asked for a dead-letter topic says how to read a DLQ (the admin CLI and API),
where the generic name check said "reserved ...; choose another name"; producers keep that one."""

from __future__ import annotations

import pytest

from mqorder import InvalidNameError, Producer, PullConsumer


def test_pulling_a_dlq_says_how_to_read_it(redis_url: str) -> None:
    with PullConsumer("audit") as consumer:  # MQORDER_REDIS_URL: the test server
        with pytest.raises(InvalidNameError) as err:
            consumer.fetch_message_queues_in_balance("%DLQ%billing")
    text = str(err.value)
    assert "choose another name" not in text
    assert "mqorder dlq list billing --json" in text
    assert "dlq_list(admin, 'billing')" in text


def test_creating_a_dlq_named_topic_is_still_refused_as_reserved(redis_url: str) -> None:
    p = Producer(redis_url)
    try:
        with pytest.raises(InvalidNameError, match="reserved for dead-letter topics; choose another name"):
            p.create_topic("%DLQ%billing", queues=1)
    finally:
        p.close()

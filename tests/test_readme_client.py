"""The documented examples of the client surface run as written against the test redis-server, and
do what their comments say: the README's producer + listener, and the guide pages' idempotent sends,
pull consumer, transactions, delays and concurrent listeners (docs/*.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mqorder.client.transaction_check import _checkers
from tests.support import ROOT

#: Each example's heading, and the page (under the repository root) that holds it.
PAGES = {"Idempotent sends (dedup window)": "docs/PRODUCING.md", "Batching sends": "docs/PRODUCING.md",
         "Pull consumer (the application drives consumption)": "docs/PULL_CONSUMER.md",
         "Transactional messages": "docs/TRANSACTIONS.md", "Delay messages": "docs/DELAYS.md",
         "Concurrent listeners (no order, retries through `%RETRY%<group>`)": "docs/CONCURRENT.md",
         "Use it": "README.md"}
SECTIONS = tuple(s for s in PAGES if s != "Use it")


def example(section: str) -> str:
    """The first Python block under the heading ``section`` (any level) of its page."""
    text = Path(ROOT / PAGES[section]).read_text()
    parts = re.split(rf"^#+ {re.escape(section)}\n", text, maxsplit=1, flags=re.M)
    assert len(parts) == 2, f"no heading '{section}' in {PAGES[section]}"
    match = re.search(r"```python\n(.*?)```", parts[1], re.S)
    assert match, f"no python example under '{section}' in {PAGES[section]}"
    return match.group(1)


def test_readme_producer_listener_runs(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first example: a send lands at offset 0 of its key's queue, and the listener registers."""
    from mqorder.client.selector import queue_index
    from mqorder.consumer.listener import get_listener, unregister_listener

    ns: dict[str, object] = {}
    try:
        exec(example("Use it"), ns)
        assert get_listener("billing", "orders") is not None
    finally:
        unregister_listener("billing", "orders")
    out = capsys.readouterr().out
    assert out.split() == [str(queue_index("42", 8)), "0"]  # crc32("42") mod 8, the first message there


@pytest.mark.parametrize("section", SECTIONS)
def test_documented_example_runs(section: str, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    if section != SECTIONS[0]:
        exec(example(SECTIONS[0]), {})  # the others use the "orders" topic it creates and fills
    ns: dict[str, object] = {}
    try:
        exec(example(section), ns)
    finally:
        _checkers.pop("orders", None)
    out = capsys.readouterr().out
    if section.startswith("Pull"):
        assert "b'{\"order\": 42, \"event\": \"paid\"}'" in out  # the message stored once, pulled
        assert out.count("paid") == 1
    if section.startswith("Batching"):
        assert out.split() == ["True"]  # one key's async sends, stored in call order
    if section.startswith("Transactional"):
        assert "COMMIT_MESSAGE 1" in out  # after the dedup example's one message
    if section.startswith("Delay"):
        assert "cannot delay a message" in out
    if section.startswith("Concurrent"):
        from mqorder.consumer.listener import get_listener, unregister_listener

        try:
            assert "send_emails registered" in out
            assert get_listener("mailer", "%RETRY%mailer") is not None  # the retry subscription came with it
        finally:
            unregister_listener("mailer", "emails")

"""The README's examples of the client surface (idempotent sends, pull consumer, transactions,
delays) run as written against the test redis-server, and do what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mqorder.client.transaction_check import _checkers
from tests.support import ROOT

SECTIONS = ("Idempotent sends (dedup window)", "Pull consumer (the application drives consumption)",
            "Transactional messages", "Delay messages",
            "Concurrent listeners (no order, retries through `%RETRY%<group>`)")


def example(section: str) -> str:
    text = Path(ROOT / "README.md").read_text()
    body = text.split(f"### {section}\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", body, re.S)
    assert match, f"no python example under '### {section}'"
    return match.group(1)


@pytest.mark.parametrize("section", SECTIONS)
def test_readme_example_runs(section: str, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
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

"""``mqorder.testing`` as an application's tests use it: its names import from the package (lazily),
and the builders make the messages and contexts a listener is called with."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from mqorder import ConsumeConcurrentlyContext, ConsumeOrderlyContext, MessageError, MessageQueue


def test_the_harnesses_import_from_the_package() -> None:
    import mqorder.testing as t
    from mqorder.testing import BeatProcess, RedisServer, WorkerProcess, project_env  # noqa: F401

    for name in t.__all__:
        assert getattr(t, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        t.nope  # noqa: B018


def test_importing_the_package_loads_no_harness() -> None:
    code = ("import sys, mqorder.testing; "
            "print(sorted(m for m in sys.modules if m.startswith('mqorder.testing.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_make_message_fills_what_the_engine_would() -> None:
    from mqorder.testing import make_message

    m = make_message('{"order": 42}', topic="orders", queue_id=3, queue_offset=7, sharding_key="42", tags="paid")
    assert m.body == b'{"order": 42}' and m.message_queue == MessageQueue("orders", "broker-a", 3)
    assert m.queue_offset == 7 and m.tags == "paid" and m.reconsume_times == 0
    assert m.key_hash == zlib.crc32(b"42")  # as send_orderly stores it: key mode orders by it
    assert make_message(b"x").key_hash is None and make_message(b"x").msg_id != make_message(b"x").msg_id
    with pytest.raises(MessageError, match="body must be bytes or str"):
        make_message({"order": 42})  # type: ignore[arg-type]


def test_contexts_take_their_queue_from_the_messages() -> None:
    from mqorder.testing import make_concurrent_context, make_message, make_orderly_context

    msgs = [make_message(b"a", topic="emails", queue_id=2, queue_offset=i) for i in range(3)]
    octx = make_orderly_context(msgs, group="billing", still_owner=False)
    assert isinstance(octx, ConsumeOrderlyContext)
    assert octx.message_queue == MessageQueue("emails", "broker-a", 2) and octx.group == "billing"
    assert octx.still_owner() is False and octx.auto_commit
    cctx = make_concurrent_context(msgs)
    assert isinstance(cctx, ConsumeConcurrentlyContext) and cctx.ack_index == 2 and cctx.still_owner()
    with pytest.raises(TypeError, match="still_owner must be a bool"):
        make_orderly_context(msgs, still_owner="yes")  # type: ignore[arg-type]

"""``mqorder status GROUP --key KEY`` through typer's CliRunner against a real redis-server: the
queue state comes from the real engine consuming in this process (a key whose listener raises),
never written by hand."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from mqorder import ConsumeOrderlyStatus, Producer
from mqorder.cli import app
from mqorder.client.selector import queue_index
from mqorder.consumer.engine import ConsumerEngine, request_class
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.settings import Settings
from mqorder.store.topics import TopicManager

S = ConsumeOrderlyStatus
QUEUES = 4


def cli(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def cli_json(*args: str) -> Any:
    res = cli(*args, "--json")
    assert res.exit_code in (0, 1), res.stderr + res.stdout
    return json.loads(res.stdout)


class Blocker:
    """A listener that raises on one key until released, and records what it handled."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.released = False
        self.handled: list[str] = []

    def listen(self, msgs, ctx):
        k = msgs[0].body.decode().split(":")[0]
        if k == self.key and not self.released:
            raise RuntimeError(f"card declined for {k}")
        self.handled.append(k)
        return S.SUCCESS


def run_queue(eng: ConsumerEngine, spec: ListenerSpec, mq: MessageQueue, runs: int, token: str = "") -> str:
    """Up to ``runs`` runs of ``mq`` by client c1, each re-dispatched as the Celery task would (the
    suspend countdown not waited out); returns the token of the next request."""
    if not token:
        RebalanceLockManager(eng.brokers).assign("g", [(mq, "c1", "tok0")])
        token = "tok0"
    for _ in range(runs):
        out = request_class(spec)(eng, spec, "g", mq, token).run()
        if not out.needs_dispatch or out.target != "c1":
            break
        token = out.token
    return token


@pytest.fixture
def world(settings: Settings) -> Iterator[tuple[Producer, ConsumerEngine]]:
    p = Producer(settings=settings)
    p.create_topic("orders", queues=QUEUES)
    TopicManager(p.brokers).subscribe("g", "orders", MessageModel.CLUSTERING)
    eng = ConsumerEngine(settings, "c1")
    yield p, eng
    p.close()
    eng.brokers.close()


def same_queue_keys(n: int, like: str) -> list[str]:
    """``n`` keys that the default selector puts on the queue of ``like``."""
    q = queue_index(like, QUEUES)
    return [k for k in (f"order-{i}" for i in range(1000)) if queue_index(k, QUEUES) == q and k != like][:n]


def test_a_blocked_key_shows_its_queue_head_retries_owner_and_what_waits(world) -> None:
    p, eng = world
    others = same_queue_keys(2, "order-7")
    for i, k in enumerate(["order-7", others[0], "order-7", others[1]]):
        p.send_orderly("orders", f"{k}:{i}".encode(), sharding_key=k, keys=[f"id-{i}"])
    mq = MessageQueue("orders", "broker-a", queue_index("order-7", QUEUES))
    blocker = Blocker("order-7")
    spec = ListenerSpec(blocker.listen, "orders", "g", suspend_current_queue_time_millis=10)
    token = run_queue(eng, spec, mq, runs=2)

    (lane,) = cli_json("status", "g", "--key", "order-7")["lanes"]
    assert (lane["topic"], lane["queue_id"], lane["queue_count"], lane["ordering"]) == ("orders", mq.queue_id, 4, "queue")
    assert lane["committed"] == 0 and lane["max_offset"] == 4 and lane["lag"] == 4
    assert lane["owner"] == "c1" and lane["epoch"] > 0 and lane["lease_left_ms"] > 0
    head = lane["head"]
    assert (head["offset"], head["of_this_key"], head["reconsume_times"], head["msg_keys"]) == (0, True, 2, ["id-0"])
    assert lane["waiting"] == 2 and lane["waiting_offsets"] == [0, 2]
    assert lane["scan_from"] == 0 and lane["scan_to"] == 4 and lane["scan_complete"]
    assert "failed 2 time(s)" in lane["verdict"]
    assert head["last_error"] == "RuntimeError: card declined for order-7"  # recorded by commit.lua

    # Another key of the same queue waits behind it: queue order.
    (other,) = cli_json("status", "g", "--key", others[0])["lanes"]
    assert other["waiting"] == 1 and not other["head"]["of_this_key"]
    assert "behind offset 0 (another key, 2 retries): queue order" in other["verdict"]

    # Human output names the same facts.
    res = cli("status", "g", "orders", "--key", "order-7")
    assert res.exit_code == 0, res.stderr
    for text in ("orders:broker-a:", "offset 0 (this key)", "2 retries", "id-0", "key waiting", "0, 2", "c1",
                 "RuntimeError: card declined for order-7 (offset 0)"):
        assert text in res.stdout, text

    # --check: stuck once the backlog waited longer than --stuck-after.
    time.sleep(0.05)
    assert cli("status", "g", "--key", "order-7", "--stuck-after", "0.01", "--check").exit_code == 1
    assert cli("status", "g", "--key", "order-7", "--check").exit_code == 0

    blocker.released = True
    run_queue(eng, spec, mq, runs=5, token=token)
    (lane,) = cli_json("status", "g", "--key", "order-7")["lanes"]
    assert lane["waiting"] == 0 and lane["head"] is None and lane["lag"] == 0
    assert lane["verdict"] == "nothing of this key waits"


def test_a_parked_key_in_key_mode_and_a_bounded_scan(world) -> None:
    p, eng = world
    others = same_queue_keys(1, "acct-1")
    for i in range(30):
        k = "acct-1" if i in (5, 20) else others[0]
        p.send_orderly("orders", f"{k}:{i}".encode(), sharding_key=k)
    mq = MessageQueue("orders", "broker-a", queue_index("acct-1", QUEUES))
    spec = ListenerSpec(Blocker("acct-1").listen, "orders", "g", ordering="key",
                        suspend_current_queue_time_millis=10_000)
    run_queue(eng, spec, mq, runs=1)

    (lane,) = cli_json("status", "g", "--key", "acct-1")["lanes"]
    assert lane["ordering"] == "key" and lane["parked"]
    assert lane["committed"] == 5 and lane["waiting_offsets"] == [5, 20] and lane["first_waiting_retries"] == 1
    assert "parked" in lane["verdict"]
    assert lane["first_waiting_error"] == "RuntimeError: card declined for acct-1"  # key_commit.lua's
    # The other key finished everything (the offset map): nothing of it waits although the
    # committed offset is below its messages.
    (other,) = cli_json("status", "g", "--key", others[0])["lanes"]
    assert other["waiting"] == 0 and not other["parked"]
    # A scan of 3 messages from the committed offset sees only offset 5 and says so.
    (short,) = cli_json("status", "g", "--key", "acct-1", "--scan", "3")["lanes"]
    assert short["waiting_offsets"] == [5] and not short["scan_complete"]
    res = cli("status", "g", "--key", "acct-1", "--scan", "3")
    assert "stopped at --scan 3" in res.stdout and "PARKED" in res.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["status", "g", "--key", ""], "--key must not be empty"),
    (["status", "nobody", "--key", "k"], "consumer group 'nobody' does not exist"),
    (["status", "g", "nosuch", "--key", "k"], "nosuch"),
    (["status", "g", "--key", "k", "--scan", "0"], "--scan must be from 1 to 100,000"),
])
def test_bad_input_is_refused_with_what_to_do(world, args: list[str], message: str) -> None:
    res = cli(*args)
    assert res.exit_code == 2
    assert message in res.stderr

"""The operator's tools on a Redis Cluster: every admin command with ``--redis-url redis+cluster://``,
the exporter, a retention pass and two pull consumers, against a real 3-master cluster
(``mqorder.testing.cluster``) with each topic's queues spread over all three shards.

Queue state comes from the real engine and scripts (``ConsumeRequest`` runs in this process), as in
``tests/test_admin_cli.py``; what each command reports is checked against what every shard holds,
read node by node with plain clients, so a command that reads or writes only one shard fails here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis.crc import key_slot
from typer.testing import CliRunner, Result

from mqorder import ConsumeOrderlyStatus, Producer, keys
from mqorder.cli import app
from mqorder.client.pull_consumer import PullConsumer, PullStatus
from mqorder.client.selector import queue_index
from mqorder.consumer.consume_request import ConsumeRequest
from mqorder.consumer.engine import ConsumerEngine
from mqorder.consumer.listener import ListenerSpec
from mqorder.model import MessageModel, MessageQueue
from mqorder.rebalance.lock_manager import RebalanceLockManager
from mqorder.rebalance.membership import ClientRegistry, Subscription
from mqorder.retention.trimmer import RetentionTrimmer
from mqorder.settings import Settings, get_settings, load_settings
from mqorder.store.connect import close, connect
from mqorder.store.log import MessageLog
from mqorder.testing.cluster import ClusterDeployment

S = ConsumeOrderlyStatus
#: Queues per test topic: enough that every shard of three holds several (checked by ``spread``).
QUEUES = 9


@pytest.fixture(scope="module")
def cdep() -> Iterator[ClusterDeployment]:
    with ClusterDeployment(masters=3) as d:
        yield d


@pytest.fixture
def url(cdep: ClusterDeployment, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The cluster's store URL, every master flushed; also ``MQORDER_REDIS_URL`` for in-process code."""
    for node in cdep.nodes[: cdep.masters]:
        node.flushall()
    monkeypatch.setenv("MQORDER_REDIS_URL", cdep.url())
    get_settings.cache_clear()
    yield cdep.url()
    get_settings.cache_clear()


@pytest.fixture
def settings(url: str) -> Settings:
    return load_settings(redis_url=url)


@pytest.fixture
def producer(settings: Settings) -> Iterator[Producer]:
    p = Producer(settings=settings)
    yield p
    p.close()


@pytest.fixture
def engine(settings: Settings) -> Iterator[ConsumerEngine]:
    eng = ConsumerEngine(settings, "c1")
    yield eng
    eng.brokers.close()


def cli(url: str, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(app, ["--redis-url", url, *args], input=input, catch_exceptions=False)


def cli_json(url: str, *args: str, input: str | None = None) -> Any:
    res = cli(url, *args, "--json", input=input)
    assert res.exit_code == 0, res.stderr + res.stdout
    return json.loads(res.stdout)


def masters(cdep: ClusterDeployment) -> list[redis.Redis]:
    return [cdep.client(n) for n in cdep.nodes[: cdep.masters]]


def all_keys(cdep: ClusterDeployment, pattern: str) -> list[bytes]:
    """Keys matching ``pattern`` on every master, each node asked itself."""
    return [k for c in masters(cdep) for k in c.scan_iter(match=pattern, count=1000)]


def spread(cdep: ClusterDeployment, mqs: list[MessageQueue]) -> set[int]:
    """Ports of the masters serving ``mqs``: the test is only meaningful when that is all three."""
    ports = {cdep.master_of_slot(key_slot(mq.tag.encode())).port for mq in mqs}
    assert len(ports) == cdep.masters, f"the topic's queues are on {len(ports)} shards only"
    return ports


def key_for(queue: int, queues: int = QUEUES, prefix: str = "k") -> str:
    """A sharding key that the default selector sends to ``queue``."""
    return next(f"{prefix}{i}" for i in range(10_000) if queue_index(f"{prefix}{i}", queues) == queue)


def assign(engine: ConsumerEngine, group: str, mqs: list[MessageQueue], client: str = "c1") -> dict[MessageQueue, str]:
    return RebalanceLockManager(engine.brokers).assign(group, [(mq, client, f"tok-{mq.queue_id}") for mq in mqs])


def consume(engine: ConsumerEngine, group: str, mq: MessageQueue, listener: Any, token: str) -> Any:
    return ConsumeRequest(engine, ListenerSpec(listener, mq.topic, group, max_reconsume_times=-1), group, mq,
                          token).run()


def ok(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
    return S.SUCCESS


def suspend(msgs: Any, ctx: Any) -> ConsumeOrderlyStatus:
    return S.SUSPEND_CURRENT_QUEUE_A_MOMENT


def stored(cdep: ClusterDeployment, mq: MessageQueue) -> list[int]:
    """Offsets the queue's log holds, read from the node that serves it."""
    node = cdep.client(cdep.master_of_slot(key_slot(mq.tag.encode())))
    entries: Any = node.xrange(keys.queue_log(mq.tag))
    return [int(e[0].split(b"-")[0]) for e in entries]


# -- topics and produce ----------------------------------------------------------------------------


def test_topic_commands_and_produce_cover_every_shard_and_delete_leaves_no_key_on_any(
    cdep: ClusterDeployment, url: str
) -> None:
    created = cli_json(url, "topic", "create", "orders", "--queues", str(QUEUES))
    assert created["queue_count"] == QUEUES and created["messages"] == 0
    mqs = [MessageQueue("orders", "broker-a", i) for i in range(QUEUES)]
    spread(cdep, mqs)
    lines = "".join(json.dumps({"k": key_for(i % QUEUES), "seq": i}) + "\n" for i in range(90))
    produced = cli_json(url, "produce", "orders", "--key-field", "k", "--chunk", "25", input=lines)
    assert produced["sent"] == 90 and produced["by_queue"] == {mq.key: 10 for mq in mqs}
    for mq in mqs:  # each queue holds its key's lines, in order, on its own shard
        assert stored(cdep, mq) == list(range(10))

    info = cli_json(url, "topic", "describe", "orders")
    assert [(q["queue_id"], q["min_offset"], q["max_offset"], q["messages"]) for q in info["queues"]] == [
        (i, 0, 10, 10) for i in range(QUEUES)
    ]
    assert all(q["bytes"] > 0 for q in info["queues"]) and info["messages"] == 90
    assert [(t["topic"], t["messages"]) for t in cli_json(url, "topic", "list")] == [("orders", 90)]
    assert cli_json(url, "topic", "perm", "orders", "r")["perm"] == "r"
    assert cli_json(url, "topic", "retention", "orders", "--max-messages", "4")["retention"]["retention_max_messages"] == 4

    producer = Producer(url)
    producer.topics.subscribe("g", "orders", MessageModel.CLUSTERING)
    producer.close()
    refused = cli(url, "topic", "delete", "orders")
    assert refused.exit_code == 1 and "subscribed by group(s) g" in refused.stderr
    dry = cli_json(url, "topic", "delete", "orders", "--dry-run")
    assert dry["keys_by_kind"]["log"] == QUEUES and dry["keys_by_kind"]["next"] == QUEUES
    assert len(all_keys(cdep, "mqorder:{orders:*")) == sum(dry["keys_by_kind"].values())
    done = cli_json(url, "topic", "delete", "orders", "--force")
    assert done["messages"] == 90 and done["groups"] == ["g"]
    # Every shard's queues: nothing left but the marks that refuse producers still holding the route.
    left = all_keys(cdep, "mqorder:{orders:*")
    assert [k for k in left if not k.endswith(b":gone")] == [] and len(left) == QUEUES
    whole = connect(url)
    assert not whole.exists(keys.topic_route("orders")) and not whole.exists(keys.topic_subs("orders"))
    assert not whole.sismember(keys.topics(), "orders")
    close(whole)
    assert cli(url, "topic", "describe", "orders").exit_code == 2


# -- status, consumers, offsets ---------------------------------------------------------------------


def test_status_consumers_and_a_fenced_offsets_reset_on_every_shard(
    cdep: ClusterDeployment, url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=QUEUES)
    producer.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    mqs = producer.describe_topic("t").message_queues
    spread(cdep, mqs)
    producer.send_orderly_batch("t", [(key_for(i % QUEUES), f"{i}".encode()) for i in range(4 * QUEUES)])
    assert set(assign(engine, "g", mqs).values()) == {"DISPATCH"}
    for mq in mqs[:6]:
        assert consume(engine, "g", mq, ok, f"tok-{mq.queue_id}").consumed == 4

    st = cli_json(url, "status", "g")
    rows = {q["queue_id"]: q for q in st["queues"]}
    assert sorted(rows) == list(range(QUEUES)) and st["lag"] == 4 * 3
    for i, q in rows.items():
        assert (q["max_offset"], q["committed"]) == (4, 4 if i < 6 else 0)
        # Every lease judged by its own shard's clock: live, and about a lock's life left.
        assert q["owner"] == "c1" and 50_000 < q["lease_left_ms"] <= 60_000 and q["epoch"] > 0
    gc = cli_json(url, "consumers", "g")
    assert gc["consumers"] == []  # nobody registered: the locks are c1's but c1 is no client
    ClientRegistry(engine.brokers.meta, 60_000).register("c1", [Subscription("g", "t", MessageModel.CLUSTERING)])
    (c1,) = cli_json(url, "consumers", "g")["consumers"]
    assert c1["locks_held"] == QUEUES and c1["assigned"] == sorted(mq.key for mq in mqs)

    refused = cli(url, "offsets", "reset", "g", "t", "--to", "earliest")
    assert refused.exit_code == 1 and "are live (c1)" in refused.stderr
    epochs = {q["queue_id"]: q["epoch"] for q in rows.values()}
    reset = cli_json(url, "offsets", "reset", "g", "t", "--to", "earliest", "--force")
    assert sorted((q["queue_id"], q["old_offset"], q["new_offset"], q["owner"]) for q in reset["queues"]) == [
        (i, 4 if i < 6 else 0, 0, "c1") for i in range(QUEUES)
    ]
    after = {q["queue_id"]: q for q in cli_json(url, "status", "g")["queues"]}
    for i, q in after.items():  # on every shard: offset moved, lock released, epoch bumped (fenced)
        assert q["committed"] == 0 and q["owner"] == "" and q["epoch"] > epochs[i]
    assert cli_json(url, "offsets", "reset", "g", "t", "--to", "3", "--force")["queues"][0]["new_offset"] == 3
    assert {q["committed"] for q in cli_json(url, "status", "g")["queues"]} == {3}
    latest = cli_json(url, "offsets", "reset", "g", "t", "--to", f"@{int(time.time() * 1000) + 60_000}", "--force")
    assert {q["new_offset"] for q in latest["queues"]} == {4}
    assert MessageLog(engine.brokers).consume_offset("g", mqs[-1]) == 4


# -- dlq and messages ----------------------------------------------------------------------------------


def test_dlq_list_show_replay_and_message_show_across_shards(
    cdep: ClusterDeployment, url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=QUEUES)
    producer.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    mqs = producer.describe_topic("t").message_queues
    spread(cdep, mqs)
    sent: dict[int, list[str]] = {}
    for i in range(2 * QUEUES):
        q = i % QUEUES
        body = f"q{q}-{i // QUEUES}"
        producer.send_orderly("t", body.encode(), sharding_key=key_for(q), keys=[f"q{q}"])
        sent.setdefault(q, []).append(body)
    assign(engine, "g", mqs)
    dead = ListenerSpec(suspend, "t", "g", max_reconsume_times=0)
    for mq in mqs:
        out = ConsumeRequest(engine, dead, "g", mq, f"tok-{mq.queue_id}").run()
        while out.needs_dispatch:
            out = ConsumeRequest(engine, dead, "g", mq, out.token).run()

    page = cli_json(url, "dlq", "list", "g", "--limit", "100")
    assert page["total"] == 2 * QUEUES
    assert sorted((m["origin_queue_id"], m["origin_offset"]) for m in page["messages"]) == [
        (q, o) for q in range(QUEUES) for o in (0, 1)
    ]
    assert cli_json(url, "dlq", "show", "g", "--offset", "0")["reason"].startswith("max reconsume times 0")
    replay = cli_json(url, "dlq", "replay", "g")
    assert replay["stored"] == 2 * QUEUES and replay["by_queue"] == {mq.key: 2 for mq in mqs}
    log = MessageLog(engine.brokers)
    for mq in mqs:  # back on its own queue (its own shard), in the original order
        assert [m.body.decode() for m in log.read(mq, 2, 10)] == sent[mq.queue_id]
    assert cli_json(url, "dlq", "replay", "g")["duplicates"] == 2 * QUEUES

    last = mqs[-1]
    shown = cli_json(url, "message", "show", "t", "--queue", str(last.queue_id), "--offset", "3")
    assert shown["body"] == sent[last.queue_id][1] and shown["groups"][0]["committed"] == 2
    msg_id = log.read(last, 3, 1)[0].msg_id
    found = cli(url, "message", "show", "t", "--msg-id", msg_id, "--json")
    assert found.exit_code == 0, found.stderr
    # The replayed copy keeps the dead letter's id: both are found, each on the queue's own shard.
    assert [(m["queue_id"], m["offset"]) for m in json.loads(found.stdout)] == [(last.queue_id, 1), (last.queue_id, 3)]
    assert cli_json(url, "txn", "t")["half"] == []


# -- exporter --------------------------------------------------------------------------------------------


def test_exporter_scrapes_every_queue_and_lane_of_every_shard(
    cdep: ClusterDeployment, url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    producer.create_topic("t", queues=QUEUES)
    producer.topics.subscribe("g", "t", MessageModel.CLUSTERING)
    mqs = producer.describe_topic("t").message_queues
    spread(cdep, mqs)
    producer.send_orderly_batch("t", [(key_for(i % QUEUES), b"x") for i in range(3 * QUEUES + 2)])
    assign(engine, "g", mqs)
    consume(engine, "g", mqs[0], ok, "tok-0")
    res = cli(url, "exporter", "--once")
    assert res.exit_code == 0, res.stdout[-2000:]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(res.stdout) for s in f.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("mqorder_up") == 1
    want = {mq.queue_id: (4 if mq.queue_id < 2 else 3) for mq in mqs}
    for mq in mqs:
        q = {"topic": "t", "broker": "broker-a", "queue": str(mq.queue_id)}
        assert value("mqorder_queue_max_offset", **q) == want[mq.queue_id]
        assert value("mqorder_queue_lag", group="g", **q) == (0 if mq.queue_id == 0 else want[mq.queue_id])
        assert value("mqorder_queue_owner_info", group="g", owner="c1", **q) == 1  # each lease live by its shard's clock


# -- retention --------------------------------------------------------------------------------------------


def test_a_trim_pass_trims_every_queue_of_every_shard_under_both_policies(
    cdep: ClusterDeployment, url: str, settings: Settings, producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MQORDER_RETENTION_TRIM_CHUNK", "4")  # several rounds per queue
    get_settings.cache_clear()
    # 'time': older than 3 s goes. 3 s, not 1: the check at the end must come before the young
    # messages age out too (on a loaded machine the CLI's pass took over a second).
    producer.create_topic("aged", queues=QUEUES, retention_ms=3000)
    producer.create_topic("done", queues=QUEUES, retention_policy="consumed", retention_ms=60_000, retention_min_ms=0)
    producer.topics.subscribe("g", "done", MessageModel.CLUSTERING)
    aged, done = (producer.describe_topic(t).message_queues for t in ("aged", "done"))
    spread(cdep, aged)
    spread(cdep, done)
    for topic in ("aged", "done"):
        producer.send_orderly_batch(topic, [(key_for(i % QUEUES), f"{i}".encode()) for i in range(10 * QUEUES)])
    for mq in done:  # the group consumed a different amount of each queue
        producer.brokers.meta.hset(keys.sub_state(mq.tag, "g"), "offset", mq.queue_id)
    time.sleep(3.1)
    producer.send_orderly_batch("aged", [(key_for(q), b"young") for q in range(QUEUES)])

    report = cli_json(url, "retention", "run")
    assert (report["by_topic"]["aged"], report["by_topic"]["done"]) == (10 * QUEUES, sum(range(QUEUES)))
    assert report["holders"]["aged"] == [] and report["holders"]["done"] == ["g"]
    assert report["calls"] > 3 * QUEUES  # chunks of 4 entries: rounds of calls, every shard in each
    for mq in aged:  # chunks of 4: several rounds on every shard, until each queue was done
        assert stored(cdep, mq) == [10]
    for mq in done:
        assert stored(cdep, mq) == list(range(mq.queue_id, 10))
    assert RetentionTrimmer(producer.brokers, settings).run().trimmed == 0  # nothing more is due


# -- pull consumers -----------------------------------------------------------------------------------------


def test_two_pull_consumers_share_queues_on_three_shards_in_order_and_lose_nothing(
    cdep: ClusterDeployment, url: str, producer: Producer
) -> None:
    fast = load_settings(redis_url=url, heartbeat_interval_ms=200, heartbeat_timeout_ms=2000)
    producer.create_topic("orders", queues=QUEUES)
    mqs = producer.describe_topic("orders").message_queues
    spread(cdep, mqs)
    n_keys, per_key = 12, 25
    got: dict[str, list[int]] = {}
    held: dict[str, set[MessageQueue]] = {}
    lock = threading.Lock()
    a = PullConsumer("audit", settings=fast, client_id="pa")
    b = PullConsumer("audit", settings=fast, client_id="pb")
    a.fetch_message_queues_in_balance("orders")  # both join before either drains
    b.fetch_message_queues_in_balance("orders")

    def drain(c: PullConsumer, stop: threading.Event) -> None:
        while not stop.is_set():
            mine = c.fetch_message_queues_in_balance("orders")
            with lock:
                held.setdefault(c.client_id, set()).update(mine)
            for mq in mine:
                res = c.pull(mq, c.fetch_consume_offset(mq), 7)
                if res.pull_status is PullStatus.FOUND:
                    with lock:
                        for m in res.msg_found_list:
                            k, seq = m.body.decode().split(":")
                            got.setdefault(k, []).append(int(seq))
                    c.update_offset(mq, res.next_begin_offset)  # never fenced: it raises otherwise
            time.sleep(0.02)

    stop = threading.Event()
    threads = [threading.Thread(target=drain, args=(c, stop)) for c in (a, b)]
    for t in threads:
        t.start()
    try:
        for seq in range(per_key):
            producer.send_orderly_batch("orders", [(f"key{k}", f"key{k}:{seq}".encode()) for k in range(n_keys)])
        deadline = time.monotonic() + 20
        while sum(len(v) for v in got.values()) < n_keys * per_key and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert got == {f"key{k}": list(range(per_key)) for k in range(n_keys)}  # in order, none lost, none twice
    assert not held["pa"] & held["pb"] and held["pa"] | held["pb"] == set(mqs)
    for c in (a, b):  # each consumer's share spans more than one shard
        assert len({cdep.master_of_slot(key_slot(mq.tag.encode())).port for mq in held[c.client_id]}) > 1
        assert sum(c.fetch_consume_offset(mq) for mq in held[c.client_id]) == sum(
            MessageLog(c.brokers).max_offset(mq) for mq in held[c.client_id])
    a.shutdown()
    assert b.fetch_message_queues_in_balance("orders") == sorted(mqs)  # the leaver's queues move over
    # A blocking pull waits on the shard of its queue for the next message.
    mq = producer.send_orderly("orders", b"key0:late", sharding_key="key0").message_queue
    offset = b.fetch_consume_offset(mq) + 1
    threading.Timer(0.3, lambda: producer.send_orderly("orders", b"key0:later", sharding_key="key0")).start()
    res = b.pull(mq, offset, 10, block_ms=3000)
    assert res.pull_status is PullStatus.FOUND and [m.body for m in res.msg_found_list] == [b"key0:later"]
    b.update_offset(mq, res.next_begin_offset)
    b.shutdown()


def test_the_demo_listener_runs_on_a_cluster_and_cross_slot_keys_are_no_outage(
    cdep: ClusterDeployment, url: str, producer: Producer, engine: ConsumerEngine
) -> None:
    """The shipped demo listener wrote four keys in different slots from one script: every call
    failed CROSSSLOT, which the cluster client reported as "not usable right now" (transient), and
    every queue of the demo suspended for good (an operator walk-through on a 3-shard cluster)."""
    from mqorder.examples import order_lifecycle as demo
    from mqorder.store.connect import connect as connect_store

    demo._client = demo._apply = None  # connect to this test's cluster (MQORDER_REDIS_URL)
    try:
        producer.create_topic("orders-c", queues=3)
        producer.topics.subscribe("g", "orders-c", MessageModel.CLUSTERING)
        mqs = producer.describe_topic("orders-c").message_queues
        for seq in (1, 2, 3, 4):
            for order in range(6):
                producer.send_orderly("orders-c", json.dumps({"order": order, "seq": seq}).encode(),
                                      sharding_key=str(order))
        assign(engine, "g", mqs)
        assert sum(consume(engine, "g", mq, demo.on_order_event, f"tok-{mq.queue_id}").consumed for mq in mqs) == 24
        counts = {k.decode(): int(v) for k, v in demo._client.hgetall(demo.COUNTS).items()}
        assert counts == {"handled": 24}
    finally:
        if demo._client is not None:
            close(demo._client)
        demo._client = demo._apply = None

    client = connect_store(url)
    try:
        with pytest.raises(redis.ResponseError, match=r"CROSSSLOT .* give them one hash tag"):
            client.eval("return 1", 2, "a", "b")  # two slots: no retry fixes it
    finally:
        close(client)

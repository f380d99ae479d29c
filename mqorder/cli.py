"""The ``mqorder`` command line: the demo, topics, queue status and settings."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from mqorder.errors import MQOrderError
from mqorder.metrics.exporter import exporter
from mqorder.pipeline_cli import app as pipeline_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RocketMQ-style orderly consumption on Celery + Redis")
topic_app = typer.Typer(no_args_is_help=True, help="Create and inspect topics")
app.add_typer(topic_app, name="topic")
app.add_typer(pipeline_app, name="pipeline")
console = Console()


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


@app.command()
def demo(
    orders: int = typer.Option(2000, min=1, help="order lifecycles to publish (4 events each)"),
    queues: int = typer.Option(8, min=1, max=1024, help="queues of the demo topic"),
    workers: int = typer.Option(2, min=1, max=16, help="worker processes to start"),
    concurrency: int = typer.Option(2, min=1, max=64, help="prefork processes per worker"),
    timeout: float = typer.Option(300.0, min=1, help="seconds to wait for consumption"),
    keep: bool = typer.Option(False, help="keep the demo's Redis keys and logs"),
) -> None:
    """Publish order lifecycles through real workers and check that every order stayed in order."""
    from mqorder.demo import run_demo

    try:
        res = run_demo(orders, queues, workers, concurrency, timeout, console=console, keep=keep)
    except MQOrderError as exc:
        _fail(exc)
        return
    raise typer.Exit(0 if res.ok else 1)


@topic_app.command("create")
def topic_create(
    name: str,
    queues: int = typer.Option(8, help="queues per broker"),
    broker: list[str] = typer.Option(None, help="broker names (default: the default broker)"),
) -> None:
    from mqorder.client.producer import Producer

    try:
        with Producer() as p:
            route = p.create_topic(name, queues, brokers=broker or None)
    except MQOrderError as exc:
        _fail(exc)
        return
    console.print(f"topic {route.topic}: {route.queue_count} queues {route.queues_per_broker}")


@topic_app.command("list")
def topic_list() -> None:
    from mqorder.settings import get_settings
    from mqorder.store.brokers import BrokerRegistry
    from mqorder.store.topics import TopicManager

    try:
        s = get_settings()
        tm = TopicManager(BrokerRegistry(s.redis_url, s.brokers))
        for t in tm.list_topics():
            console.print(t)
    except MQOrderError as exc:
        _fail(exc)


@app.command()
def status(topic: str, group: str) -> None:
    """Per-queue lag, owner and epoch of GROUP on TOPIC (what Flower cannot show)."""
    from mqorder.rebalance.lock_manager import RebalanceLockManager
    from mqorder.settings import get_settings
    from mqorder.store.brokers import BrokerRegistry
    from mqorder.store.log import MessageLog
    from mqorder.store.topics import TopicManager

    try:
        s = get_settings()
        brokers = BrokerRegistry(s.redis_url, s.brokers)
        route = TopicManager(brokers).describe_topic(topic)
        mlog, locks = MessageLog(brokers), RebalanceLockManager(brokers)
        t = Table(title=f"{group} on {topic}")
        for c in ("queue", "max offset", "consumed", "lag", "owner", "epoch", "running"):
            t.add_column(c)
        for mq in route.message_queues:
            mx, off = mlog.max_offset(mq), mlog.consume_offset(group, mq)
            e = locks.lock_entry(group, mq)
            t.add_row(mq.key, str(mx), str(off), str(mx - off), e.owner or "-", str(e.epoch), "yes" if e.running else "")
        console.print(t)
    except MQOrderError as exc:
        _fail(exc)


@app.command()
def config() -> None:
    """Print the effective settings (passwords redacted); fails with a clear message if invalid."""
    from mqorder.settings import load_settings

    try:
        console.print_json(json.dumps(load_settings().describe()))
    except MQOrderError as exc:
        _fail(exc)


app.command("exporter")(exporter)


def main() -> None:
    try:
        app()
    except MQOrderError as exc:  # pragma: no cover
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()

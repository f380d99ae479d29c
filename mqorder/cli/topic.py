"""``mqorder topic``: create, list, describe, delete topics; set their permission and retention."""

from __future__ import annotations

from enum import StrEnum

import typer

from mqorder.admin import render, topics
from mqorder.admin.common import Admin
from mqorder.cli.common import JSON_OPT, emit, enum_parser
from mqorder.retention.policy import RetentionPolicy, TopicRetention

app = typer.Typer(no_args_is_help=True, help="Create, list, describe, delete topics and set their permission and retention")


class TopicPerm(StrEnum):
    """RocketMQ's topic permission (``PERM_READ | PERM_WRITE``), as ``mqorder.store.topics`` stores it."""

    RW = "rw"
    R = "r"
    W = "w"


PERM_HELP = "rw, r (consumed, sends refused) or w (filled, not consumed yet)"
parse_perm = enum_parser(TopicPerm, "topic permission")
parse_policy = enum_parser(RetentionPolicy, "retention policy")


@app.command("create")
def topic_create(
    name: str = typer.Argument(..., help="topic name"),
    queues: int = typer.Option(8, help="queues per broker (cannot change later: keys would move)"),
    broker: list[str] = typer.Option(None, help="broker names (default: the default broker); repeat for several"),
    perm: TopicPerm = typer.Option(None, parser=parse_perm, help=PERM_HELP + " (default rw)"),
    retention_policy: RetentionPolicy = typer.Option(
        None, parser=parse_policy, help="time (trim what is older, consumed or not) or consumed (only what every "
        "group consumed); default MQORDER_RETENTION_POLICY"),
    retention_ms: int = typer.Option(None, help="how long messages are kept (ms); default MQORDER_RETENTION_MS (72 h)"),
    retention_min_ms: int = typer.Option(None, help="consumed policy: consumed messages kept this long for replay (ms)"),
    retention_max_messages: int = typer.Option(None, help="most messages kept per queue (0: no cap)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Create a topic (idempotent for the same layout); running workers pick it up at once."""
    retention = TopicRetention.of(policy=retention_policy, retention_ms=retention_ms,
                                  retention_min_ms=retention_min_ms, retention_max_messages=retention_max_messages)
    with Admin.open() as admin:
        info = topics.create(admin, name, queues, broker or None, perm.value if perm is not None else None, retention)
    emit(info, as_json, render.topic)


@app.command("list")
def topic_list(as_json: bool = JSON_OPT) -> None:
    """Every topic with its queue count, brokers, messages, size and subscribed groups."""
    with Admin.open() as admin:
        infos = topics.list_topics(admin)
    emit(infos, as_json, render.topic_list)


@app.command("describe")
def topic_describe(name: str = typer.Argument(..., help="topic name"), as_json: bool = JSON_OPT) -> None:
    """Each queue of a topic: broker, min and max offset, messages and memory."""
    with Admin.open() as admin:
        info = topics.describe(admin, name)
    emit(info, as_json, render.topic)


@app.command("perm")
def topic_perm(
    name: str = typer.Argument(..., help="topic name"),
    perm: TopicPerm = typer.Argument(..., parser=parse_perm, help=PERM_HELP),
    as_json: bool = JSON_OPT,
) -> None:
    """Change a topic's permission (RocketMQ's updateTopicPerm); workers rebalance at once."""
    with Admin.open() as admin:
        info = topics.update_perm(admin, name, perm.value)
    emit(info, as_json, render.topic)


@app.command("retention")
def topic_retention(
    name: str = typer.Argument(..., help="topic name"),
    policy: RetentionPolicy = typer.Option(None, "--policy", parser=parse_policy, help="time or consumed"),
    retention_ms: int = typer.Option(None, "--ms", help="how long messages are kept (ms)"),
    retention_min_ms: int = typer.Option(None, "--min-ms", help="consumed policy: kept this long for replay (ms)"),
    max_messages: int = typer.Option(None, "--max-messages", help="most messages kept per queue (0: no cap)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Show a topic's retention, or change it (values not given stay); the next trim pass applies it."""
    change = TopicRetention.of(policy=policy, retention_ms=retention_ms, retention_min_ms=retention_min_ms,
                               retention_max_messages=max_messages)
    with Admin.open() as admin:
        info = topics.update_retention(admin, name, change) if change.to_fields() else topics.describe(admin, name)
    emit(info, as_json, render.topic)


@app.command("delete")
def topic_delete(
    name: str = typer.Argument(..., help="topic name"),
    force: bool = typer.Option(False, "--force", help="delete even while groups subscribe (they lose their offsets)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be removed, remove nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """Delete a topic with its messages and every group's offsets on it (refused while subscribed)."""
    with Admin.open() as admin:
        report = topics.delete(admin, name, force=force, dry_run=dry_run)
    emit(report, as_json, render.topic_deleted)

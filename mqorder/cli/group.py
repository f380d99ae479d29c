"""``mqorder group``: list every consumer group, delete a retired one (RocketMQ's deleteSubGroup)."""

from __future__ import annotations

import typer

from mqorder.admin import groups, render
from mqorder.admin.common import Admin
from mqorder.admin.group_list import group_list
from mqorder.cli.common import EXIT_CHECK, JSON_OPT, emit

app = typer.Typer(no_args_is_help=True, help="List every consumer group; delete a retired one with its offsets and state")


@app.command("list")
def group_list_cmd(
    stuck_after: float = typer.Option(
        60.0, "--stuck-after", min=0.0, max=10 * 365 * 86400.0,
        help="seconds a backlog may wait without progress before it counts as stuck (as `status`)"
    ),
    check: bool = typer.Option(False, "--check", help="exit 1 if any group has a stuck queue (cron, health checks)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Every consumer group: its topics, live consumers, queues, lag and stuck queues, in one call."""
    with Admin.open() as admin:
        gl = group_list(admin, stuck_after)
    emit(gl, as_json, render.group_listed)
    if check and gl.stuck:
        raise typer.Exit(EXIT_CHECK)


@app.command("delete")
def group_delete(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Option(None, "--topic", help="only the group's subscription to this topic"),
    force: bool = typer.Option(False, "--force", help="delete even while live consumers subscribe the group"),
    with_dlq: bool = typer.Option(False, "--with-dlq", help="delete its dead-letter topic %DLQ%<group> too"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be removed, remove nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """Delete a group's subscriptions, offsets, state and stats (all topics or --topic), and its retry
    topic; refused while live consumers subscribe it. Its DLQ is kept unless --with-dlq."""
    with Admin.open() as admin:
        report = groups.delete(admin, group, topic=topic, force=force, dry_run=dry_run, with_dlq=with_dlq)
    emit(report, as_json, render.group_deleted)

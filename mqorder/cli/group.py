"""``mqorder group``: delete a retired consumer group (RocketMQ's deleteSubGroup)."""

from __future__ import annotations

import typer

from mqorder.admin import groups, render
from mqorder.admin.common import Admin
from mqorder.cli.common import JSON_OPT, emit

app = typer.Typer(no_args_is_help=True, help="Delete a retired consumer group with its offsets and state")


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

"""``mqorder offsets``: move a group's committed offsets (RocketMQ's resetOffsetByTime), fenced."""

from __future__ import annotations

import typer

from mqorder.admin import offsets, render
from mqorder.admin.common import Admin
from mqorder.cli.common import JSON_OPT, emit

app = typer.Typer(no_args_is_help=True, help="Move a group's committed offsets (fenced)")


@app.command("reset")
def offsets_reset(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Argument(..., help="topic"),
    to: str = typer.Option(..., "--to", help="earliest, latest, an offset, an ISO 8601 time or @<epoch ms>"),
    force: bool = typer.Option(False, "--force", help="reset even while consumers are live (their runs are fenced)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the new offsets, change nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """RocketMQ's resetOffsetByTime: move the group's offsets on a topic; running owners are fenced."""
    target = offsets.Target.parse(to)
    with Admin.open() as admin:
        report = offsets.reset(admin, group, topic, target, force=force, dry_run=dry_run)
    emit(report, as_json, render.reset)

"""``mqorder dlq``: a group's dead-letter queue (``%DLQ%<group>``): list, show, replay in order."""

from __future__ import annotations

import typer

from mqorder.admin import dlq, render
from mqorder.admin.common import Admin
from mqorder.cli.common import JSON_OPT, emit
from mqorder.model import MAX_OFFSET

app = typer.Typer(no_args_is_help=True, help="Inspect and replay a group's dead-letter queue (%DLQ%<group>)")


@app.command("list")
def dlq_list(
    group: str = typer.Argument(..., help="consumer group"),
    start: int = typer.Option(0, "--from", min=0, max=MAX_OFFSET, help="first DLQ offset to list"),
    limit: int = typer.Option(50, min=0, max=100_000, help="dead letters to list"),
    as_json: bool = JSON_OPT,
) -> None:
    """Dead letters of a group: origin queue and offset, msg id, keys, retries, reason."""
    with Admin.open() as admin:
        page = dlq.dlq_list(admin, group, start, limit)
    emit(page, as_json, render.dlq_page)


@app.command("show")
def dlq_show(
    group: str = typer.Argument(..., help="consumer group"),
    offset: int = typer.Option(..., "--offset", min=0, max=MAX_OFFSET, help="DLQ offset (see `mqorder dlq list`)"),
    as_json: bool = JSON_OPT,
) -> None:
    """One dead letter in full: origin, reason, properties and body."""
    with Admin.open() as admin:
        letter = dlq.dlq_show(admin, group, offset)
    emit(letter, as_json, render.dead_letter)


@app.command("replay")
def dlq_replay(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Option(None, "--topic", help="replay onto this topic instead of the original queues"),
    start: int = typer.Option(0, "--from", min=0, max=MAX_OFFSET, help="first DLQ offset to replay"),
    end: int = typer.Option(None, "--to", min=0, max=MAX_OFFSET, help="last DLQ offset to replay (default: the last one)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say where they would go, send nothing"),
    all_groups: bool = typer.Option(False, "--all-groups",
                                    help="replay even though other groups consume the topic (each gets a copy)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Put dead letters back on their original queues (or a topic), in order; a rerun adds nothing twice."""
    with Admin.open() as admin:
        report = dlq.replay(admin, group, topic=topic, start=start, end=end, dry_run=dry_run, all_groups=all_groups)
    emit(report, as_json, render.replayed)

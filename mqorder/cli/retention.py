"""``mqorder retention run``: one trim pass now, the pass workers run every MQORDER_RETENTION_INTERVAL_MS."""

from __future__ import annotations

import typer

from mqorder.admin import render
from mqorder.admin.common import Admin
from mqorder.cli.common import JSON_OPT, emit
from mqorder.retention.trimmer import RetentionTrimmer

app = typer.Typer(no_args_is_help=True, help="Trim topics to their retention now")


@app.command("run")
def retention_run(
    topic: list[str] = typer.Option(None, "--topic", help="only these topics (repeat); default every topic"),
    as_json: bool = JSON_OPT,
) -> None:
    """Run one trim pass now (workers run one every MQORDER_RETENTION_INTERVAL_MS on their own)."""
    with Admin.open() as admin:
        for t in topic or ():
            admin.route(t)  # an unknown topic is refused with how to create it
        report = RetentionTrimmer(admin.brokers, admin.settings).run(topic or None)
    emit(report, as_json, render.trimmed)

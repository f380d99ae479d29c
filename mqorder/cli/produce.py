"""``mqorder produce``: JSON lines from stdin or a file to a topic, keyed by a field, in order."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from mqorder.admin import render
from mqorder.admin.common import Admin
from mqorder.admin.produce import produce as run
from mqorder.cli.common import EXIT_BAD, JSON_OPT, emit, err_console
from mqorder.client.producer import Producer

app = typer.Typer()


@app.command()
def produce(
    topic: str = typer.Argument(..., help="topic"),
    key_field: str = typer.Option(..., "--key-field", help="JSON field holding the sharding key (a.b for nested)"),
    file: Path = typer.Option(None, "--file", exists=True, dir_okay=False, help="read this file instead of stdin"),
    chunk: int = typer.Option(1000, "--chunk", min=1, max=100_000, help="lines validated and sent together"),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="leave bad lines out instead of stopping at them"),
    dedup_field: str = typer.Option(None, "--dedup-field",
                                    help="JSON field holding each line's unique id: a resend stores a line once"),
    from_line: int = typer.Option(1, "--from-line", min=1, help="send from this line on (resume a stopped run)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Send JSON lines (stdin or --file) to a topic, keyed by a field, in order, with a progress bar."""
    with Admin.open() as admin, _Lines(file) as (lines, size):
        producer = Producer(settings=admin.settings, brokers=admin.brokers)
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[n]} lines")]
        # The bar goes to stderr: stdout carries the report (``--json`` must stay parseable).
        with Progress(*columns, console=err_console, transient=as_json) as bar:
            task = bar.add_task(f"produce {topic}", total=size, n=0)
            report = run(producer, topic, lines, key_field, chunk_size=chunk, skip_bad=skip_bad,
                         progress=lambda n, b: bar.update(task, completed=b, n=f"{n:,}"), dedup_field=dedup_field,
                         from_line=from_line)
    emit(report, as_json, render.produced)
    if not report.ok:
        raise typer.Exit(EXIT_BAD)


class _Lines:
    """Binary lines of ``path`` or stdin, and the total size when known (a file, or stdin
    redirected from one) for the progress bar."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.stream: IO[bytes] | None = None

    def __enter__(self) -> tuple[Iterator[bytes], int | None]:
        if self.path is not None:
            self.stream = self.path.open("rb")
            return iter(self.stream), self.path.stat().st_size
        stdin = sys.stdin.buffer
        try:
            st = os.fstat(stdin.fileno())
            size = st.st_size if stat.S_ISREG(st.st_mode) else None
        except (OSError, ValueError, AttributeError):
            size = None  # a pipe, or a stream without a file descriptor
        return iter(stdin), size

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            self.stream.close()

"""Getting started: ``mqorder config`` (the effective settings) and ``mqorder demo`` (order
lifecycles through real workers, checked for order)."""

from __future__ import annotations

import json

import typer

from mqorder.cli.common import EXIT_CHECK, EXIT_OK, console
from mqorder.settings import load_settings

app = typer.Typer()


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
    # Imported here, not at the top: the demo brings its own harness (mqorder.testing: an embedded
    # redis-server, worker and beat launchers), which no other command needs loaded.
    from mqorder.demo import run_demo

    res = run_demo(orders, queues, workers, concurrency, timeout, console=console, keep=keep)
    raise typer.Exit(EXIT_OK if res.ok else EXIT_CHECK)


@app.command()
def config() -> None:
    """Print the effective settings (passwords redacted); fails with a clear message if invalid."""
    console.print_json(json.dumps(load_settings().describe()))

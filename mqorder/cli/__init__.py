"""The ``mqorder`` command line (typer + rich): the admin commands, the Spark pipeline, the demo.

One module per command group, as celery's ``celery/bin``: ``topic``, ``group``, ``dlq``, ``offsets``,
``message``, ``retention``, ``pipeline``; the top-level commands live in ``health`` (status,
consumers, txn, doctor), ``produce`` and ``demo`` (demo, config); ``exporter`` comes from
``mqorder.metrics.exporter``. Each command opens the cluster (``mqorder.admin.common.Admin``),
calls one function of ``mqorder.admin`` and prints its result through ``common.emit``: a table,
or with ``--json`` JSON on stdout.

Global options, before the command: ``--redis-url`` (else ``MQORDER_REDIS_URL``, as rq's
``--url``; a ``redis+sentinel://`` URL too, ``mqorder.store.urls``, or a Redis Cluster's
``redis+cluster://``, ``mqorder.store.cluster_urls``) and ``--version``.

Errors go to stderr, one line, with these exit codes (``docs/ADMIN.md``; ``common.EXIT_*``):

* 0: done;
* 1: a check failed: ``status --check`` found a stuck queue, ``doctor`` a problem, ``pipeline
  audit`` a violation or a gap; or a safety check refused a change (``topic delete`` of a
  subscribed topic, ``group delete`` or ``offsets reset`` under live consumers) without ``--force``: nothing was changed;
* 2: bad input (an unknown topic or group, a bad argument or line) or an unreachable Redis.
"""

from __future__ import annotations

import importlib.metadata
import os

import typer

from mqorder.cli import demo, dlq, group, health, message, offsets, pipeline, produce, retention, topic
from mqorder.cli.common import EXIT_BAD, EXIT_CHECK, EXIT_OK, HandledGroup
from mqorder.metrics.exporter import exporter
from mqorder.settings import get_settings
from mqorder.store.brokers import check_redis_url

__all__ = ["EXIT_BAD", "EXIT_CHECK", "EXIT_OK", "app", "main"]

#: The variable ``--redis-url`` reads when not given, and sets for the command when given.
REDIS_URL_ENV = "MQORDER_REDIS_URL"

EPILOG = (
    f"Exit codes: {EXIT_OK} done; {EXIT_CHECK} a check failed (status --check found a stuck queue, doctor a "
    "problem, pipeline audit a violation or a gap) or a safety check refused a change without --force "
    f"(nothing was changed); {EXIT_BAD} bad input (an unknown topic or group, a bad argument) or an "
    "unreachable Redis. Errors go to stderr."
)

app = typer.Typer(cls=HandledGroup, add_completion=False, no_args_is_help=True, epilog=EPILOG,
                  help="RocketMQ-style orderly consumption on Celery + Redis")
app.add_typer(demo.app)
app.add_typer(topic.app, name="topic")
app.add_typer(group.app, name="group")
app.add_typer(health.app)
app.add_typer(dlq.app, name="dlq")
app.add_typer(offsets.app, name="offsets")
app.add_typer(message.app, name="message")
app.add_typer(produce.app)
app.add_typer(retention.app, name="retention")
app.add_typer(pipeline.app, name="pipeline")
app.command("exporter")(exporter)


def _print_version(value: bool) -> None:
    if not value:
        return
    try:
        version = importlib.metadata.version("mqorder")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed: pip install -e .)"
    typer.echo(f"mqorder {version}")
    raise typer.Exit(EXIT_OK)


@app.callback()
def root(
    ctx: typer.Context,
    redis_url: str = typer.Option(
        None, "--redis-url", envvar=REDIS_URL_ENV, show_envvar=True,
        help="the Redis that stores the messages (redis://host:port/db, rediss://, unix://, under "
             "Sentinel redis+sentinel://\\[:password@]host:port,host:port/<master-name>\\[/<db>], or a Redis Cluster "
             "redis+cluster://\\[\\[user]:password@]host:port,host:port/); given here, it replaces MQORDER_REDIS_URL for "
             "this command",
    ),
    version: bool = typer.Option(False, "--version", is_eager=True, expose_value=False, callback=_print_version,
                                 help="print mqorder's version and exit"),
) -> None:
    """RocketMQ-style orderly consumption on Celery + Redis."""
    _use_redis_url(ctx, redis_url)


def _use_redis_url(ctx: typer.Context, url: str | None) -> None:
    """Make ``url`` the settings' ``redis_url`` for this command, then put the old one back.

    Through the environment rather than a settings argument: every command reads the process-wide
    settings (``get_settings``), and so do the processes some of them start (the demo's workers,
    Spark's executors), which inherit the environment and nothing else. Restored when the command
    ends, so an in-process caller (typer's CliRunner) keeps its own environment.
    """
    previous = os.environ.get(REDIS_URL_ENV)
    if url is None or url == previous:
        return
    check_redis_url(url, "--redis-url")
    os.environ[REDIS_URL_ENV] = url
    get_settings.cache_clear()

    def restore() -> None:
        if previous is None:
            os.environ.pop(REDIS_URL_ENV, None)
        else:
            os.environ[REDIS_URL_ENV] = previous
        get_settings.cache_clear()

    ctx.call_on_close(restore)


def main() -> None:
    """The ``mqorder`` console script (``[project.scripts]``)."""
    app(prog_name="mqorder")

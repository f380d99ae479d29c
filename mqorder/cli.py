"""The ``mqorder`` command line (typer + rich): the demo, settings, and the admin commands.

A thin entry point: each command opens the cluster (``mqorder.admin.common.Admin``), calls one
function of ``mqorder.admin`` and prints its result, as a table or, with ``--json``, as JSON on
stdout. Errors go to stderr with these exit codes (``docs/ADMIN.md``):

* 0: done;
* 1: a check failed: ``status --check`` found a stuck queue, or a safety check refused a change
  (``topic delete`` of a subscribed topic, ``offsets reset`` under live consumers) without
  ``--force``; nothing was changed;
* 2: bad input (an unknown topic or group, a bad argument or line) or an unreachable Redis.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn, ParamSpec, TypeVar

import redis
import typer
from rich.console import Console

from mqorder.errors import MQOrderError
from mqorder.metrics.exporter import exporter
from mqorder.pipeline_cli import app as pipeline_app

EXIT_OK, EXIT_CHECK, EXIT_BAD = 0, 1, 2

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RocketMQ-style orderly consumption on Celery + Redis")
topic_app = typer.Typer(no_args_is_help=True, help="Create, list, describe, delete topics and set their permission and retention")
dlq_app = typer.Typer(no_args_is_help=True, help="Inspect and replay a group's dead-letter queue (%DLQ%<group>)")
offsets_app = typer.Typer(no_args_is_help=True, help="Move a group's committed offsets (fenced)")
message_app = typer.Typer(no_args_is_help=True, help="Look messages up by queue and offset, or by msg id")
retention_app = typer.Typer(no_args_is_help=True, help="Trim topics to their retention now")
app.add_typer(topic_app, name="topic")
app.add_typer(retention_app, name="retention")
app.add_typer(dlq_app, name="dlq")
app.add_typer(offsets_app, name="offsets")
app.add_typer(message_app, name="message")
app.add_typer(pipeline_app, name="pipeline")
console = Console()
err_console = Console(stderr=True)
#: Width of tables written to a pipe or a file (no terminal to fit): wide enough not to wrap rows.
PIPE_WIDTH = 200

JSON_OPT = typer.Option(False, "--json", help="machine-readable output (JSON on stdout)")
P = ParamSpec("P")
R = TypeVar("R")


def _fail(exc: Exception | str, code: int = EXIT_BAD) -> NoReturn:
    err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn mqorder's errors and an unreachable Redis into a message on stderr and an exit code."""
    from mqorder.admin.common import RefusedError

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RefusedError as exc:
            _fail(exc, EXIT_CHECK)
        except MQOrderError as exc:
            _fail(exc)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            _fail(f"Redis did not answer ({type(exc).__name__}: {exc}); is redis-server running, and does "
                  "MQORDER_REDIS_URL (or MQORDER_BROKERS) point at it?")
        except redis.ResponseError as exc:
            _fail(f"Redis refused the command: {exc}")

    return wrapper


def _admin() -> Any:
    from mqorder.admin.common import Admin

    return Admin.open()


def _out() -> Console:
    """A console on the current stdout: the terminal's width, or ``COLUMNS`` / ``PIPE_WIDTH`` when
    piped (``| grep`` should see one line per queue, not rows wrapped at 80 columns)."""
    if sys.stdout.isatty():
        return Console(soft_wrap=True)
    return Console(file=sys.stdout, width=int(os.environ.get("COLUMNS") or PIPE_WIDTH), soft_wrap=True)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# -- demo and settings ---------------------------------------------------------------------------


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
    raise typer.Exit(EXIT_OK if res.ok else EXIT_CHECK)


@app.command()
def config() -> None:
    """Print the effective settings (passwords redacted); fails with a clear message if invalid."""
    from mqorder.settings import load_settings

    try:
        console.print_json(json.dumps(load_settings().describe()))
    except MQOrderError as exc:
        _fail(exc)


# -- topics ----------------------------------------------------------------------------------------


@topic_app.command("create")
@handled
def topic_create(
    name: str = typer.Argument(..., help="topic name"),
    queues: int = typer.Option(8, help="queues per broker (cannot change later: keys would move)"),
    broker: list[str] = typer.Option(None, help="broker names (default: the default broker); repeat for several"),
    perm: str = typer.Option("rw", help="rw, r (consumed, sends refused) or w (filled, not consumed yet)"),
    retention_policy: str = typer.Option(None, help="time (trim what is older, consumed or not) or consumed "
                                         "(only what every group consumed); default MQORDER_RETENTION_POLICY"),
    retention_ms: int = typer.Option(None, help="how long messages are kept (ms); default MQORDER_RETENTION_MS (72 h)"),
    retention_min_ms: int = typer.Option(None, help="consumed policy: consumed messages kept this long for replay (ms)"),
    retention_max_messages: int = typer.Option(None, help="most messages kept per queue (0: no cap)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Create a topic (idempotent for the same layout); running workers pick it up at once."""
    from mqorder.admin import render, topics
    from mqorder.retention.policy import TopicRetention

    retention = TopicRetention.of(policy=retention_policy, retention_ms=retention_ms,
                                  retention_min_ms=retention_min_ms, retention_max_messages=retention_max_messages)
    with _admin() as admin:
        info = topics.create(admin, name, queues, broker or None, perm, retention)
    if as_json:
        _print_json(info.to_json())
    else:
        render.topic(_out(), info)


@topic_app.command("list")
@handled
def topic_list(as_json: bool = JSON_OPT) -> None:
    """Every topic with its queue count, brokers, messages, size and subscribed groups."""
    from mqorder.admin import render, topics

    with _admin() as admin:
        infos = topics.list_topics(admin)
    if as_json:
        _print_json([i.to_json() for i in infos])
    else:
        render.topic_list(_out(), infos)


@topic_app.command("describe")
@handled
def topic_describe(name: str = typer.Argument(..., help="topic name"), as_json: bool = JSON_OPT) -> None:
    """Each queue of a topic: broker, min and max offset, messages and memory."""
    from mqorder.admin import render, topics

    with _admin() as admin:
        info = topics.describe(admin, name)
    if as_json:
        _print_json(info.to_json())
    else:
        render.topic(_out(), info)


@topic_app.command("perm")
@handled
def topic_perm(
    name: str = typer.Argument(..., help="topic name"),
    perm: str = typer.Argument(..., help="rw, r (consumed, sends refused) or w (filled, not consumed)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Change a topic's permission (RocketMQ's updateTopicPerm); workers rebalance at once."""
    from mqorder.admin import render, topics

    with _admin() as admin:
        info = topics.update_perm(admin, name, perm)
    if as_json:
        _print_json(info.to_json())
    else:
        render.topic(_out(), info)


@topic_app.command("retention")
@handled
def topic_retention(
    name: str = typer.Argument(..., help="topic name"),
    policy: str = typer.Option(None, "--policy", help="time or consumed"),
    retention_ms: int = typer.Option(None, "--ms", help="how long messages are kept (ms)"),
    retention_min_ms: int = typer.Option(None, "--min-ms", help="consumed policy: kept this long for replay (ms)"),
    max_messages: int = typer.Option(None, "--max-messages", help="most messages kept per queue (0: no cap)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Show a topic's retention, or change it (values not given stay); the next trim pass applies it."""
    from mqorder.admin import render, topics
    from mqorder.retention.policy import TopicRetention

    change = TopicRetention.of(policy=policy, retention_ms=retention_ms, retention_min_ms=retention_min_ms,
                               retention_max_messages=max_messages)
    with _admin() as admin:
        info = topics.update_retention(admin, name, change) if change.to_fields() else topics.describe(admin, name)
    if as_json:
        _print_json(info.to_json())
    else:
        render.topic(_out(), info)


@topic_app.command("delete")
@handled
def topic_delete(
    name: str = typer.Argument(..., help="topic name"),
    force: bool = typer.Option(False, "--force", help="delete even while groups subscribe (they lose their offsets)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be removed, remove nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """Delete a topic with its messages and every group's offsets on it (refused while subscribed)."""
    from mqorder.admin import render, topics

    with _admin() as admin:
        report = topics.delete(admin, name, force=force, dry_run=dry_run)
    if as_json:
        _print_json(report.to_json())
    else:
        render.topic_deleted(_out(), report)


# -- status and consumers --------------------------------------------------------------------------


@app.command()
@handled
def status(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Argument(None, help="only this topic (default: every topic of the group)"),
    stuck_after: float = typer.Option(
        60.0, "--stuck-after", min=0.0, help="seconds a backlog may wait without progress before it counts as stuck"
    ),
    check: bool = typer.Option(False, "--check", help="exit 1 if any queue is stuck (cron, health checks)"),
    as_json: bool = JSON_OPT,
) -> None:
    """Per queue: offsets, lag, owner, lease, epoch, ConsumeRequest, head retries, last commit; stuck queues."""
    from mqorder.admin import render
    from mqorder.admin.status import group_status

    with _admin() as admin:
        st = group_status(admin, group, topic, stuck_after)
    if as_json:
        _print_json(st.to_json())
    else:
        render.status(_out(), st)
    if check and st.stuck:
        raise typer.Exit(EXIT_CHECK)


@app.command()
@handled
def consumers(group: str = typer.Argument(..., help="consumer group"), as_json: bool = JSON_OPT) -> None:
    """Clients of a group: heartbeat age, pool, assigned queues, locks held."""
    from mqorder.admin import render
    from mqorder.admin.consumers import group_consumers

    with _admin() as admin:
        gc = group_consumers(admin, group)
    if as_json:
        _print_json(gc.to_json())
    else:
        render.consumers(_out(), gc)


# -- transactions --------------------------------------------------------------------------------


@app.command()
@handled
def txn(
    topic: str = typer.Argument(..., help="topic"),
    last: int = typer.Option(20, min=0, help="recent ends to show per queue"),
    as_json: bool = JSON_OPT,
) -> None:
    """Transactions of a topic still half-way (age, check-backs), and how recent ones ended and why."""
    from mqorder.admin import transactions

    with _admin() as admin:
        report = transactions.txn_report(admin, topic, last)
    if as_json:
        _print_json(report.to_json())
    else:
        transactions.render(_out(), report)


# -- dlq -------------------------------------------------------------------------------------------


@dlq_app.command("list")
@handled
def dlq_list(
    group: str = typer.Argument(..., help="consumer group"),
    start: int = typer.Option(0, "--from", min=0, help="first DLQ offset to list"),
    limit: int = typer.Option(50, min=0, help="dead letters to list"),
    as_json: bool = JSON_OPT,
) -> None:
    """Dead letters of a group: origin queue and offset, msg id, keys, retries, reason."""
    from mqorder.admin import dlq, render

    with _admin() as admin:
        page = dlq.dlq_list(admin, group, start, limit)
    if as_json:
        _print_json(page.to_json())
    else:
        render.dlq_page(_out(), page)


@dlq_app.command("show")
@handled
def dlq_show(
    group: str = typer.Argument(..., help="consumer group"),
    offset: int = typer.Option(..., "--offset", min=0, help="DLQ offset (see `mqorder dlq list`)"),
    as_json: bool = JSON_OPT,
) -> None:
    """One dead letter in full: origin, reason, properties and body."""
    from mqorder.admin import dlq, render

    with _admin() as admin:
        d = dlq.dlq_show(admin, group, offset)
    if as_json:
        _print_json(d.to_json())
    else:
        render.dead_letter(_out(), d)


@dlq_app.command("replay")
@handled
def dlq_replay(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Option(None, "--topic", help="replay onto this topic instead of the original queues"),
    start: int = typer.Option(0, "--from", min=0, help="first DLQ offset to replay"),
    end: int = typer.Option(None, "--to", min=0, help="last DLQ offset to replay (default: the last one)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say where they would go, send nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """Put dead letters back on their original queues (or a topic), in order; a rerun adds nothing twice."""
    from mqorder.admin import dlq, render

    with _admin() as admin:
        report = dlq.replay(admin, group, topic=topic, start=start, end=end, dry_run=dry_run)
    if as_json:
        _print_json(report.to_json())
    else:
        render.replayed(_out(), report)


# -- offsets ---------------------------------------------------------------------------------------


@offsets_app.command("reset")
@handled
def offsets_reset(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Argument(..., help="topic"),
    to: str = typer.Option(..., "--to", help="earliest, latest, an offset, an ISO 8601 time or @<epoch ms>"),
    force: bool = typer.Option(False, "--force", help="reset even while consumers are live (their runs are fenced)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the new offsets, change nothing"),
    as_json: bool = JSON_OPT,
) -> None:
    """RocketMQ's resetOffsetByTime: move the group's offsets on a topic; running owners are fenced."""
    from mqorder.admin import offsets, render

    target = offsets.Target.parse(to)
    with _admin() as admin:
        report = offsets.reset(admin, group, topic, target, force=force, dry_run=dry_run)
    if as_json:
        _print_json(report.to_json())
    else:
        render.reset(_out(), report)


# -- messages --------------------------------------------------------------------------------------


@message_app.command("show")
@handled
def message_show(
    topic: str = typer.Argument(..., help="topic"),
    queue: int = typer.Option(None, "--queue", min=0, help="queue id (with --offset)"),
    offset: int = typer.Option(None, "--offset", min=0, help="queue offset (with --queue)"),
    broker: str = typer.Option(None, "--broker", help="broker of the queue, if the topic spans several"),
    msg_id: str = typer.Option(None, "--msg-id", help="find by msg id instead (scans the whole topic)"),
    as_json: bool = JSON_OPT,
) -> None:
    """A message by queue and offset, or by msg id (queryMsgById), with each group's progress on it."""
    from mqorder.admin import messages, render
    from mqorder.admin.common import BadArgumentError

    by_offset = queue is not None or offset is not None
    if by_offset == (msg_id is not None) or (by_offset and (queue is None or offset is None)):
        raise BadArgumentError("give either --queue Q --offset O, or --msg-id ID")
    with _admin() as admin:
        if msg_id is None:
            found = [messages.show(admin, topic, queue, offset, broker)]
        else:
            total = sum(q.messages for q in _topic_queues(admin, topic))
            err_console.print(f"scanning {total:,} messages of {topic} for msg id {msg_id}; "
                              "this may take a while on big topics", soft_wrap=True, highlight=False)
            found = messages.find_by_id(admin, topic, msg_id)
            if not found:
                raise BadArgumentError(f"no message with id {msg_id!r} in topic {topic!r}")
    if as_json:
        _print_json(found[0].to_json() if msg_id is None else [f.to_json() for f in found])
        return
    out = _out()
    for i, f in enumerate(found):
        if i:
            out.print()
        render.message(out, f)


def _topic_queues(admin: Any, topic: str) -> list[Any]:
    from mqorder.admin import topics

    return topics.describe(admin, topic).queues


# -- produce ---------------------------------------------------------------------------------------


@app.command()
@handled
def produce(
    topic: str = typer.Argument(..., help="topic"),
    key_field: str = typer.Option(..., "--key-field", help="JSON field holding the sharding key (a.b for nested)"),
    file: Path = typer.Option(None, "--file", exists=True, dir_okay=False, help="read this file instead of stdin"),
    chunk: int = typer.Option(1000, "--chunk", min=1, max=100_000, help="lines validated and sent together"),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="leave bad lines out instead of stopping at them"),
    as_json: bool = JSON_OPT,
) -> None:
    """Send JSON lines (stdin or --file) to a topic, keyed by a field, in order, with a progress bar."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from mqorder.admin import render
    from mqorder.admin.produce import produce as run
    from mqorder.client.producer import Producer

    with _admin() as admin, _lines(file) as (lines, size):
        producer = Producer(settings=admin.settings, brokers=admin.brokers)
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[n]} lines")]
        with Progress(*columns, console=err_console, transient=as_json) as bar:
            task = bar.add_task(f"produce {topic}", total=size, n=0)
            report = run(producer, topic, lines, key_field, chunk_size=chunk, skip_bad=skip_bad,
                         progress=lambda n, b: bar.update(task, completed=b, n=f"{n:,}"))
    if as_json:
        _print_json(report.to_json())
    else:
        render.produced(_out(), report)
    if not report.ok:
        raise typer.Exit(EXIT_BAD)


class _lines:
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


# -- retention and health ----------------------------------------------------------------------------


@retention_app.command("run")
@handled
def retention_run(
    topic: list[str] = typer.Option(None, "--topic", help="only these topics (repeat); default every topic"),
    as_json: bool = JSON_OPT,
) -> None:
    """Run one trim pass now (workers run one every MQORDER_RETENTION_INTERVAL on their own)."""
    from mqorder.retention.trimmer import RetentionTrimmer

    with _admin() as admin:
        if topic:
            for t in topic:
                admin.route(t)  # an unknown topic is refused with how to create it
        report = RetentionTrimmer(admin.brokers, admin.settings).run(topic or None)
    if as_json:
        _print_json(report.to_json())
        return
    out = _out()
    for t, n in sorted(report.by_topic().items()):
        rule = report.rules[t]
        held = f"; held back by {', '.join(report.holders[t])}" if report.holders.get(t) else ""
        out.print(f"{t}: trimmed {n:,} ({rule.policy.value}, retention {rule.retention_ms:,} ms{held})")
    out.print(f"trimmed {report.trimmed:,} messages and {report.ledger_trimmed:,} ledger records in "
              f"{report.calls} script calls, {report.took_ms:.1f} ms")


@app.command()
@handled
def doctor(
    celery_app: str = typer.Option("workers.app:app", "--app", help="Celery app to check (module:attribute); '' to skip"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings too"),
    as_json: bool = JSON_OPT,
) -> None:
    """Check Redis (version, persistence, eviction, memory, clocks) and Celery settings; exit 1 on a problem."""
    from mqorder.admin.doctor import diagnose
    from mqorder.settings import get_settings
    from mqorder.store.brokers import BrokerRegistry

    conf, conf_error = _celery_conf(celery_app)
    settings = get_settings()
    brokers = BrokerRegistry(settings.redis_url, settings.brokers, socket_timeout=2.0)
    try:
        report = diagnose(settings, brokers, conf, conf_error)
    finally:
        brokers.close()
    if as_json:
        _print_json(report.to_json())
    else:
        out = _out()
        from rich.markup import escape

        colour = {"OK": "green", "WARN": "yellow", "FAIL": "bold red"}
        for f in report.findings:
            where = f" ({f.broker})" if f.broker else ""
            out.print(f"[{colour[f.verdict.value]}]{f.verdict.value:4}[/] {escape(f.check + where)}: {escape(f.detail)}",
                      highlight=False)
            if f.fix:
                out.print(f"      fix: {escape(f.fix)}", highlight=False)
    if report.failed(strict):
        raise typer.Exit(EXIT_CHECK)


def _celery_conf(spec: str) -> tuple[dict[str, Any] | None, str]:
    """The configuration of Celery app ``module:attribute``, or why it could not be loaded."""
    if not spec:
        return None, ""
    module, _, attr = spec.partition(":")
    try:
        import importlib

        app_obj = getattr(importlib.import_module(module), attr or "app")
        conf = app_obj.conf
        return {k: conf.get(k) for k in ("broker_url", "task_serializer", "result_serializer", "event_serializer",
                                         "accept_content", "broker_transport_options")}, ""
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return None, f"{spec} could not be loaded ({type(exc).__name__}: {exc})"


app.command("exporter")(exporter)


def main() -> None:
    try:
        app()
    except MQOrderError as exc:  # pragma: no cover
        err_console.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT_BAD)


if __name__ == "__main__":  # pragma: no cover
    main()

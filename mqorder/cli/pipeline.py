"""``mqorder pipeline``: publish a file to a topic, export a topic or a ledger, audit a group, on Spark.

Every command checks what it can *before* starting Spark (a session costs ~10 s): the input file
and its extension, that Redis answers, that the topic exists, that the group has a ledger. Each
failure says what to do, on stderr; errors exit with 2, an audit that finds a violation or a gap
with 1 (``mqorder.cli.common``).

The Spark master is ``--master``, else ``MQORDER_SPARK_MASTER``, else ``local[*]``. While a job
runs, a progress bar follows its tasks through Spark's status tracker.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from mqorder.cli.common import EXIT_CHECK, EXIT_OK, console, enum_parser, exit_code_for
from mqorder.errors import MQOrderError
from mqorder.settings import get_settings
from mqorder.store.brokers import BrokerRegistry
from mqorder.store.topics import TopicManager

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from mqorder.spark.audit_model import AuditReport

app = typer.Typer(no_args_is_help=True, help="Data pipeline on Spark: publish files, export topics and ledgers, "
                                             "audit ordering")

INPUT_FORMATS = (".csv", ".json", ".parquet")
DEFAULT_MASTER = "local[*]"
MASTER = typer.Option(DEFAULT_MASTER, "--master", envvar="MQORDER_SPARK_MASTER",
                      help="Spark master (local[*], local[4], spark://host:7077...)")


class OnNull(StrEnum):
    """What ``publish`` does with a row whose key or order column is null."""

    FAIL = "fail"
    SKIP = "skip"


class Ordering(StrEnum):
    """What order ``audit`` checks: per sharding key, or per whole queue."""

    KEY = "key"
    QUEUE = "queue"


class AuditStart(StrEnum):
    """Where ``audit`` starts each queue: its first stored message, or the first offset its ledger records."""

    STORED = "stored"
    LEDGER = "ledger"


class PipelineError(MQOrderError):
    """A pipeline command cannot start: bad input, missing prerequisite (the message says which)."""


@contextmanager
def _reported() -> Iterator[None]:
    """Spark's own errors (bad column, unreadable file) as a ``PipelineError`` of their first line,
    without the JVM stack trace; ours go on as they are, to the root group (stderr, exit code)."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        if exit_code_for(exc) is not None:
            raise
        raise _spark_error(exc) from None


# -- checks before Spark --------------------------------------------------------------------------


def _input_file(path: Path) -> str:
    """The input's format from its extension; a missing file or another extension is refused."""
    if not path.exists():
        raise PipelineError(f"input {str(path)!r} does not exist")
    fmt = path.suffix.lower()
    if fmt not in INPUT_FORMATS:
        raise PipelineError(f"input {str(path)!r}: unsupported extension {path.suffix or '(none)'!r}; "
                            f"use one of {', '.join(INPUT_FORMATS)} (a .parquet may be a directory)")
    if path.is_dir() and fmt != ".parquet":
        raise PipelineError(f"input {str(path)!r} is a directory: only a .parquet input may be one")
    return fmt[1:]


def _out_file(path: Path, overwrite: bool) -> None:
    if path.suffix.lower() != ".parquet":
        raise PipelineError(f"--out {str(path)!r} must end with .parquet (export writes Parquet)")
    if path.exists() and not overwrite:
        raise PipelineError(f"--out {str(path)!r} exists; pass --overwrite to replace it")


@contextmanager
def _brokers() -> Iterator[BrokerRegistry]:
    """The configured brokers, the default one checked to answer (its error says how to fix it)."""
    s = get_settings()
    brokers = BrokerRegistry(s.redis_url, s.brokers)
    try:
        brokers.default.ping()
        yield brokers
    finally:
        brokers.close()


def _check_topic(brokers: BrokerRegistry, topic: str) -> int:
    """The topic's queue count; ``TopicNotFoundError`` (saying how to create it) if it has none."""
    return TopicManager(brokers).describe_topic(topic).queue_count


def _check_ledger(brokers: BrokerRegistry, group: str) -> int:
    _spark_ready()
    # Imported here: mqorder.spark needs pyspark, an optional extra; every other command works without it.
    from mqorder.spark.ledger import LedgerNotFoundError, ledger_streams, no_ledger_hint

    streams = ledger_streams(brokers, group)
    if not streams:
        raise LedgerNotFoundError(no_ledger_hint(group))
    return sum(s.length for s in streams)


def _spark_ready() -> None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise PipelineError("pyspark is not installed: pip install 'mqorder[spark]' (or `make test`)") from None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise PipelineError("Spark needs Java 17+ and none was found: apt-get install -y openjdk-17-jre-headless "
                            "(or set JAVA_HOME)")


# -- Spark with a progress display ----------------------------------------------------------------


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def _session(progress: Progress, master: str) -> SparkSession:
    _spark_ready()
    step = progress.add_task(f"starting Spark on {master}", total=None)
    from mqorder.spark import session  # pyspark is optional: imported once _spark_ready() said it is there

    spark = session("mqorder-pipeline", master, **{"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    progress.update(step, total=1, completed=1)
    return spark


@contextmanager
def _tracked(progress: Progress, spark: SparkSession, description: str) -> Iterator[None]:
    """A bar over the tasks of every stage Spark runs while the block runs (status tracker, polled)."""
    step = progress.add_task(description, total=None)
    tracker = spark.sparkContext.statusTracker()
    seen: dict[int, tuple[int, int]] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.25):
            for sid in tracker.getActiveStageIds():
                info = tracker.getStageInfo(sid)
                if info is not None:
                    seen[sid] = (info.numCompletedTasks, info.numTasks)
            if seen:
                progress.update(step, completed=sum(c for c, _ in seen.values()),
                                total=sum(t for _, t in seen.values()))

    watcher = threading.Thread(target=poll, name="spark-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        total = sum(t for _, t in seen.values()) or 1
        progress.update(step, completed=total, total=total)


def _read_input(spark: SparkSession, path: Path, fmt: str) -> DataFrame:
    if fmt == "csv":
        return spark.read.option("header", True).option("inferSchema", True).csv(str(path))
    if fmt == "json":
        head = path.read_text(errors="replace")[:4096].lstrip() if path.is_file() else ""
        return spark.read.option("multiLine", head.startswith("[")).json(str(path))  # array or JSON lines
    return spark.read.parquet(str(path))


# -- commands -------------------------------------------------------------------------------------


@app.command()
def publish(
    input_path: Path = typer.Argument(..., metavar="INPUT", help="a .csv (with a header), .json (lines or one array) or .parquet file"),
    topic: str = typer.Option(..., "--topic", help="the topic to publish to (it must exist)"),
    key: str = typer.Option(..., "--key", help="the sharding-key column"),
    order_by: str = typer.Option(..., "--order-by", help="the column that orders the rows of one key"),
    body: str = typer.Option("json", "--body", help="a string/binary column, or json: the whole row as JSON"),
    id_column: str = typer.Option(None, "--id-column", help="a column of message ids (default: a hash of the row)"),
    on_null: OnNull = typer.Option(OnNull.FAIL, "--on-null", parser=enum_parser(OnNull, "--on-null"),
                                   help="fail (refuse the job) or skip rows with a null key/order"),
    master: str = MASTER,
) -> None:
    """Publish INPUT to TOPIC, each key's rows in --order-by order, exactly once."""
    with _reported():
        fmt = _input_file(input_path)
        with _brokers() as brokers:
            queues = _check_topic(brokers, topic)
        _spark_ready()
        from mqorder.spark import publish as spark_publish  # pyspark is optional (see _check_ledger)

        with _progress() as progress:
            spark = _session(progress, master)
            df = _read_input(spark, input_path, fmt)
            with _tracked(progress, spark, f"publishing {input_path.name} to {topic} ({queues} queues)"):
                rep = spark_publish(df, topic, key=key, order_by=order_by, body=body, id_column=id_column,
                                    on_null=on_null.value)
    console.print(f"published {rep.stored:,} of {rep.rows:,} rows to {topic} "
                  f"({rep.duplicates:,} already stored, {rep.skipped_nulls:,} skipped for nulls); job {rep.job_id}")


@app.command()
def export(
    topic: str = typer.Option(..., "--topic", help="the topic to export (with --ledger: whose records to keep)"),
    out: Path = typer.Option(..., "--out", help="the Parquet output, PATH.parquet"),
    ledger: str = typer.Option(None, "--ledger", help="export this group's consumption ledger instead of messages"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace --out if it exists"),
    master: str = MASTER,
) -> None:
    """Export TOPIC's stored messages (or, with --ledger G, G's ledger records of TOPIC) to Parquet."""
    with _reported():
        _out_file(out, overwrite)
        with _brokers() as brokers:
            _check_topic(brokers, topic)
            if ledger:
                _check_ledger(brokers, ledger)
        s = get_settings()
        options = {"redisUrl": s.redis_url, "topic": topic}
        if s.brokers:
            options["brokers"] = json.dumps(s.brokers)
        if ledger:
            options["ledger"] = ledger
        with _progress() as progress:
            spark = _session(progress, master)
            what = f"ledger of {ledger} on {topic}" if ledger else f"messages of {topic}"
            with _tracked(progress, spark, f"exporting the {what}"):
                spark.read.format("mqorder").options(**options).load().write.mode(
                    "overwrite" if overwrite else "errorifexists").parquet(str(out))
            rows = spark.read.parquet(str(out)).count()  # from the Parquet footers
    console.print(f"exported {rows:,} rows to {out}")


@app.command()
def audit(
    topic: str = typer.Option(..., "--topic", help="the topic that was consumed"),
    group: str = typer.Option(..., "--group", help="the consumer group whose ledger is audited"),
    report: Path = typer.Option(..., "--report", help="directory for report.json, report.md and the plots"),
    order_field: str = typer.Option(None, "--order-field", help="also check this JSON body field never goes down"),
    ordering: Ordering = typer.Option(Ordering.KEY, "--ordering", parser=enum_parser(Ordering, "--ordering"),
                                      help="key: order per sharding key; queue: per whole queue"),
    start: AuditStart = typer.Option(AuditStart.STORED, "--start", parser=enum_parser(AuditStart, "--start"),
                                     help="stored: check from each queue's first stored message; "
                                          "ledger: from the first offset its ledger records"),
    master: str = MASTER,
) -> None:
    """Audit how GROUP consumed TOPIC from its ledger; exit 1 on any order violation or gap."""
    with _reported():
        with _brokers() as brokers:
            _check_topic(brokers, topic)
            records = _check_ledger(brokers, group)
        from mqorder.spark import audit as spark_audit  # pyspark is optional (see _check_ledger)

        with _progress() as progress:
            spark = _session(progress, master)
            with _tracked(progress, spark, f"auditing {records:,} ledger records of {group} on {topic}"):
                rep = spark_audit(spark, topic, group, order_field=order_field, ordering=ordering.value,
                                  report_dir=report, start=start.value)
    _print_audit(rep, report)
    raise typer.Exit(EXIT_OK if rep.ok else EXIT_CHECK)


def _print_audit(rep: AuditReport, report: Path) -> None:
    t = Table(title=f"audit of {rep.group} on {rep.topic}")
    for c in ("stored", "succeeded", "DLQ", "pending", "violations", "gaps", "dup (epoch/other)", "p50 ms", "p99 ms"):
        t.add_column(c, justify="right")
    lat = rep.latency
    t.add_row(f"{rep.messages_stored:,}", f"{rep.messages_succeeded:,}", f"{rep.messages_dead_lettered:,}",
              f"{rep.pending:,}", f"{rep.violation_count:,}", f"{rep.gap_count:,}",
              f"{rep.duplicates_epoch_change:,}/{rep.duplicates_other:,}",
              "-" if lat.p50_ms is None else f"{lat.p50_ms:,.1f}", "-" if lat.p99_ms is None else f"{lat.p99_ms:,.1f}")
    console.print(t)
    if rep.ok:
        console.print(f"[green]PASS[/green]: no order violation, no gap. Report in {report}/report.md")
        return
    for line in rep.failures():
        console.print(f"[red]FAIL[/red]: {line}")
    console.print(f"Details in {report}/report.md and {report}/report.json")


def _spark_error(exc: Exception) -> Exception:
    """Spark's errors carry a JVM stack trace. One of our checks that failed in Spark's Python
    workers (on a cluster's executors too) is raised again as itself (``mqorder.spark.errors``);
    else keep the first line, which names the problem."""
    try:
        from mqorder.spark.errors import mqorder_error  # pyspark is there: Spark raised this
    except ImportError:
        ours = None
    else:
        ours = mqorder_error(exc)
    if ours is not None:
        return ours
    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), type(exc).__name__)
    return PipelineError(f"{type(exc).__name__}: {first}")

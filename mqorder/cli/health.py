"""The questions an operator asks first: ``status`` (which queue is stuck, who owns it, how far
behind), ``consumers`` (who is alive and holds what), ``txn`` (half-way transactions) and
``doctor`` (is Redis, and Celery's configuration, fit to run mqorder). ``status --check`` and
``doctor`` exit 1 when they find a problem, for cron and health checks."""

from __future__ import annotations

from typing import Any

import typer

from mqorder.admin import render, transactions
from mqorder.admin.common import Admin
from mqorder.admin.consumers import group_consumers
from mqorder.admin.doctor import diagnose, diagnose_unreachable
from mqorder.admin.key_status import DEFAULT_SCAN, key_status
from mqorder.admin.key_status import render as render_key
from mqorder.admin.status import group_status
from mqorder.cli.common import EXIT_CHECK, JSON_OPT, emit
from mqorder.errors import BrokerUnavailableError
from mqorder.settings import get_settings
from mqorder.store.brokers import BrokerRegistry

app = typer.Typer()


@app.command()
def status(
    group: str = typer.Argument(..., help="consumer group"),
    topic: str = typer.Argument(None, help="only this topic (default: every topic of the group)"),
    stuck_after: float = typer.Option(
        60.0, "--stuck-after", min=0.0, max=10 * 365 * 86400.0,
        help="seconds a backlog may wait without progress before it counts as stuck (at most ten years)"
    ),
    check: bool = typer.Option(False, "--check", help="exit 1 if any queue is stuck (cron, health checks)"),
    key: str = typer.Option(
        None, "--key", help="only this sharding key: its queue, its head, whether it waits or is parked, and on what"
    ),
    scan: int = typer.Option(
        DEFAULT_SCAN, "--scan", help="with --key: backlog messages to read from the committed offset looking for the key"
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Per queue: offsets, lag, owner, lease, epoch, ConsumeRequest, head retries, last commit; stuck queues.
    With --key: where one sharding key stands (is it stuck, and on what)."""
    if key is not None:
        with Admin.open() as admin:
            report = key_status(admin, group, key, topic, scan)
        emit(report, as_json, render_key)
        if check and report.stuck(int(stuck_after * 1000)):
            raise typer.Exit(EXIT_CHECK)
        return
    with Admin.open() as admin:
        st = group_status(admin, group, topic, stuck_after)
    emit(st, as_json, render.status)
    if check and st.stuck:
        raise typer.Exit(EXIT_CHECK)


@app.command()
def consumers(group: str = typer.Argument(..., help="consumer group"), as_json: bool = JSON_OPT) -> None:
    """Clients of a group: heartbeat age, pool, assigned queues, locks held."""
    with Admin.open() as admin:
        gc = group_consumers(admin, group)
    emit(gc, as_json, render.consumers)


@app.command()
def txn(
    topic: str = typer.Argument(..., help="topic"),
    last: int = typer.Option(20, min=0, help="recent ends to show per queue"),
    as_json: bool = JSON_OPT,
) -> None:
    """Transactions of a topic still half-way (age, check-backs), and how recent ones ended and why."""
    with Admin.open() as admin:
        report = transactions.txn_report(admin, topic, last)
    emit(report, as_json, transactions.render)


@app.command()
def doctor(
    celery_app: str = typer.Option("mqorder.app:app", "--app", help="Celery app to check (module:attribute); '' to skip"),
    strict: bool = typer.Option(False, "--strict", help="exit 1 on warnings too"),
    as_json: bool = JSON_OPT,
) -> None:
    """Check Redis (version, persistence, eviction, memory, clocks, replication and what a failover can lose,
    Sentinels) and Celery settings; exit 1 on a problem."""
    conf, conf_error = _celery_conf(celery_app)
    settings = get_settings()
    # Not Admin.open(): a broker that does not answer is one FAIL finding, not the end of the run.
    try:
        brokers = BrokerRegistry(settings.redis_url, settings.brokers, socket_timeout=2.0)
    except BrokerUnavailableError as exc:  # a Redis Cluster none of whose listed nodes answers
        report = diagnose_unreachable(settings, exc, conf, conf_error)
    else:
        try:
            report = diagnose(settings, brokers, conf, conf_error)
        finally:
            brokers.close()
    emit(report, as_json, render.doctor)
    if report.failed(strict):
        raise typer.Exit(EXIT_CHECK)


def _celery_conf(spec: str) -> tuple[dict[str, Any] | None, str]:
    """The configuration of Celery app ``module:attribute``, or why it could not be loaded."""
    if not spec:
        return None, ""
    try:
        # Celery's own lookup, as `celery -A` does: `proj` finds `proj.app`, `proj.celery`'s app or
        # any app in the module (a Django project's `--app proj` failed with "no attribute 'app'").
        from celery.app.utils import find_app

        app_obj = find_app(spec)
        conf = app_obj.conf
        return {k: conf.get(k) for k in ("broker_url", "task_serializer", "result_serializer", "event_serializer",
                                         "accept_content", "broker_transport_options")}, ""
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return None, f"{spec} could not be loaded ({type(exc).__name__}: {exc})"
    except SystemExit as exc:
        # The stock app exits (status 2, its reason on stderr) on settings no worker can run with,
        # e.g. a cluster store and no MQORDER_CELERY_BROKER_URL: that ended the doctor before any
        # Redis check ran.
        return None, f"{spec} exited with status {exc.code} while loading (its reason is printed above)"

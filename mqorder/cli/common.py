"""What every ``mqorder`` command shares: the exit codes, one way to print a result, one way to fail.

A command returns nothing and prints through :func:`emit` (``--json``: the result's ``to_json()``
on stdout; otherwise a rich table drawn by ``mqorder.admin.render``). It reports a failure by
raising: mqorder's own errors, a refused change, a Redis that does not answer. :class:`HandledGroup`,
the root command group, turns each into one line on stderr and the exit code of the table in
``mqorder.cli`` — in one place, so no command can print an error to stdout or pick its own code.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar, cast

import redis
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from mqorder.admin.common import RefusedError
from mqorder.errors import MQOrderError
from mqorder.store.failures import setup_hint

#: Done (for ``status --check`` and ``doctor``: nothing found).
EXIT_OK = 0
#: A check failed (a stuck queue, a failed audit, a doctor finding) or a safety check refused a
#: change without ``--force``: nothing was changed.
EXIT_CHECK = 1
#: Bad input (an unknown topic or group, a bad argument or line) or an unreachable Redis.
EXIT_BAD = 2

#: Width of tables written to a pipe or a file (no terminal to fit): wide enough not to wrap rows.
PIPE_WIDTH = 200

JSON_OPT = typer.Option(False, "--json", help="machine-readable output (JSON on stdout)")

# emoji=False: a ":ledger:" in a key name or message is text, not an emoji ("mqorder📒nogroup" once).
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


class CliError(MQOrderError):
    """A command cannot go on; ``exit_code`` says how it ended (``EXIT_BAD`` unless told)."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Jsonable(Protocol):
    def to_json(self) -> Any: ...


def out() -> Console:
    """A console on the current stdout: the terminal's width, or ``COLUMNS`` / ``PIPE_WIDTH`` when
    piped (``| grep`` should see one line per queue, not rows wrapped at 80 columns)."""
    if sys.stdout.isatty():
        return Console(soft_wrap=True, emoji=False)
    return Console(file=sys.stdout, width=int(os.environ.get("COLUMNS") or PIPE_WIDTH), soft_wrap=True, emoji=False)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def emit(result: T, as_json: bool, draw: Callable[[Console, T], None]) -> None:
    """Print ``result`` (a report object, or a list of them) as JSON or drawn by ``draw``."""
    if as_json:
        items = cast(list[_Jsonable], result) if isinstance(result, list) else None
        print_json([r.to_json() for r in items] if items is not None else cast(_Jsonable, result).to_json())
    else:
        draw(out(), result)


def fail(exc: BaseException | str, code: int = EXIT_BAD) -> NoReturn:
    """Say what went wrong on stderr (one line, never wrapped into a box) and exit with ``code``."""
    err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def exit_code_for(exc: Exception) -> int | None:
    """The documented exit code of an error a command may raise; None for one we do not expect
    (a bug: its traceback is more useful than a one-liner)."""
    if isinstance(exc, CliError):
        return exc.exit_code
    if isinstance(exc, RefusedError):
        return EXIT_CHECK
    if isinstance(exc, MQOrderError | redis.ConnectionError | redis.TimeoutError | redis.ResponseError):
        return EXIT_BAD
    return None


def describe(exc: Exception) -> str:
    # mqorder's own errors carry the hint already (failures.translation, Broker.ping): once only.
    hint = None if isinstance(exc, MQOrderError) else setup_hint(exc)
    if hint is not None:
        return f"{hint} ({type(exc).__name__}: {exc})"
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return (f"Redis did not answer ({type(exc).__name__}: {exc}); is redis-server running, and do "
                "--redis-url, MQORDER_REDIS_URL (or MQORDER_BROKERS) point at it?")
    if isinstance(exc, redis.ResponseError):
        return f"Redis refused the command: {exc}"
    return str(exc)


class HandledGroup(TyperGroup):
    """The root group: every subcommand runs inside its ``invoke``, so this is the one place that
    turns an error into a line on stderr and an exit code (typer renders usage errors itself, also
    on stderr with exit code 2)."""

    def invoke(self, ctx: Any) -> Any:  # Any: the Context class of whichever click typer runs on
        try:
            return super().invoke(ctx)
        except Exception as exc:
            code = exit_code_for(exc)
            if code is None:  # typer.Exit, a usage error (typer renders it), or a bug (its traceback)
                raise
            fail(describe(exc), code)


def enum_parser(kind: type[E], what: str) -> Callable[[str | E], E]:
    """A typer ``parser`` for an Enum option: ``--help`` lists the values (typer reads them from the
    annotation) and a bad one is refused naming ``what`` and every choice."""

    def parse(value: str | E) -> E:
        if isinstance(value, kind):
            return value
        for member in kind:
            if member.value == value or str(member.value).lower() == str(value).lower():
                return member  # any case, as the data source's options and publish() take it
        raise typer.BadParameter(f"{what} must be one of {', '.join(str(m.value) for m in kind)}, got {value!r}")

    return parse


"""``mqorder message show``: a message by queue and offset, or by msg id (RocketMQ's queryMsgById)."""

from __future__ import annotations

import typer
from rich.console import Console

from mqorder.admin import messages, render, topics
from mqorder.admin.common import Admin, BadArgumentError
from mqorder.admin.messages import FoundMessage
from mqorder.cli.common import JSON_OPT, emit, err_console
from mqorder.model import MAX_OFFSET

app = typer.Typer(no_args_is_help=True, help="Look messages up by queue and offset, or by msg id")


@app.command("show")
def message_show(
    topic: str = typer.Argument(..., help="topic"),
    queue: int = typer.Option(None, "--queue", min=0, help="queue id (with --offset)"),
    offset: int = typer.Option(None, "--offset", min=0, max=MAX_OFFSET, help="queue offset (with --queue)"),
    broker: str = typer.Option(None, "--broker", help="broker of the queue, if the topic spans several"),
    msg_id: str = typer.Option(None, "--msg-id", help="find by msg id instead (scans the whole topic)"),
    as_json: bool = JSON_OPT,
) -> None:
    """A message by queue and offset, or by msg id (queryMsgById), with each group's progress on it."""
    if queue is not None and offset is not None and msg_id is None:
        with Admin.open() as admin:
            emit(messages.show(admin, topic, queue, offset, broker), as_json, render.message)
        return
    if msg_id is None or queue is not None or offset is not None:
        raise BadArgumentError("give either --queue Q --offset O, or --msg-id ID")
    with Admin.open() as admin:
        total = sum(q.messages for q in topics.describe(admin, topic).queues)
        err_console.print(f"scanning {total:,} messages of {topic} for msg id {msg_id}; "
                          "this may take a while on big topics", soft_wrap=True, highlight=False)
        found = messages.find_by_id(admin, topic, msg_id)
    if not found:
        raise BadArgumentError(f"no message with id {msg_id!r} in topic {topic!r}")
    emit(found, as_json, _draw_all)


def _draw_all(out: Console, found: list[FoundMessage]) -> None:
    """Every copy of a msg id (a resend under the same id is a second message), a blank line apart."""
    for i, f in enumerate(found):
        if i:
            out.print()
        render.message(out, f)

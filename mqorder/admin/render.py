"""Human output of the admin commands: rich tables over the dataclasses the command modules return.

One function per result type; ``--json`` bypasses this module (each result's ``to_json()``).
Times are shown as ages (``4.2s ago``) computed from Redis's clock where the result carries it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mqorder.admin.consumers import GroupConsumers
from mqorder.admin.dlq import DeadLetter, DlqPage, ReplayReport
from mqorder.admin.doctor import DoctorReport
from mqorder.admin.group_list import GroupList
from mqorder.admin.groups import GroupDeleteReport
from mqorder.admin.messages import FoundMessage
from mqorder.admin.offsets import ResetReport
from mqorder.admin.produce import ProduceReport
from mqorder.admin.status import GroupStatus
from mqorder.admin.topics import DeleteReport, TopicInfo
from mqorder.retention.trimmer import TrimReport

#: Bodies longer than this are cut in human output (``--json`` has them whole).
BODY_PREVIEW = 2000
#: A dead letter's reason is cut to this many characters in `dlq list` (``dlq show`` has it whole).
REASON_CUT = 60


def duration(ms: int | float | None) -> str:
    """``850ms``, ``4.2s``, ``3m04s``, ``2h05m``, ``3d04h``; ``-`` for None."""
    if ms is None:
        return "-"
    s = ms / 1000
    if abs(s) < 1:
        return f"{int(ms)}ms"
    if abs(s) < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def ago(ms: int | None, now_ms: int) -> str:
    return "never" if not ms else f"{duration(now_ms - ms)} ago"


def timestamp(ms: int | None) -> str:
    """Local time of an epoch-ms stamp, to the millisecond."""
    if not ms:
        return "-"
    try:
        return dt.datetime.fromtimestamp(ms / 1000).isoformat(sep=" ", timespec="milliseconds")
    except (ValueError, OverflowError, OSError):  # outside what datetime shows: the number itself
        return f"@{ms}"


def size(n: int) -> str:
    """``512 B``, ``3.4 KiB``, ``1.2 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n:,} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            return f"{value:,.1f} {unit}"
    raise AssertionError("unreachable")


def _table(title: str, columns: Iterable[str], right: Iterable[str] = ()) -> Table:
    t = Table(title=title, title_justify="left")
    right_set = set(right)
    for c in columns:
        t.add_column(c, justify="right" if c in right_set else "left")
    return t


# -- topics ------------------------------------------------------------------------------------


def topic_list(console: Console, infos: list[TopicInfo]) -> None:
    if not infos:
        console.print("no topics yet: create one with `mqorder topic create NAME --queues 8`")
        return
    t = _table("topics", ("topic", "queues", "brokers", "perm", "messages", "size", "groups"),
               right=("queues", "messages", "size"))
    for i in infos:
        t.add_row(i.topic, str(len(i.queues)), ", ".join(sorted(i.queues_per_broker)), i.perm, f"{i.messages:,}",
                  size(i.bytes), ", ".join(i.groups) or "-")
    console.print(t)


def topic(console: Console, info: TopicInfo) -> None:
    console.print(
        f"topic [bold]{info.topic}[/bold]: {len(info.queues)} queues, permission {info.perm}, created "
        f"{timestamp(info.created_ms)}; {info.messages:,} messages, {size(info.bytes)}; groups: "
        f"{', '.join(info.groups) or 'none'}"
    )
    if info.retention is not None:
        own = info.retention_own.to_fields()
        r = info.retention
        parts = [f"policy {r.policy.value}", f"retention {duration(r.retention_ms)}"]
        if r.policy.value == "consumed":
            parts.append(f"kept for replay {duration(r.retention_min_ms)}")
        if r.retention_max_messages:
            parts.append(f"at most {r.retention_max_messages:,} messages per queue")
        origin = "set on the topic: " + ", ".join(sorted(k.removeprefix("retention_") for k in own)) if own else "defaults"
        console.print(f"retention: {'; '.join(parts)} ({origin})")
    t = _table("", ("broker", "queue", "min offset", "max offset", "messages", "size"),
               right=("queue", "min offset", "max offset", "messages", "size"))
    for q in info.queues:
        t.add_row(q.broker, str(q.queue_id), f"{q.min_offset:,}", f"{q.max_offset:,}", f"{q.messages:,}",
                  size(q.bytes))
    console.print(t)


def topic_deleted(console: Console, r: DeleteReport) -> None:
    verb = "would delete" if r.dry_run else "deleted"
    kinds = ", ".join(f"{n} {k}" for k, n in r.keys_by_kind.items()) or "no queue keys"
    console.print(
        f"{verb} topic [bold]{r.topic}[/bold]: {r.queues} queues holding {r.messages:,} messages; "
        f"Redis keys: {kinds}; {r.assignment_fields} assignment and {r.stats_fields} stats fields"
    )
    if r.groups:
        console.print(f"{'would unsubscribe' if r.dry_run else 'unsubscribed'} group(s): {', '.join(r.groups)}")
    if r.live_consumers:
        console.print(
            f"[yellow]live consumers ({', '.join(r.live_consumers)}) still run its listener: they log that the "
            "topic is missing at every rebalance and subscribe again when they restart; remove the listener"
        )


def group_deleted(console: Console, r: GroupDeleteReport) -> None:
    verb = "would delete" if r.dry_run else "deleted"
    what = "group" if r.whole_group else "the subscription(s) of group"
    kinds = ", ".join(f"{n} {k}" for k, n in r.keys_by_kind.items()) or "no queue keys"
    console.print(
        f"{verb} {what} [bold]{escape(r.group)}[/bold] on {escape(', '.join(r.topics))}: lanes "
        f"{escape(', '.join(r.lanes)) or '-'}; Redis keys: {kinds}; {r.assignment_fields} assignment and "
        f"{r.stats_fields} stats fields; {r.ledger_keys} ledger key(s)"
    )
    for t in r.deleted_topics:
        console.print(f"{verb} topic [bold]{escape(t.topic)}[/bold]: {t.queues} queues holding {t.messages:,} messages")
    if r.dlq_kept:
        console.print(f"kept {escape(r.dlq_kept)} ({r.dlq_messages:,} dead letters): `mqorder dlq list {escape(r.group)}` "
                      "shows them; delete it with `mqorder topic delete` or pass --with-dlq")
    if r.live_consumers:
        console.print(
            f"[yellow]live consumers ({escape(', '.join(r.live_consumers))}) still run the group's listener: they "
            "record the subscription again at the next topology change and start from the first stored message; "
            "remove the listener and restart them"
        )


# -- status and consumers ----------------------------------------------------------------------


def status(console: Console, st: GroupStatus) -> None:
    multi_topic = len({q.topic for q in st.queues}) > 1
    lanes = any(q.sub != st.group for q in st.queues)
    cols = [*(["topic"] if multi_topic else []), *(["lane"] if lanes else []), "queue", "max offset",
            "committed", "lag", "owner", "lease", "epoch", "request", "retries", "last commit", "waiting"]
    skipped = any(q.skipped for q in st.queues)
    if skipped:
        cols.append("skipped")  # trimmed by retention before the group read them
    stuck = st.stuck
    # "retries": reconsume count of the head message; "waiting": how long the backlog has waited
    # without progress; "last commit": when the committed offset last moved.
    title = (f"group {st.group}: lag {st.lag:,} over {len(st.queues)} queues; "
             f"{len(stuck)} stuck (backlog waiting > {duration(st.stuck_after_ms)})")
    t = _table(title, cols, right=("max offset", "committed", "lag", "lease", "epoch", "retries", "skipped"))
    for q in st.queues:
        request = "running" if q.running else "pending" if q.pending else "-"
        row = [*([q.topic] if multi_topic else []), *([q.sub] if lanes else []), f"{q.broker}:{q.queue_id}",
               f"{q.max_offset:,}", f"{q.committed:,}", f"{q.lag:,}", q.owner or ("client gone" if q.client_gone else "-"),
               duration(q.lease_left_ms) if q.owner else "-", str(q.epoch), request,
               "-" if q.head_reconsume is None else str(q.head_reconsume), ago(q.commit_ms, q.now_ms),
               duration(q.waiting_ms) if q.waiting_ms is not None else "-"]
        if skipped:
            row.append(f"{q.skipped:,}")
        t.add_row(*(Text(c) for c in row), style="bold red" if q.stuck else None)
    console.print(t)
    if skipped:
        console.print(f"[yellow]skipped: {sum(q.skipped for q in st.queues):,} messages were trimmed by retention "
                      "before this group consumed them (time policy); it moved on in order")
    gone = sorted({q.sub for q in st.queues if q.client_gone})
    if gone:
        console.print(f"{len(gone)} broadcasting lane(s) of workers that are not running ({', '.join(gone[:5])}"
                      f"{' ...' if len(gone) > 5 else ''}): their backlog waits for them and is not counted as "
                      f"stuck; `mqorder group delete {st.group}` forgets a retired group's lanes")
    for missing in st.missing_topics:
        console.print(f"[yellow]{st.group} subscribes to topic {missing!r}, which does not exist")
    if stuck:
        console.print(Text(
            f"STUCK: {', '.join(q.queue_key for q in stuck)}: a backlog with no progress for over "
            f"{duration(st.stuck_after_ms)} (see `mqorder consumers {st.group}` and the workers' logs)",
            style="bold red",
        ))


def group_listed(console: Console, gl: GroupList) -> None:
    if not gl.groups:
        console.print("no consumer group yet: a group exists once a worker with one of its listeners has started, or "
                      "a PullConsumer of it has subscribed")
        return
    t = _table(f"{len(gl.groups)} group(s); {len(gl.stuck)} with stuck queues (backlog waiting > "
               f"{duration(gl.stuck_after_ms)})", ("group", "topics", "model", "consumers", "queues", "lag", "stuck"),
               right=("consumers", "queues", "lag", "stuck"))
    for g in gl.groups:
        t.add_row(Text(g.group), Text(", ".join(g.topics)), Text(", ".join(m.lower() for m in g.models)),
                  str(g.live_consumers), str(g.lanes), f"{g.lag:,}", str(g.stuck),
                  style="bold red" if g.stuck else None)
    console.print(t)
    for g in gl.groups:
        for missing in g.missing_topics:
            console.print(f"[yellow]{g.group} subscribes to topic {missing!r}, which does not exist")
    if gl.stuck:
        console.print(Text(f"STUCK: {', '.join(g.group for g in gl.stuck)} (see `mqorder status GROUP`)",
                           style="bold red"))


def consumers(console: Console, gc: GroupConsumers) -> None:
    if not gc.consumers:
        console.print(f"group {gc.group} has no live consumers")
        return
    t = _table(f"group {gc.group}: {len(gc.live)} live consumer(s)",
               ("client", "state", "heartbeat", "pool", "pid", "version", "topics", "assigned queues", "locks"),
               right=("locks", "pid"))
    for c in gc.consumers:
        pool = f"{c.pool} x{c.concurrency}" if c.pool else "-"
        t.add_row(c.client_id, "live" if c.live else "[red]lapsed[/red]", f"{duration(c.heartbeat_age_ms)} ago"
                  if c.heartbeat_age_ms is not None else "-", pool, str(c.pid or "-"), c.version or "older",
                  ", ".join(c.topics), _queues(c.assigned), str(c.locks_held))
    console.print(t)
    versions = {c.version or "older" for c in gc.live}
    if len(versions) > 1:
        console.print(f"mixed versions among the live consumers ({', '.join(sorted(versions))}): a rolling upgrade "
                      "under way, or a worker left behind")


def _queues(keys_: list[str]) -> str:
    """``orders:broker-a:0,2,5`` per (topic, broker) instead of one key per queue."""
    grouped: dict[str, list[str]] = {}
    for k in keys_:
        prefix, _, qid = k.rpartition(":")
        grouped.setdefault(prefix, []).append(qid)
    return " ".join(f"{p}:{','.join(sorted(ids, key=int))}" for p, ids in grouped.items()) or "-"


# -- dlq -----------------------------------------------------------------------------------------


def dlq_page(console: Console, page: DlqPage) -> None:
    console.print(f"{page.topic}: {page.total:,} dead letter(s) at offsets [{page.min_offset}, {page.max_offset})")
    if not page.messages:
        if page.total:  # a --from past the end, or --limit 0: say why nothing is listed
            console.print(f"none listed from the offset asked; list from {page.min_offset} to {page.max_offset - 1} "
                          "(--from) with --limit 1 or more")
        return
    # The msg id and the body are in `dlq show` and in --json; a row keeps to one line.
    t = _table("", ("offset", "origin queue@offset", "keys", "retries", "dead-lettered", "reason"),
               right=("offset", "retries"))
    for c in t.columns[:-1]:
        c.no_wrap = True
    for d in page.messages:
        origin = f"{d.origin_queue.key}@{d.origin_offset}" if d.origin_queue else "-"
        t.add_row(str(d.dlq_offset), Text(origin), Text(",".join(d.keys) or "-"),
                  "-" if d.reconsume_times is None else str(d.reconsume_times), timestamp(d.stored_ms),
                  Text(d.reason if len(d.reason) <= REASON_CUT else d.reason[: REASON_CUT - 1] + "…"))
    console.print(t)
    shown_to = page.messages[-1].dlq_offset + 1
    if shown_to < page.max_offset:
        console.print(f"more: mqorder dlq list {page.group} --from {shown_to}")


def dead_letter(console: Console, d: DeadLetter) -> None:
    origin = f"{d.origin_queue.key} offset {d.origin_offset}" if d.origin_queue else "unknown"
    rows = [
        ("DLQ offset", str(d.dlq_offset)), ("origin", origin), ("msg id", d.origin_msg_id or "-"),
        ("keys", ", ".join(d.keys) or "-"), ("tags", d.tags or "-"), ("reason", d.reason),
        ("reconsume times", "-" if d.reconsume_times is None else str(d.reconsume_times)),
        ("epoch / client", f"{d.epoch} / {d.client or '-'}"), ("stored", timestamp(d.stored_ms)),
        *((f"property {k}", v) for k, v in sorted(d.properties.items())),
    ]
    _fields(console, rows, d.body)


def replayed(console: Console, r: ReplayReport) -> None:
    if r.dry_run:
        console.print(f"would replay {r.read} dead letter(s) of {r.group}:")
    else:
        console.print(f"replayed {r.stored} of {r.read} dead letter(s) of {r.group}; {r.duplicates} were already "
                      "replayed by an earlier run and were not stored again")
    if r.same_origin:
        console.print(f"{r.same_origin} more dead letter(s) of a message already in the range (each client of a "
                      "broadcasting group dead-letters it once) {'would not be' if r.dry_run else 'were not'} "
                      "replayed again")
    for k, n in sorted(r.by_queue.items()):
        console.print(f"  {k}: {n}")
    for t, groups in sorted(r.other_groups.items()):
        console.print(f"{'would also reach' if r.dry_run else 'also delivered to'} the other group(s) of {t}: "
                      f"{', '.join(groups)}")


# -- offsets, messages, produce ------------------------------------------------------------------------


def reset(console: Console, r: ResetReport) -> None:
    to = r.target.kind if r.target.kind in ("earliest", "latest") else (
        f"offset {r.target.value}" if r.target.kind == "offset"
        else f"time {timestamp(r.target.value) if r.target.value else '@0 (epoch ms 0)'}")
    title = f"{'plan: reset' if r.dry_run else 'reset'} {r.group} on {r.topic} to {to}"
    t = _table(title, ("queue", "min", "max", "old offset", "new offset", "epoch", "lock taken from"),
               right=("min", "max", "old offset", "new offset", "epoch"))
    for q in r.queues:
        t.add_row(f"{q.broker}:{q.queue_id}" + (f" ({q.sub})" if q.sub != r.group else ""), f"{q.min_offset:,}",
                  f"{q.max_offset:,}", f"{q.old_offset:,}", f"{q.new_offset:,}", str(q.epoch) if q.epoch else "-",
                  q.owner or "-")
    console.print(t)
    if r.subscribed:
        console.print(f"group {escape(r.group)} did not subscribe to {escape(r.topic)}: "
                      f"{'would record' if r.dry_run else 'recorded'} its subscription (clustering), so its consumers "
                      "start from these offsets; `mqorder group delete` removes it if it was a typo")
    if not r.dry_run and r.live_consumers:
        console.print(f"live consumers ({', '.join(r.live_consumers)}) were told to rebalance; they resume from the "
                      "new offsets under new epochs")


def message(console: Console, found: FoundMessage) -> None:
    m = found.msg
    rows = [
        ("queue", f"{m.message_queue.key} offset {m.queue_offset}"), ("msg id", m.msg_id or "-"),
        ("keys", ", ".join(m.keys) or "-"), ("tags", m.tags or "-"), ("born", timestamp(m.born_timestamp)),
        ("stored", timestamp(m.store_timestamp)),
        *((f"property {k}", v) for k, v in sorted(m.properties.items())),
    ]
    if m.decode_error:
        rows.append(("decode error", m.decode_error))
    for g in found.groups:
        retries = f", reconsumed {g.reconsume_times}x" if g.reconsume_times else ""
        rows.append((f"group {g.sub}", f"{g.state} (committed offset {g.committed}{retries})"))
    _fields(console, rows, m.body)


def produced(console: Console, r: ProduceReport) -> None:
    for b in r.bad[:20]:
        console.print(f"[red]line {b.line}:[/red] {escape(b.error)}")  # quotes the line: data, not markup
    if len(r.bad) > 20:
        console.print(f"[red]... and {len(r.bad) - 20} more bad lines (all of them in --json)")
    console.print(f"sent {r.sent:,} messages to {r.topic} in {r.chunks} chunk(s) over {len(r.by_queue)} queue(s); "
                  f"{len(r.bad)} bad line(s)")
    if r.refused:
        console.print(f"[red]stopped: the chunk of lines {r.refused[0]}-{r.refused[1]} was refused, nothing of it was "
                      "sent, and nothing after it (fix the lines, then send from line "
                      f"{r.refused[0]} on, or pass --skip-bad)")


def trimmed(console: Console, r: TrimReport) -> None:
    """``mqorder retention run``: what each topic lost, under which rule, and who held it back."""
    for t, n in sorted(r.by_topic().items()):
        rule = r.rules[t]
        held = f"; held back by {', '.join(r.holders[t])}" if r.holders.get(t) else ""
        console.print(f"{t}: trimmed {n:,} ({rule.policy.value}, retention {rule.retention_ms:,} ms{held})")
    console.print(f"trimmed {r.trimmed:,} messages and {r.ledger_trimmed:,} ledger records in "
                  f"{r.calls} script calls, {r.took_ms:.1f} ms")


#: Colour of each ``mqorder doctor`` verdict.
VERDICT_COLOUR = {"OK": "green", "WARN": "yellow", "FAIL": "bold red"}


def doctor(console: Console, r: DoctorReport) -> None:
    """One line per finding, its fix indented below it."""
    for f in r.findings:
        where = f" ({f.broker})" if f.broker else ""
        console.print(f"[{VERDICT_COLOUR[f.verdict.value]}]{f.verdict.value:4}[/] {escape(f.check + where)}: "
                      f"{escape(f.detail)}", highlight=False)
        if f.fix:
            console.print(f"      fix: {escape(f.fix)}", highlight=False)


def _fields(console: Console, rows: list[tuple[str, str]], body: bytes) -> None:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:  # message data (properties, keys, reasons): text, never rich markup
        t.add_row(Text(k), Text(v))
    try:
        text = body.decode("utf-8")
        shown = text[:BODY_PREVIEW] + (f"... ({len(text) - BODY_PREVIEW:,} more characters)" if len(text) > BODY_PREVIEW
                                       else "")
    except UnicodeDecodeError:
        shown = f"<{len(body):,} bytes, not UTF-8; --json gives them as body_base64>"
    t.add_row("body", Text(shown))
    console.print(t)

"""``mqorder produce TOPIC --key-field F``: JSON lines from stdin (or a file) into a topic, in order.

Each line is one message: its bytes are the body (never re-encoded) and the value of field ``F``
(``a.b`` reaches into nested objects) is the sharding key, so every line of one key lands in one
queue in the order read. Lines are sent in chunks with ``Producer.send_orderly_batch`` (one script
call per queue chunk, pipelined per broker), after the whole chunk was validated: a chunk holding a
bad line is refused before anything of it is written. By default the run stops there (sending a
later chunk would let a key's later lines overtake a refused earlier one); with ``skip_bad`` bad
lines are reported and left out, every good line is sent.

A run a broker failure stopped says from which line to send again (``from_line``). With a dedup
field (``dedup_field``: each line's event id) every line is sent with that id as its dedup key, so
lines of the interrupted chunk that were stored are not stored again within the dedup window
(``MQORDER_DEDUP_WINDOW_MS``); without one they may be stored twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from mqorder.client.dedup import check_dedup_key
from mqorder.client.producer import Producer
from mqorder.codec import check_body
from mqorder.errors import BrokerUnavailableError, MessageError

DEFAULT_CHUNK = 1000
#: A bad line's text is quoted up to this many characters.
QUOTE = 80


@dataclass(frozen=True)
class BadLine:
    line: int
    error: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProduceReport:
    topic: str
    lines: int = 0  # lines read (blank ones included)
    sent: int = 0
    chunks: int = 0
    bad: list[BadLine] = field(default_factory=list)
    #: (first, last) line of the chunk that was refused and stopped the run, if one was.
    refused: tuple[int, int] | None = None
    by_queue: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.bad and self.refused is None

    def to_json(self) -> dict[str, Any]:
        return {"topic": self.topic, "lines": self.lines, "sent": self.sent, "chunks": self.chunks,
                "bad": [b.to_json() for b in self.bad], "refused_lines": self.refused, "by_queue": self.by_queue}


class ProduceInterrupted(BrokerUnavailableError):
    """A broker failed mid-run: what was sent before is stored, the failing chunk may be in part."""


def sharding_key(obj: Any, key_field: str) -> str | int:
    """The value of ``key_field`` in ``obj`` (a literal field name first, then a dotted path)."""
    return _field(obj, key_field)


def _field(obj: Any, key_field: str) -> str | int:
    """A non-empty string or integer field of a JSON object, by name or dotted path."""
    if not isinstance(obj, dict):
        raise ValueError(f"not a JSON object but {type(obj).__name__}")
    if key_field in obj:
        value = obj[key_field]
    else:
        value = obj
        for part in key_field.split("."):
            if not isinstance(value, dict) or part not in value:
                raise ValueError(f"no field {key_field!r}")
            value = value[part]
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ValueError(f"field {key_field!r} must be a non-empty string or an integer, got {value!r}"[:200])
    return value


def parse_line(raw: bytes, key_field: str, max_size: int, dedup_field: str | None = None
               ) -> tuple[str | int, bytes, str | None]:
    """(sharding key, body, dedup key or None) of one line; ``ValueError`` saying what is wrong."""
    body = raw.strip()
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc}): {body[:QUOTE]!r}") from None
    key = sharding_key(obj, key_field)
    dedup = None if dedup_field is None else str(_field(obj, dedup_field))
    if dedup is not None:
        try:
            check_dedup_key(dedup)  # a bad id is a bad line (its number given, --skip-bad leaves it out)
        except MessageError as exc:
            raise ValueError(f"field {dedup_field!r}: {exc}") from None
    try:
        check_body(body, max_size)
    except MessageError as exc:
        raise ValueError(str(exc)) from None
    return key, body, dedup


def produce(
    producer: Producer, topic: str, lines: Iterable[bytes], key_field: str, *, chunk_size: int = DEFAULT_CHUNK,
    skip_bad: bool = False, progress: Callable[[int, int], None] | None = None, dedup_field: str | None = None,
    from_line: int = 1,
) -> ProduceReport:
    """Send every line of ``lines`` from line ``from_line`` on (the lines before it are read and
    counted, not sent); ``progress(lines read, bytes read)`` after each chunk.

    Raises ``ProduceInterrupted`` if a broker fails mid-run (the report so far is in its message).
    """
    producer.describe_topic(topic)  # an unknown topic fails before stdin is read
    report = ProduceReport(topic)
    chunk: list[tuple[int, str | int, bytes, str | None]] = []
    chunk_bad: list[BadLine] = []
    read_bytes = 0
    first_line = 1

    def flush() -> bool:
        """Send the chunk; False when it was refused and the run must stop."""
        nonlocal first_line
        last_line = report.lines
        span = (first_line, last_line)
        first_line = last_line + 1
        report.bad.extend(chunk_bad)
        if chunk_bad and not skip_bad:
            report.refused = span
            return False
        if chunk:
            try:
                dedup = [d for *_, d in chunk] if dedup_field is not None else None
                results = producer.send_orderly_batch(topic, [(k, b) for _, k, b, _ in chunk], dedup_keys=dedup)
            except MessageError as exc:
                report.bad.append(BadLine(span[0], f"chunk of lines {span[0]}-{span[1]} refused: {exc}"))
                report.refused = span
                return False
            except BrokerUnavailableError as exc:
                again = (f"send again with --from-line {span[0]}: with --dedup-field {dedup_field} the lines "
                         "already stored are not stored twice (within MQORDER_DEDUP_WINDOW_MS)"
                         if dedup_field is not None else
                         f"send again with --from-line {span[0]}; those lines may then be stored twice (give "
                         "--dedup-field with each line's unique id to make a resend safe)")
                raise ProduceInterrupted(
                    f"{exc}. Lines before {span[0]} were sent ({report.sent} messages); lines {span[0]}-{span[1]} "
                    f"may be stored in part; nothing after them was sent: {again}"
                ) from exc
            report.sent += len(results)
            report.chunks += 1
            for r in results:
                report.by_queue[r.message_queue.key] = report.by_queue.get(r.message_queue.key, 0) + 1
        chunk.clear()
        chunk_bad.clear()
        if progress is not None:
            progress(report.lines, read_bytes)
        return True

    max_size = producer.settings.max_message_size
    for raw in lines:
        report.lines += 1
        read_bytes += len(raw)
        if report.lines < from_line:
            first_line = report.lines + 1
            continue
        if raw.strip():
            try:
                key, body, dedup_key = parse_line(raw, key_field, max_size, dedup_field)
                chunk.append((report.lines, key, body, dedup_key))
            except ValueError as exc:
                chunk_bad.append(BadLine(report.lines, str(exc)))
        if len(chunk) + len(chunk_bad) >= chunk_size and not flush():
            return report
    if chunk or chunk_bad:
        flush()
    elif progress is not None:
        progress(report.lines, read_bytes)
    return report

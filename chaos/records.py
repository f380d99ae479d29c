"""The structured records the chaos suite proves its properties from.

Worker and beat processes write them, as JSON objects, to Redis lists of the *ledger* Redis (a
separate ``redis-server`` no scenario touches); the checker reads them back with the same
dataclasses. The writer and the reader share this one schema, so a property is never proven by
parsing a log line or a field position that a harmless rewording could break: a record whose
fields do not match the schema makes ``from_json`` raise instead of being misread.

* ``ledger`` — one :class:`Entry` per message handed to the listener (``chaos.listeners``);
* ``refusals`` — one :class:`Refusal` per fenced commit or lease touch the engine refused (the
  listener's ``ConsumeMessageHook.consume_refused``);
* ``published`` — one :class:`Published` per task a beat process sent (Celery's
  ``before_task_publish`` signal in a beat started by the runner);
* ``ledger:<group>`` — the :class:`Entry` records of another consumer group of the same workers
  (``groups-kill``: ``group_ledger``), each group's calls in a list of their own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Self, TypeVar

#: Redis list (ledger Redis) of :class:`Entry` records.
LEDGER = "ledger"
#: Redis list (ledger Redis) of :class:`Refusal` records.
REFUSALS = "refusals"
#: Redis list (ledger Redis) of :class:`Published` records.
PUBLISHED = "published"


def group_ledger(group: str) -> str:
    """The Redis list of the :class:`Entry` records of ``group``, a consumer group other than the
    chaos listener's (whose list stays ``LEDGER``): each group is checked from its own calls."""
    return f"{LEDGER}:{group}"


#: ``Entry.status`` of a call that returned SUCCESS (anything else: a poison message's SUSPEND).
SUCCESS = "SUCCESS"
#: ``Refusal.reason`` values, as the engine names them in ``RefusedContext``.
FENCED = "FENCED"
SUPERSEDED = "SUPERSEDED"
BACKWARD = "BACKWARD"
#: A run read past the queue's end: Redis failed over to a replica that missed the last appends.
AHEAD = "AHEAD"


class _Record:
    """JSON in and out, with exactly the dataclass's fields (a missing or extra field raises)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        d: dict[str, Any] = json.loads(raw)
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if set(d) != names:
            raise ValueError(f"{cls.__name__} record with fields {sorted(d)}, expected {sorted(names)}: {raw!r}")
        return cls(**d)


R = TypeVar("R", bound=_Record)


@dataclass(frozen=True)
class Entry(_Record):
    """One message of one listener call.

    ``start``/``end`` are the call's wall-clock bounds (``time.time()``), the same for every message
    of the call. ``still_owner`` is ``ctx.still_owner()`` asked at the end of the call (None when the
    Redis under test did not answer): a holder paused past its lease must see False. ``asked`` is
    ``time.time()`` right before that question was sent (``end`` is right after the answer came):
    Redis evaluated the answer somewhere in ``[asked, end]``, which a pause of the process may
    stretch to seconds. ``run`` is ``ctx.run_id``, unique per ConsumeRequest run, so the checker
    can tell one run from the next.
    """

    key: str
    seq: int
    queue: int
    offset: int
    epoch: int
    client: str
    pid: int
    start: float
    end: float
    reconsume: int
    status: str
    still_owner: bool | None
    run: str
    asked: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == SUCCESS

    @property
    def poison(self) -> bool:
        return self.key.startswith("poison-")

    @property
    def proc(self) -> tuple[str, int]:
        return (self.client, self.pid)


@dataclass(frozen=True)
class Refusal(_Record):
    """A fenced commit or lease touch refused by Redis (the engine's ``RefusedContext``).

    ``reason``: ``FENCED`` (``epoch`` is stale: ``current_epoch`` is held by ``current_owner``),
    ``SUPERSEDED`` (the run's dispatch token was replaced at the same epoch), ``BACKWARD`` or
    ``AHEAD`` (the run read past the queue's end, after a failover that lost appends).
    ``offset`` is the offset the run tried to commit; ``at`` is ``time.time()`` in the worker.
    """

    group: str
    topic: str
    queue: int
    client: str
    pid: int
    run: str
    epoch: int
    reason: str
    current_epoch: int
    current_owner: str
    offset: int
    at: float


@dataclass(frozen=True)
class Published(_Record):
    """A task a beat process published: ``role`` is the beat's name given by the runner (``beat0``
    for the first beat started in a scenario, ``beat1`` for the next...)."""

    role: str
    task: str
    pid: int
    at: float


def read_all(raws: Sequence[bytes | str], cls: type[R]) -> list[R]:
    """Records of one kind, in the order they were appended."""
    return [cls.from_json(raw) for raw in raws]

"""``TrimmedRanges``: what retention took from under a run, kept until a fenced commit counts it.

Under the ``time`` retention policy (or for a group gone longer than ``retention_ms``) a run may
find that messages it never read were trimmed. It moves past them in order (invariant 7), and the
fenced commit whose offset passes a range reports it (``skipped`` in the queue's state): counted
once, by the run that moved past it, and only if that commit was accepted.
"""

from __future__ import annotations

import logging

from mqorder.model import MessageQueue

log = logging.getLogger(__name__)


class TrimmedRanges:
    """The trimmed ranges of one run that no accepted commit has counted yet."""

    __slots__ = ("floor", "pending")

    def __init__(self) -> None:
        #: ``(end, count)`` per range: reported with the first commit at or past ``end``.
        self.pending: list[tuple[int, int]] = []
        #: Where a run that found everything up to the queue's end trimmed commits to, once it holds
        #: nothing else (0: no such tail).
        self.floor = 0

    def add(self, end: int, n: int) -> None:
        self.pending.append((end, n))

    def due(self, offset: int) -> int:
        """Trimmed messages a commit of ``offset`` moves past: what it reports to the commit script
        (``skipped``), which counts them only if the commit passes its fence."""
        if not self.pending:
            return 0
        return sum(n for end, n in self.pending if end <= offset)

    def counted(self, offset: int) -> None:
        """The accepted commit of ``offset`` counted what it moved past: never report it again."""
        self.pending = [(end, k) for end, k in self.pending if end > offset]


def log_trimmed(logged: set[tuple[str, str]], sub: str, mq: MessageQueue, start: int, end: int, n: int) -> None:
    """A warning the first time per (subscription, queue) in this process, then debug lines."""
    key = (sub, mq.key)
    level = logging.DEBUG if key in logged else logging.WARNING
    logged.add(key)
    log.log(level, "retention trimmed %d messages of %s (offsets %d..%d) before %s consumed them; moving on "
            "at offset %d, in order (counted as skipped in `mqorder status`)", n, mq.key, start, end - 1, sub, end)

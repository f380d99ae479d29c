"""Exponential backoff for loops that retry through a Redis outage.

Three loops retry that way (a ConsumeRequest, a worker client's duties, its wake-up
subscription); they share this one rule: start small so a blip costs little, double up to a cap
so a long outage does not hammer a recovering Redis, and start over after a success.
"""

from __future__ import annotations


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self._delay = first

    def next(self) -> float:
        """The delay to wait now; the one after it doubles (up to ``cap``)."""
        delay = self._delay
        self._delay = min(self._delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._delay = self.first

"""Deadline arithmetic shared by stores, transports and the launcher.

Layer: core. A Deadline turns one timeout into the remaining time of each wait along the way.
"""

from __future__ import annotations

import datetime
import time


def as_seconds(timeout: float | datetime.timedelta | None, default: float) -> float:
    """Normalise a timeout given as seconds, a timedelta or None (meaning `default`) to seconds."""
    if timeout is None:
        return float(default)
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class Deadline:
    """A point in monotonic time; `remaining()` is what is left of the original timeout (never negative)."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.at = time.monotonic() + timeout

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

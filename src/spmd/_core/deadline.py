"""Deadline arithmetic shared by stores, transports and the launcher.

Layer: core. A Deadline turns one timeout into the remaining time of each wait along the way. Timeouts are
validated once, where they enter: NaN would make a deadline that never expires and compares false with every
other, and a negative one is a caller's mistake; inf means wait forever.
"""

from __future__ import annotations

import datetime
import math
import time


def as_seconds(timeout: float | datetime.timedelta | None, default: float, name: str = "timeout") -> float:
    """Normalise a timeout given as seconds, a timedelta or None (meaning `default`) to seconds.

    Raises ValueError naming `name` for NaN or a negative timeout; inf (wait forever) is accepted.
    """
    if timeout is None:
        seconds = float(default)
    elif isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a non-negative number of seconds (or inf to wait forever), got {timeout!r}")
    return seconds


class Deadline:
    """A point in monotonic time; `remaining()` is what is left of the original timeout (never negative)."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float) -> None:
        if math.isnan(timeout):
            raise ValueError("Deadline: the timeout is NaN; pass a number of seconds or inf")
        self.timeout = timeout
        self.at = time.monotonic() + timeout

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

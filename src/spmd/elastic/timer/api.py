"""torch's `elastic.timer.api` path: the timer protocol (spmd.run.timer). Layer: run (an alias)."""

from spmd.run.timer import RequestQueue, TimerClient, TimerRequest, TimerServer, configure, expires

__all__ = ["RequestQueue", "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]

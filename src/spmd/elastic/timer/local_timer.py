"""torch's `elastic.timer.local_timer` path: timers over a multiprocessing queue (spmd.run.timer). Layer: run (an
alias)."""

from spmd.run.timer import LocalTimerClient, LocalTimerServer, MultiprocessingRequestQueue

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

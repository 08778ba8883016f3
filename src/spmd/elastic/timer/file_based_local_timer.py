"""torch's `elastic.timer.file_based_local_timer` path: timers over a FIFO (spmd.run.timer). Layer: run (an
alias)."""

from spmd.run.timer import FileTimerClient, FileTimerRequest, FileTimerServer

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer"]

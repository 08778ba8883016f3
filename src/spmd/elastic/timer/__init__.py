"""Expiration timers at torch's path (`elastic.timer`): `with expires(after=60): ...` has this host's timer server
kill a worker whose block did not end in time. The implementation is spmd.run.timer; spmdrun runs the file server
when TORCHELASTIC_ENABLE_FILE_TIMER=1. Layer: run (an alias; it holds no logic)."""

from spmd.run.timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    LocalTimerClient,
    LocalTimerServer,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer", "LocalTimerClient", "LocalTimerServer",
           "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]

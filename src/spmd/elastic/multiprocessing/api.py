"""torch's `elastic.multiprocessing.api` path: the log specs, `Std` and `SignalException` (see the package).
Layer: run (an alias)."""

from spmd.elastic.multiprocessing import DefaultLogsSpecs, LogsSpecs, SignalException, Std

__all__ = ["DefaultLogsSpecs", "LogsSpecs", "SignalException", "Std"]

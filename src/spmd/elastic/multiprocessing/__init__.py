"""torch's `elastic.multiprocessing` names a launch takes: `Std` and the log specs (`LogsSpecs`,
`DefaultLogsSpecs`) that elastic_launch's LaunchConfig(logs_specs=...) carries. Layer: run (an alias; the
classes are spmd.run.config's)."""

from spmd.run.config import DefaultLogsSpecs, LogsSpecs, Std

__all__ = ["DefaultLogsSpecs", "LogsSpecs", "Std"]

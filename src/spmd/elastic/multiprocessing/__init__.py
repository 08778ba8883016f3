"""torch's `elastic.multiprocessing` names a launch takes: `Std` and the log specs (`LogsSpecs`,
`DefaultLogsSpecs`) that elastic_launch's LaunchConfig(logs_specs=...) carries, and `SignalException`, which
elastic_launch raises when a signal stops its agent. Layer: run (an alias; the classes are spmd.run's)."""

from spmd.run.agent import SignalException
from spmd.run.config import DefaultLogsSpecs, LogsSpecs, Std

__all__ = ["DefaultLogsSpecs", "LogsSpecs", "SignalException", "Std"]

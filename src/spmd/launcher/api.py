"""torch's `launcher.api` (its distributed package's): `elastic_launch(config, entrypoint)(*args)` runs this
node's part of a job from Python, as spmdrun runs it from the shell, and returns what each worker returned.

Layer: run (torch's module path). `entrypoint` is a function, run as `entrypoint(*args)` in each worker (it must be
picklable: a module-level function, of an importable module or of the launching script, as for torch's spawn
start method), or a program, run as `entrypoint *args` (`sys.executable` and `["-u", "train.py", ...]` for a
script). The workers get spmdrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so
`spmd.init_process_group()` needs no arguments; a failure restarts the group up to `max_restarts` times and
then raises ChildFailedError naming the root cause's rank, host and traceback. Call it from the main thread (the
agent handles SIGINT and SIGTERM). The function and its arguments travel to the workers pickled, in a private
temporary directory of the launching user, as multiprocessing's spawn sends them, and so do the return values.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from spmd.run.cli import parse_endpoint
from spmd.run.config import DEFAULT_RDZV_PORT, EntryKind, LogsSpecs, RendezvousTimeouts
from spmd.run.config import LaunchConfig as AgentConfig

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

_RENDEZVOUS = ("c10d", "static")     # what spmd's one rendezvous serves (torch's etcd backends are not)


@dataclasses.dataclass
class LaunchConfig:
    """torch's launch configuration, field for field. Served: the node counts (min_nodes < max_nodes is an
    elastic job), nproc_per_node, run_id, rdzv_endpoint ("" for a one-node job), rdzv_backend ("c10d" or
    "static"), rdzv_configs' "join_timeout" / "last_call_timeout" / "timeout" (seconds), rdzv_timeout,
    max_restarts, monitor_interval, local_addr, shutdown_timeout and logs_specs (a LogsSpecs: log directory,
    redirects, tee, local ranks shown; spmdrun's directory layout). The rest (role, start_method,
    log_line_prefix_template, metrics_cfg, event_log_handler, numa_options, signals_to_handle, the duplicate
    filters, virtual_local_rank) are accepted for torch's signature and change nothing: spmd's workers always
    start fresh (torch's "spawn") and their output reaches the console prefixed with their rank."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = dataclasses.field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | None = None


class elastic_launch:
    """`elastic_launch(config, entrypoint)(*args)`: this node's workers run `entrypoint` with `args`; returns
    {global rank: its return value} for this node's workers (None for a program's)."""

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None) -> None:
        self._config, self._entrypoint = config, entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def launch_agent(config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any]
                 ) -> dict[int, Any]:
    """Run this node's agent until the job ends (see elastic_launch); raises ChildFailedError if it failed."""
    from spmd.run.agent import Agent, result_file  # here, as spmdrun imports it: `import spmd` stays light

    if entrypoint is None:
        raise ValueError("spmd.launcher.api: entrypoint is None; pass a function or a program")
    workdir = tempfile.mkdtemp(prefix="spmd-launch-")   # 0700: only this user reads the pickles in it
    try:
        if callable(entrypoint):
            target, kind, argv = _pickle_call(entrypoint, tuple(args), workdir), EntryKind.CALLABLE, ()
        else:
            target, kind, argv = str(entrypoint), EntryKind.BINARY, tuple(str(a) for a in args)
        agent = Agent(_agent_config(config, target, kind, argv))
        agent.raise_if_failed(agent.run(), "elastic_launch")
        ranks = sorted(agent.last_ranks)
        if kind is not EntryKind.CALLABLE:
            return dict.fromkeys(ranks)
        results = {}
        for rank in ranks:
            with open(result_file(target, rank), "rb") as file:
                results[rank] = pickle.load(file)   # written by this user's own workers
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], workdir: str) -> str:
    """The payload the workers read: the call, this process's sys.path and (for a function of the launching
    script) that script's path."""
    try:
        call = pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(f"spmd.launcher.api: the entrypoint {getattr(fn, '__qualname__', fn)!r} or its arguments "
                         f"can't be sent to the workers ({error}); use a module-level function (not a lambda or "
                         f"a nested function) and picklable arguments") from None
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None) if getattr(fn, "__module__", None) == "__main__" else None
    if getattr(fn, "__module__", None) == "__main__" and main_file is None:
        raise ValueError("spmd.launcher.api: the entrypoint is defined in an interactive __main__ (a notebook or "
                         "the REPL), which new worker processes can't import; define it in a module")
    path = os.path.join(workdir, "call.pickle")
    with open(path, "wb") as file:
        pickle.dump({"call": call, "sys_path": list(sys.path),
                     "main_path": os.path.abspath(main_file) if main_file else None}, file)
    return path


def _agent_config(config: LaunchConfig, target: str, kind: EntryKind, argv: tuple[str, ...]) -> AgentConfig:
    """spmdrun's configuration of torch's."""
    if config.rdzv_backend not in _RENDEZVOUS and config.rdzv_endpoint:
        raise ValueError(f"spmd.launcher.api: rdzv_backend {config.rdzv_backend!r} is not served: spmd has one "
                         f"rendezvous, which serves {' and '.join(_RENDEZVOUS)}; pass rdzv_backend='c10d'")
    host, port = parse_endpoint(config.rdzv_endpoint) if config.rdzv_endpoint else (None, DEFAULT_RDZV_PORT)
    if host is not None and config.max_nodes == 1 and host in ("localhost", "127.0.0.1", "::1"):
        host = None    # a one-node job on this host: its own private rendezvous (torchrun's --standalone)
    timeouts: dict[str, float] = {}
    join = config.rdzv_configs.get("join_timeout", config.rdzv_configs.get("timeout"))
    if config.rdzv_timeout > 0:
        join = config.rdzv_timeout
    if join is not None:
        timeouts["join_timeout"] = float(join)
    if "last_call_timeout" in config.rdzv_configs:
        timeouts["last_call_timeout"] = float(config.rdzv_configs["last_call_timeout"])
    extra: dict[str, Any] = {"rdzv_id": config.run_id} if config.run_id else {}
    if isinstance(config.logs_specs, LogsSpecs):
        redirects, tee, shown = config.logs_specs.policies()
        extra.update(log_dir=config.logs_specs.root_log_dir, redirects=redirects, tee=tee, local_ranks_filter=shown)
    elif config.logs_specs is not None:
        raise TypeError(f"spmd.launcher.api: logs_specs must be a LogsSpecs (spmd.elastic.multiprocessing's "
                        f"DefaultLogsSpecs), got {type(config.logs_specs).__name__}")
    return AgentConfig(
        entrypoint=target, args=argv, kind=kind, nproc_per_node=config.nproc_per_node,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, rdzv_host=host, rdzv_port=port,
        rdzv_token=os.environ.get("SPMD_STORE_TOKEN") or None, max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, local_addr=config.local_addr,
        shutdown_grace=float(config.shutdown_timeout) if config.shutdown_timeout is not None else 5.0,
        timeouts=RendezvousTimeouts(**timeouts), python=sys.executable,
        omp_num_threads=1 if config.nproc_per_node > 1 else None, **extra)


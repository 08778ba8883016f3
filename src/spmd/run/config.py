"""LaunchConfig: everything one `spmdrun` agent needs to know, validated once.

Layer: run. Pure data: building a LaunchConfig has no side effects (no sockets, no processes), so the CLI,
Slurm detection and tests can construct and compare them freely.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import uuid

DEFAULT_RDZV_PORT = 29400


class EntryKind(enum.Enum):
    """How a worker runs its entry point."""

    SCRIPT = "script"  # python <path> args
    MODULE = "module"  # python -m <module> args
    BINARY = "binary"  # <program> args (--no-python)
    CALLABLE = "callable"  # a Python function and its arguments, pickled into a private file (launcher.api)


class Std(enum.IntFlag):
    """Which of a worker's streams go to its log file instead of (redirect) or as well as (tee) the console."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, text: str) -> Std | dict[int, Std]:
        """torch's parser: '3' is one Std for every rank, '0:3,1:0' one per local rank."""
        policy = StdPolicy.parse(text, "Std.from_str")
        return dict(policy.per_rank) if ":" in text else policy.default


class LogsSpecs:
    """Where a launch's per-rank logs go (torch's `elastic.multiprocessing` name): `log_dir`, the streams that go
    there only (`redirects`) or there and to the console (`tee`), a Std or one per local rank, and the local ranks
    whose output reaches the console (`local_ranks_filter`; None: all). spmdrun's layout:
    <log_dir>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log."""

    def __init__(self, log_dir: str | None = None, redirects: Std | dict[int, Std] = Std.NONE,
                 tee: Std | dict[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @property
    def root_log_dir(self) -> str | None:
        return self._root_log_dir

    def policies(self) -> tuple[StdPolicy, StdPolicy, frozenset[int] | None]:
        """(redirects, tee, local ranks shown) as spmdrun's configuration holds them."""
        shown = None if self._local_ranks_filter is None else frozenset(self._local_ranks_filter)
        return StdPolicy.of(self._redirects), StdPolicy.of(self._tee), shown


class DefaultLogsSpecs(LogsSpecs):
    """LogsSpecs whose `log_dir` is made if missing (a file there is refused), as torch's."""

    def __init__(self, log_dir: str | None = None, redirects: Std | dict[int, Std] = Std.NONE,
                 tee: Std | dict[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        if log_dir and log_dir != os.devnull:
            if os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file")
            os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)


@dataclasses.dataclass(frozen=True)
class StdPolicy:
    """Per-local-rank Std flags: a default for all ranks and optional overrides (torchrun's `0:3,1:0`)."""

    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        return dict(self.per_rank).get(local_rank, self.default)

    @staticmethod
    def of(flags: Std | dict[int, Std]) -> StdPolicy:
        """One Std for every rank, or one per local rank (the others: none)."""
        if isinstance(flags, dict):
            return StdPolicy(per_rank=tuple(sorted((rank, Std(flag)) for rank, flag in flags.items())))
        return StdPolicy(default=Std(flags))

    def any(self) -> bool:
        return bool(self.default) or any(flag for _, flag in self.per_rank)

    @staticmethod
    def parse(text: str, flag: str) -> StdPolicy:
        """'3' (every rank) or '0:3,1:0' (per local rank); the digits are Std flags 0-3."""

        def one(value: str) -> Std:
            if value.strip() not in {"0", "1", "2", "3"}:
                raise ValueError(f"spmdrun: {flag} {text!r}: each value must be 0 (none), 1 (stdout), "
                                 f"2 (stderr) or 3 (both)")
            return Std(int(value))

        if ":" not in text:
            return StdPolicy(default=one(text))
        pairs = []
        for item in text.split(","):
            rank, _, value = item.partition(":")
            if not rank.strip().isdigit():
                raise ValueError(f"spmdrun: {flag} {text!r}: expected LOCAL_RANK:FLAG pairs like 0:3,1:0")
            pairs.append((int(rank), one(value)))
        return StdPolicy(per_rank=tuple(pairs))


@dataclasses.dataclass(frozen=True)
class RendezvousTimeouts:
    """The timing knobs of the rendezvous (`--rdzv-conf key=value,...`)."""

    join_timeout: float = 600.0  # seconds to wait for MIN nodes (and for the store host) before giving up
    last_call_timeout: float = 3.0  # once MIN nodes joined, wait this long for more (up to MAX) before starting
    heartbeat_interval: float = 1.0  # seconds between an agent's heartbeats
    heartbeat_timeout: float = 10.0  # an agent silent this long is declared dead and the group re-forms
    close_timeout: float = 30.0  # the store host waits this long for other agents to see the end of the job

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"spmdrun: --rdzv-conf {field.name} must be positive, got "
                                 f"{getattr(self, field.name)}")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ValueError(f"spmdrun: --rdzv-conf heartbeat_timeout ({self.heartbeat_timeout}s) must exceed twice "
                             f"heartbeat_interval ({self.heartbeat_interval}s), or busy agents look dead")

    @staticmethod
    def parse(text: str) -> RendezvousTimeouts:
        """'join_timeout=60,last_call_timeout=1' -> RendezvousTimeouts (unknown keys are an error)."""
        known = {field.name for field in dataclasses.fields(RendezvousTimeouts)}
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in known:
                raise ValueError(f"spmdrun: --rdzv-conf item {item!r}: expected key=seconds with key one of "
                                 f"{sorted(known)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"spmdrun: --rdzv-conf {key}={value!r} is not a number of seconds") from None
        return RendezvousTimeouts(**values)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One agent's launch: what to run, how many workers, and how nodes find each other."""

    entrypoint: str  # script path, module name (MODULE), program (BINARY) or the pickled call's file (CALLABLE)
    args: tuple[str, ...] = ()  # passed through to the entry point untouched
    kind: EntryKind = EntryKind.SCRIPT
    nproc_per_node: int = 1  # workers this agent runs
    min_nodes: int = 1  # the job starts once this many nodes joined
    max_nodes: int = 1  # and takes at most this many; MIN < MAX makes the job elastic
    node_rank: int | None = None  # fixed node rank (static rendezvous); None lets join order decide
    rdzv_host: str | None = None  # the rendezvous store's host; None: a single-node job with an in-process store
    rdzv_port: int = DEFAULT_RDZV_PORT  # its port (0 on the host picks a free one)
    rdzv_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])  # job id shared by all nodes
    rdzv_token: str | None = dataclasses.field(default=None, repr=False)  # the rendezvous store's secret (None:
    # generated when one node hosts the whole job, else none: anyone who reaches the endpoint can join)
    max_restarts: int = 0  # worker-group restarts after a failure before the job fails
    monitor_interval: float = 0.1  # seconds between checks of the workers and the rendezvous
    redirects: StdPolicy = StdPolicy()  # streams that go to the rank's log file only
    tee: StdPolicy = StdPolicy()  # streams that go to the log file and the console
    log_dir: str | None = None  # per-rank log files under <log_dir>/<rdzv_id>/attempt_<k>/<local_rank>/
    local_ranks_filter: frozenset[int] | None = None  # local ranks whose output reaches the console (None: all)
    local_addr: str | None = None  # the address other nodes reach this one at (None: found from the route)
    master_addr: str | None = None  # fixed worker-store address (None: the address of the node with rank 0)
    master_port: int | None = None  # fixed worker-store port (None: a free port chosen per round)
    shutdown_grace: float = 5.0  # seconds between SIGTERM and SIGKILL when stopping workers
    timeouts: RendezvousTimeouts = RendezvousTimeouts()
    python: str = "python"  # interpreter for SCRIPT and MODULE workers
    omp_num_threads: int | None = None  # OMP_NUM_THREADS to give workers when the user left it unset
    local_rank_arg: bool = False  # pass --local-rank=<local rank> before the args (torch's legacy launcher's way)

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ValueError("spmdrun: missing the training script (or -m module / --no-python program)")
        if self.nproc_per_node < 1:
            raise ValueError(f"spmdrun: --nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"spmdrun: --nnodes {self.min_nodes}:{self.max_nodes} needs 1 <= MIN <= MAX")
        if self.node_rank is not None:
            if self.min_nodes != self.max_nodes:
                raise ValueError("spmdrun: --node-rank fixes the node set; it can't be combined with an elastic "
                                 f"--nnodes {self.min_nodes}:{self.max_nodes}")
            if not 0 <= self.node_rank < self.max_nodes:
                raise ValueError(f"spmdrun: --node-rank {self.node_rank} is out of range for --nnodes "
                                 f"{self.max_nodes} (expected 0..{self.max_nodes - 1})")
        if self.max_nodes > 1 and self.rdzv_host is None:
            raise ValueError(f"spmdrun: --nnodes {self.min_nodes}:{self.max_nodes} spans nodes, so every node "
                             "needs --rdzv-endpoint HOST:PORT of the same rendezvous (node 0's address)")
        for name in ("rdzv_port", "master_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"spmdrun: {name.replace('_', '-')} {port} is not a TCP port (0-65535)")
        if self.rdzv_token is not None and not self.rdzv_token.strip():
            raise ValueError("spmdrun: the rendezvous token is empty; give a non-empty --rdzv-token, "
                             "SPMD_STORE_TOKEN or --rdzv-token-file")
        if self.max_restarts < 0:
            raise ValueError(f"spmdrun: --max-restarts must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= 0 or self.shutdown_grace < 0:
            raise ValueError("spmdrun: --monitor-interval must be positive and the shutdown grace non-negative")

    @property
    def is_multinode(self) -> bool:
        """Whether agents meet over a TCP rendezvous store (else one agent with an in-process store)."""
        return self.rdzv_host is not None

    @property
    def is_elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

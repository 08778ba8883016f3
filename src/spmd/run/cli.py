"""The `spmdrun` command line: argv -> LaunchConfig, then one agent runs it.

Layer: run. `launch_config` has no side effects beyond reading the environment it is given (Slurm's variables,
SPMD_STORE_TOKEN) and a --rdzv-token-file, so it is tested directly; `main` is the console script (`spmdrun`,
`python -m spmd.run`). Flags follow torchrun's names (both `--nproc-per-node` and `--nproc_per_node` spellings);
everything after the script is passed to it untouched.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence

from spmd.run import slurm
from spmd.run.config import DEFAULT_RDZV_PORT, EntryKind, LaunchConfig, RendezvousTimeouts, StdPolicy


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    """Add `--some-flag` with its torchrun underscore spelling `--some_flag` as an alias."""
    names = [name] if "-" not in name[2:] else [name, "--" + name[2:].replace("-", "_")]
    parser.add_argument(*names, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spmdrun",
        description="Launch a distributed spmd (or torch.distributed-style) training script: one agent per node "
                    "starts --nproc-per-node workers with RANK, WORLD_SIZE, MASTER_ADDR, ... set, prefixes their "
                    "output with the rank, restarts them on failure and reports the root cause's traceback.",
        epilog="A running job answers SIGUSR1 to spmdrun (kill -USR1 PID) with what every rank is doing: each "
               "group's current or last collective and where the rank's thread is.")
    _flag(parser, "--standalone", action="store_true",
          help="single-node job with a private rendezvous (no endpoint needed; free ports are picked)")
    _flag(parser, "--nproc-per-node", default="1", help="workers per node: a number, 'auto', 'cpu' or 'gpu'")
    _flag(parser, "--nnodes", default=None, help="number of nodes N, or MIN:MAX for an elastic job (default 1)")
    _flag(parser, "--node-rank", type=int, default=None, help="this node's rank (fixed node set only)")
    _flag(parser, "--rdzv-endpoint", default=None, help=f"HOST[:PORT] of the rendezvous (default port "
          f"{DEFAULT_RDZV_PORT}); the node that owns HOST hosts it")
    _flag(parser, "--rdzv-id", default=None, help="job id shared by every node of the job")
    _flag(parser, "--rdzv-token", default=None, help="secret every agent of the job presents to the rendezvous "
          "store (default: $SPMD_STORE_TOKEN, else --rdzv-token-file; a one-node job makes its own)")
    _flag(parser, "--rdzv-token-file", default=None, help="file holding the rendezvous token; only its owner "
          "may read it (chmod 600)")
    _flag(parser, "--rdzv-backend", default="c10d", choices=["c10d", "static"],
          help="accepted for torchrun compatibility; spmd has one rendezvous, which does both")
    _flag(parser, "--rdzv-conf", default="", help="timeouts in seconds: join_timeout, last_call_timeout, "
          "heartbeat_interval, heartbeat_timeout, close_timeout (e.g. join_timeout=60,last_call_timeout=1)")
    _flag(parser, "--max-restarts", type=int, default=0, help="restarts of the worker group before failing")
    _flag(parser, "--monitor-interval", type=float, default=0.1, help="seconds between worker health checks")
    _flag(parser, "--shutdown-timeout", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL on stop")
    parser.add_argument("-r", "--redirects", default="0", help="streams sent to per-rank log files only: 0 none, "
          "1 stdout, 2 stderr, 3 both, or per local rank like 0:3,1:0")
    parser.add_argument("-t", "--tee", default="0", help="streams copied to per-rank log files and the console")
    _flag(parser, "--log-dir", default=None, help="directory for per-rank logs and error files")
    _flag(parser, "--local-ranks-filter", default=None, help="comma-separated local ranks whose output is shown")
    _flag(parser, "--local-addr", default=None,
          help="address other nodes reach this node and its workers at (default: SPMD_SOCKET_ADDR, the address "
          "of SPMD_SOCKET_IFNAME, or the local address of the route to the rendezvous endpoint)")
    _flag(parser, "--master-addr", default=None, help="fixed MASTER_ADDR for workers (default: node 0's address)")
    _flag(parser, "--master-port", type=int, default=None, help="fixed MASTER_PORT (default: a free port)")
    parser.add_argument("-m", "--module", action="store_true", help="run the entry point as `python -m module`")
    _flag(parser, "--no-python", action="store_true", help="run the entry point as a program, not with python")
    parser.add_argument("training_script", help="the script (or module / program) each worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments, untouched")
    return parser


def parse_nnodes(text: str) -> tuple[int, int]:
    """'4' -> (4, 4); '1:4' -> (1, 4)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ValueError(f"spmdrun: --nnodes {text!r} must be N or MIN:MAX") from None
    return bounds


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:1234' -> ('host', 1234); 'host' -> ('host', 29400); '[::1]:5' -> ('::1', 5)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"spmdrun: --rdzv-endpoint {text!r} has no host")
    if not port_text:
        return host, DEFAULT_RDZV_PORT
    if not port_text.isdigit():
        raise ValueError(f"spmdrun: --rdzv-endpoint {text!r}: port {port_text!r} is not a number")
    return host, int(port_text)


def resolve_nproc(text: str) -> int:
    """A number, or 'gpu'/'cpu'/'auto' (GPUs if there are any, else CPU cores)."""
    if text.isdigit():
        return int(text)
    if text not in ("auto", "cpu", "gpu"):
        raise ValueError(f"spmdrun: --nproc-per-node {text!r} must be a number, 'auto', 'cpu' or 'gpu'")
    if text in ("auto", "gpu"):
        import torch  # only here: counting GPUs needs it, and the plain launcher should start fast

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise ValueError("spmdrun: --nproc-per-node gpu, but torch sees no CUDA device")
    return os.cpu_count() or 1


def read_token_file(path: str) -> str:
    """The token in `path` (surrounding whitespace dropped); refused unless only its owner can read it."""
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            text = file.read().decode().strip()
    except OSError as error:
        raise ValueError(f"spmdrun: can't read --rdzv-token-file {path!r}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"spmdrun: --rdzv-token-file {path!r} is open to others (mode {stat.filemode(mode)}), so "
                         f"it is no secret; make it private with `chmod 600 {path}`")
    if not text:
        raise ValueError(f"spmdrun: --rdzv-token-file {path!r} is empty; write the job's token into it")
    return text


def rendezvous_token(flag: str | None, token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The job's rendezvous token: --rdzv-token, else $SPMD_STORE_TOKEN, else --rdzv-token-file, else None."""
    if flag is not None:
        return flag
    if environ.get("SPMD_STORE_TOKEN"):
        return environ["SPMD_STORE_TOKEN"]
    return read_token_file(token_file) if token_file is not None else None


def launch_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Turn `spmdrun` arguments into a LaunchConfig. Slurm's variables in `environ` fill in the node set when
    no rendezvous flag was given."""
    return config_from(build_parser().parse_args(list(argv)), environ)


def config_from(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The LaunchConfig of parsed `spmdrun` arguments (see launch_config)."""
    environ = os.environ if environ is None else environ
    kind = EntryKind.MODULE if ns.module else EntryKind.BINARY if ns.no_python else EntryKind.SCRIPT
    if ns.module and ns.no_python:
        raise ValueError("spmdrun: -m and --no-python exclude each other")
    nproc = resolve_nproc(ns.nproc_per_node)
    min_nodes, max_nodes = parse_nnodes(ns.nnodes) if ns.nnodes is not None else (1, 1)
    node_rank, rdzv_host, rdzv_port, rdzv_id = ns.node_rank, None, DEFAULT_RDZV_PORT, ns.rdzv_id
    if ns.standalone:
        if max_nodes > 1 or ns.rdzv_endpoint or (node_rank or 0) > 0:
            raise ValueError("spmdrun: --standalone runs one node; drop --nnodes/--node-rank/--rdzv-endpoint")
    elif ns.rdzv_endpoint is not None:
        rdzv_host, rdzv_port = parse_endpoint(ns.rdzv_endpoint)
    elif ns.nnodes is None and ns.node_rank is None and slurm.in_srun_step(environ):
        found = slurm.detect(environ)
        min_nodes = max_nodes = found.nnodes
        node_rank, rdzv_host, rdzv_port = found.node_rank, found.host, found.port
        rdzv_id = rdzv_id or found.job_id
    if rdzv_id is None and rdzv_host is not None:
        rdzv_id = "default"  # every node must name the same job; one store serves one job, so a constant does
    local_filter = None
    if ns.local_ranks_filter:
        try:
            local_filter = frozenset(int(item) for item in ns.local_ranks_filter.split(","))
        except ValueError:
            raise ValueError(f"spmdrun: --local-ranks-filter {ns.local_ranks_filter!r} must be like 0,2,3") from None
    extra = {"rdzv_id": rdzv_id} if rdzv_id else {}
    token = rendezvous_token(ns.rdzv_token, ns.rdzv_token_file, environ)
    return LaunchConfig(
        entrypoint=ns.training_script, args=tuple(ns.training_script_args), kind=kind, nproc_per_node=nproc,
        min_nodes=min_nodes, max_nodes=max_nodes, node_rank=node_rank, rdzv_host=rdzv_host, rdzv_port=rdzv_port,
        rdzv_token=token, max_restarts=ns.max_restarts, monitor_interval=ns.monitor_interval,
        redirects=StdPolicy.parse(ns.redirects, "--redirects"), tee=StdPolicy.parse(ns.tee, "--tee"),
        log_dir=ns.log_dir, local_ranks_filter=local_filter, local_addr=ns.local_addr,
        master_addr=ns.master_addr, master_port=ns.master_port, shutdown_grace=ns.shutdown_timeout,
        timeouts=RendezvousTimeouts.parse(ns.rdzv_conf), python=sys.executable,
        omp_num_threads=1 if nproc > 1 else None, **extra)


def check_entrypoint(config: LaunchConfig) -> None:
    """ValueError, before anything starts, if the training script to run does not exist."""
    if config.kind is EntryKind.SCRIPT and not os.path.isfile(config.entrypoint):
        raise ValueError(f"spmdrun: the training script {config.entrypoint!r} does not exist (working "
                         f"directory {os.getcwd()}); use -m for a module or --no-python for a program")


def main(argv: Sequence[str] | None = None,
         parse: Callable[[Sequence[str]], LaunchConfig] = launch_config) -> None:
    """The `spmdrun` console script: exits with the job's status (0 when every worker succeeded). `parse`
    reads the arguments (spmd.launch passes the legacy launcher's)."""
    from spmd.run.agent import Agent  # after parsing, so `spmdrun --help` and argument errors are instant

    try:
        config = parse(sys.argv[1:] if argv is None else argv)
        check_entrypoint(config)
    except ValueError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(Agent(config).run())

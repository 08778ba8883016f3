"""`python -m spmd.launch`: torch's legacy launcher (its `distributed.launch` module), which older scripts and
tutorials run with `--nproc_per_node=2 train.py`, as spmdrun with its two differences.

Layer: run (an alias at torch's module path). Without --use-env each worker gets `--local-rank=<local rank>`
after the script, as torch's passes it (the script's argparse reads `args.local_rank`); with --use-env it reads
LOCAL_RANK from the environment, as under spmdrun. A multi-node job without --rdzv-endpoint meets at
--master-addr:--master-port, torch's legacy rendezvous (the workers' own store then gets a free port). As torch's,
it is deprecated in favour of the launcher proper: prefer spmdrun.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

from spmd.run import cli
from spmd.run.config import LaunchConfig

__all__ = ["main", "parse_args"]

LEGACY_MASTER_PORT = 29500     # torch's legacy launcher's default --master-port


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """The legacy launcher's arguments (spmdrun's plus --use-env) as a LaunchConfig."""
    parser = cli.build_parser()
    parser.prog = "python -m spmd.launch"
    parser.add_argument("--use-env", "--use_env", action="store_true",
                        help="the script reads LOCAL_RANK from the environment; without it, it gets --local-rank")
    ns = parser.parse_args(list(argv))
    if ns.no_python and not ns.use_env:
        raise ValueError("spmd.launch: --no-python needs --use-env (a program can't be handed --local-rank)")
    nnodes = ns.nnodes or "1"
    if not ns.standalone and ns.rdzv_endpoint is None and ns.master_addr is not None and nnodes not in ("1", "1:1"):
        ns.rdzv_endpoint = f"{ns.master_addr}:{ns.master_port or LEGACY_MASTER_PORT}"
        ns.master_addr = ns.master_port = None
    return dataclasses.replace(cli.config_from(ns, environ), local_rank_arg=not ns.use_env)


def main(argv: Sequence[str] | None = None) -> None:
    """The launcher: exits with the job's status, after torch's deprecation warning."""
    warnings.warn("spmd.launch ports torch's legacy launcher and is deprecated as torch's is: use spmdrun "
                  "(python -m spmd.run); --use-env is its default, so read os.environ['LOCAL_RANK'] instead of "
                  "--local-rank", FutureWarning, stacklevel=2)
    cli.main(argv, parse=parse_args)


if __name__ == "__main__":
    main()

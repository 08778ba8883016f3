"""torchrun's module functions (its `run` module's), for programs that launch torchrun from Python, not a shell:
`main(["--standalone", "--nproc-per-node", "2", "train.py"])`, or `run(get_args_parser().parse_args(argv))` with
flags of their own added to the parser first. spmd serves them at `spmd.run` (torch's path after the swap).

Layer: run. They run spmdrun's agent in the calling process (call them from the main thread: the agent handles
SIGINT and SIGTERM) and, as torch's, return None once every worker of this node's part of the job succeeded and
raise ChildFailedError naming the root cause's rank, host and traceback otherwise; they never exit the process.
The parser reads torchrun's flags into torchrun's fields; a flag left out is None in spmd's (not given: Slurm's
variables may fill in the nodes) where torch's has a default such as nnodes "1:1". torch's `config_from_args` is
not served: its LaunchConfig is spmd.launcher's, a layer above this one, and `run` covers what callers use it for.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from spmd.run.cli import build_parser, check_entrypoint, config_from

__all__ = ["get_args_parser", "main", "parse_args", "run"]


def get_args_parser() -> argparse.ArgumentParser:
    """spmdrun's argument parser (torchrun's flags, both spellings), to parse with or to extend."""
    return build_parser()


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """The launch flags and the script's arguments parsed from `args` (None: sys.argv[1:])."""
    return get_args_parser().parse_args(None if args is None else list(args))


def run(args: argparse.Namespace) -> None:
    """Run this node's part of the job `args` describes (parsed by get_args_parser's parser); ChildFailedError if
    a worker failed (see the module's docstring), ValueError for flags that can't launch."""
    from spmd.run.agent import Agent  # here, as spmdrun imports it: parsing stays instant

    config = config_from(args)
    check_entrypoint(config)
    agent = Agent(config)
    agent.raise_if_failed(agent.run(), "spmd.run")


def main(args: Sequence[str] | None = None) -> None:
    """`run(parse_args(args))`: torchrun's command line as a function call."""
    run(parse_args(args))

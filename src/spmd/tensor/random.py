"""Parallelism-invariant random numbers for DTensor: every random op draws the numbers the one-process run
would draw for the GLOBAL tensor, and each rank keeps its piece.

Layer: tensor. How: the op fills a full-size tensor from the generator (the same one on every rank, in the
same state), and each rank keeps its shard. Every rank advances its generator by the same amount, so later
ops stay in step. It costs the full tensor's generation on every rank, which buys bit-identical results to
the one-process run on every mesh and placement (CPU generators can't skip ahead to a shard's offset).

The generator: `manual_seed(seed)` gives THIS rank (its context: one thread rank of the threads transport,
or one process) its own generator; without it, torch's default generator is used (seed it identically on
every rank with torch.manual_seed). Thread ranks share one process, so they must use manual_seed here.
"""

from __future__ import annotations

import contextvars

import torch

_generator: contextvars.ContextVar[torch.Generator | None] = contextvars.ContextVar("spmd_dtensor_rng",
                                                                                       default=None)


def manual_seed(seed: int) -> None:
    """Seed this rank's DTensor generator. Every rank must call it with the same seed (collective in spirit)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    _generator.set(generator)


def get_generator() -> torch.Generator | None:
    """This rank's DTensor generator, or None when random ops use torch's default generator."""
    return _generator.get()

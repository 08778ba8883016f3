"""Parallelism-invariant random numbers for DTensor: every random op draws the numbers the one-process run
would draw for the GLOBAL tensor, and each rank keeps its piece.

Layer: tensor. How: the op fills a full-size tensor from the generator (the same one on every rank, in the
same state), and each rank keeps its shard. Every rank advances its generator by the same amount, so later
ops stay in step. It costs the full tensor's generation on every rank, which buys bit-identical results to
the one-process run on every mesh and placement (CPU generators can't skip ahead to a shard's offset).

The generators: `manual_seed(seed)` gives THIS rank (its context: one thread rank of the threads transport,
or one process) its own generators, one per device, each made on first use and seeded with `seed`, so
ops draw on the device of the tensor they fill (a CUDA tensor from a CUDA generator) and the CPU numbers
are those of `torch.Generator().manual_seed(seed)`. Without it, torch's default generator of the device is
used (seed it identically on every rank with torch.manual_seed). Thread ranks share one process, so they
must use manual_seed here.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spmd.device_mesh import DeviceMesh


@dataclasses.dataclass
class _RankGenerators:
    """One rank's seed and the generators made from it so far, one per device."""

    seed: int
    by_device: dict[torch.device, torch.Generator] = dataclasses.field(default_factory=dict)


_generators: contextvars.ContextVar[_RankGenerators | None] = contextvars.ContextVar("spmd_dtensor_rng",
                                                                                     default=None)


def manual_seed(seed: int, device_mesh: DeviceMesh | None = None) -> None:
    """Seed this rank's DTensor generators. Every rank must call it with the same seed (collective in spirit).
    `device_mesh` (torch's signature) must contain this rank; the generators serve every mesh."""
    if device_mesh is not None and device_mesh.get_coordinate() is None:
        raise RuntimeError(f"manual_seed: rank {device_mesh.get_rank()} is not in {device_mesh}; seed on a mesh "
                           f"that contains it (as torch's)")
    _generators.set(_RankGenerators(seed))


def is_rng_supported_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether DTensor random ops on `device_mesh` draw parallelism-invariant numbers: always (torch's answers
    False for CPU meshes, whose ranks then draw from their own generators)."""
    return True


def get_generator(device: torch.device | str = "cpu") -> torch.Generator | None:
    """This rank's DTensor generator on `device`, or None when random ops use torch's default generator (no
    manual_seed on this rank) or the device draws no numbers (meta tensors hold no data)."""
    rank = _generators.get()
    device = torch.device(device)
    if rank is None or device.type == "meta":
        return None
    generator = rank.by_device.get(device)
    if generator is None:
        generator = rank.by_device[device] = torch.Generator(device=device)
        generator.manual_seed(rank.seed)
    return generator

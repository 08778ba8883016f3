"""DTensor inputs for tests that can tell a wrong sharding rule from a right one.

Layer: testing (imports anything; no library module imports it).

Note: Partial inputs made of real terms
`Partial.partition` (what `distribute_tensor` uses) puts the whole value on one rank and the identity of the
reduction (zeros for SUM) on the others. That is exact, and useless as a test input: for any f with f(0) = 0,
f(a) + f(0) = f(a), so a rule that wrongly keeps Partial through tanh, relu or abs still gives the right
full_tensor(). `make_dtensor` instead gives every rank a term of its own, drawn from a generator seeded by
the value and the layout (so every rank draws the same terms without communicating), such that reducing the
terms gives the value back:
  SUM      random terms, the last one the value minus the others
  AVG      the value plus random offsets that sum to zero
  PRODUCT  random factors of magnitude 0.5-1.5 (+-1 for integers), the last one the value over the others
  MAX/MIN  per element one random rank holds the value, the others a strictly smaller (larger) number
  BXOR     random bits, the last rank's term the value xor the others
  BAND/BOR per element one random rank holds the value, the others the value with bits added (removed)
For several Partial mesh dims the value is split along the first, and each rank's term along the next.
Floating terms are of the value's own magnitude, so f(a + b) and f(a) + f(b) differ visibly for any non-linear
f; their sum equals the value to rounding (a few ulps), which the rule tests' tolerances absorb.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.placement import Partial, Placement, Replicate, normalize_placements
from spmd.tensor.spec import DTensorSpec, contiguous_stride


def partial_terms(value: Tensor, reduce_op: str, group_size: int, generator: torch.Generator) -> list[Tensor]:
    """`group_size` terms whose reduction with `reduce_op` is `value` (see Note: Partial inputs made of real
    terms); the same terms for the same generator state."""
    if group_size == 1:
        return [value.clone()]
    if reduce_op in ("sum", "avg"):
        noise = [_noise(value, generator) for _ in range(group_size - 1)]
        rest = value - sum(noise, torch.zeros_like(value))
        return [*noise, rest] if reduce_op == "sum" else [value + n for n in noise] + [rest]
    if reduce_op == "product":
        signs = [torch.where(torch.rand(value.shape, generator=generator) < 0.5, -1, 1).to(value.dtype)
                 for _ in range(group_size - 1)]
        if value.dtype.is_floating_point:
            factors = [(0.5 + torch.rand(value.shape, generator=generator, dtype=value.dtype)) * sign
                       for sign in signs]
        else:
            factors = signs                                       # +-1: exact in integer arithmetic
        rest = torch.ones_like(value)
        for factor in factors:
            rest = rest * factor
        return [*factors, value / rest if value.dtype.is_floating_point else value * rest]
    if reduce_op == "bxor":
        bits = [torch.randint(0, 64, value.shape, generator=generator).to(value.dtype) for _ in range(group_size - 1)]
        last = value.clone()
        for b in bits:
            last = last ^ b
        return [*bits, last]
    owner = torch.randint(0, group_size, value.shape, generator=generator)
    return [torch.where(owner == rank, value, _dominated(value, reduce_op, generator)) for rank in range(group_size)]


def _noise(value: Tensor, generator: torch.Generator) -> Tensor:
    """A random term of the value's magnitude (small integers for integer dtypes)."""
    if not value.dtype.is_floating_point:
        return torch.randint(-5, 6, value.shape, generator=generator).to(value.dtype)
    scale = value.abs().mean().clamp_min(1.0) if value.numel() else torch.tensor(1.0)
    return (torch.randn(value.shape, generator=generator, dtype=torch.float64) * float(scale)).to(value.dtype)


def _dominated(value: Tensor, reduce_op: str, generator: torch.Generator) -> Tensor:
    """A term that loses to `value` under `reduce_op` everywhere, so the reduction gives the owner's value."""
    if reduce_op in ("max", "min"):
        if value.dtype is torch.bool:
            return torch.zeros_like(value) if reduce_op == "max" else torch.ones_like(value)
        gap = 0.5 + torch.rand(value.shape, generator=generator, dtype=torch.float64)
        gap = (gap if value.dtype.is_floating_point else gap.ceil()).to(value.dtype)
        if reduce_op == "max":
            lower = value - gap
            return torch.where(lower <= value, lower, value)     # an unsigned value at its minimum stays
        higher = value + gap
        return torch.where(higher >= value, higher, value)
    bits = torch.randint(0, 64, value.shape, generator=generator).to(value.dtype)
    if reduce_op == "band":
        return value | bits
    if reduce_op == "bor":
        return value & bits
    raise ValueError(f"partial_terms: unknown reduce_op {reduce_op!r}")


def _seed(full: Tensor, placements: Sequence[Placement], seed: int) -> int:
    data = full.detach().cpu().reshape(-1).clone()      # flat and dense: viewable as bytes (0-d too)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return zlib.crc32(raw + repr(tuple(placements)).encode() + str(seed).encode())


def make_dtensor(full: Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *,
                 requires_grad: bool = False, seed: int = 0) -> DTensor:
    """A leaf DTensor whose global value is `full` (identical on every rank) laid out as `placements`.

    No communication: each rank takes its piece, and a Partial placement gets a random term on every rank
    (see Note: Partial inputs made of real terms). `seed` varies the terms between calls with equal values.
    """
    placements = normalize_placements(tuple(placements), full.ndim, mesh.ndim, "make_dtensor")
    spec = DTensorSpec(mesh, placements, full.shape, contiguous_stride(full.shape), full.dtype)
    coordinate = mesh.get_coordinate()
    value = full.detach()
    if coordinate is not None and any(isinstance(p, Partial) for p in placements):
        base = _seed(value, placements, seed)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Partial):
                # seeded by the coordinates above this dim too, so the ranks that split different terms
                # along this dim draw different noise (no two ranks hold the same term)
                generator = torch.Generator().manual_seed(base ^ zlib.crc32(repr(list(coordinate[:mesh_dim])).encode()))
                terms = partial_terms(value, placement.reduce_op, mesh.size(mesh_dim), generator)
                value = terms[coordinate[mesh_dim]]
    sharded_only = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    shard_spec = DTensorSpec(mesh, sharded_only, full.shape, contiguous_stride(full.shape), full.dtype)
    return DTensor(shard_spec.local_from_full(value), spec, requires_grad=requires_grad)

"""Placements: how one mesh dimension lays out a tensor (Shard, Replicate, Partial).

Layer: tensor. Pure data and local index arithmetic; nothing here communicates.

A DTensor has one placement per mesh dimension:
- `Shard(dim)`: the ranks along that mesh dim each hold one `torch.chunk` piece of tensor dim `dim`. Chunks
  are `ceil(size / n)` long, the last ones may be shorter, and trailing ranks may hold empty pieces
  (5 rows over 4 ranks -> 2, 2, 1, 0).
- `Replicate()`: every rank along that mesh dim holds the same full value.
- `Partial(reduce_op)`: every rank holds a partial value; the logical value is `reduce_op` over the ranks.
Placements are frozen and hashable: they are part of the cache keys of op dispatch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from spmd.comm.reduce_op import ReduceOp

_REDUCE_OPS: dict[str, ReduceOp] = {
    "sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT, "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR,
}


class Placement:
    """Base class of the three placements; use isinstance or the is_* helpers to tell them apart."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim `dim` is split over the mesh dim with torch.chunk semantics."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the full value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclasses.dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a partial value; the logical value is `reduce_op` ("sum", "avg", "max", ...) over ranks."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if isinstance(self.reduce_op, ReduceOp):
            object.__setattr__(self, "reduce_op", self.reduce_op.value)
        if self.reduce_op not in _REDUCE_OPS:
            raise ValueError(f"Partial(reduce_op={self.reduce_op!r}): choose one of {sorted(_REDUCE_OPS)}")

    def is_partial(self) -> bool:
        return True

    @property
    def comm_op(self) -> ReduceOp:
        """The ReduceOp that turns the partial values into the logical value."""
        return _REDUCE_OPS[self.reduce_op]

    @property
    def is_linear(self) -> bool:
        """Whether the logical value distributes over addition and scaling (sum and avg do)."""
        return self.reduce_op in ("sum", "avg")

    def partition(self, value: Tensor, group_size: int, group_rank: int) -> Tensor:
        """This rank's partial value of a replicated `value`, so that reducing over ranks gives `value` back.

        Exact for every op and dtype: sum/bxor keep the value on group rank 0 and zeros elsewhere, product keeps
        it on rank 0 and ones elsewhere, and avg/max/min/band/bor keep it everywhere.
        """
        if group_size == 1 or self.reduce_op in ("avg", "max", "min", "band", "bor"):
            return value.clone()
        if group_rank == 0:
            return value.clone()
        if self.reduce_op == "product":
            return torch.ones_like(value)
        return torch.zeros_like(value)

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op!r})" if self.reduce_op != "sum" else "Partial()"


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` when `size` elements are split into `num_chunks` torch.chunk pieces."""
    if num_chunks <= 1:
        return 0, size
    chunk = -(-size // num_chunks)
    start = min(chunk * index, size)
    return start, min(size, start + chunk) - start


def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """The length of every torch.chunk piece, padded with zeros to `num_chunks` entries."""
    return [chunk_range(size, num_chunks, index)[1] for index in range(num_chunks)]


def normalize_placements(placements: object, ndim: int, mesh_ndim: int, what: str) -> tuple[Placement, ...]:
    """Check `placements` against a tensor of `ndim` dims on a mesh of `mesh_ndim` dims; normalize Shard dims.

    Raises ValueError naming `what` (the calling API) when the count or a shard dim is wrong.
    """
    if isinstance(placements, Placement) or not isinstance(placements, (list, tuple)):
        raise TypeError(f"{what}: placements must be a list or tuple of Placement (one per mesh dim), "
                        f"got {placements!r}")
    if len(placements) != mesh_ndim:
        raise ValueError(f"{what}: got {len(placements)} placements {list(placements)} for a {mesh_ndim}-d mesh; "
                         f"give exactly one placement per mesh dim")
    out: list[Placement] = []
    for placement in placements:
        if not isinstance(placement, Placement):
            raise TypeError(f"{what}: {placement!r} is not a Placement (use Shard(dim), Replicate() or Partial())")
        if isinstance(placement, Shard):
            dim = placement.dim + ndim if placement.dim < 0 else placement.dim
            if not 0 <= dim < ndim:
                raise ValueError(f"{what}: {placement} is out of range for a tensor with {ndim} dims")
            placement = Shard(dim)
        out.append(placement)
    partial_ops = {p.reduce_op for p in out if isinstance(p, Partial)}
    if len(partial_ops) > 1:
        raise ValueError(f"{what}: placements {out} mix Partial reduce ops {sorted(partial_ops)}; use one")
    return tuple(out)

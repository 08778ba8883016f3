"""Placements: how one mesh dimension lays out a tensor (Shard, Replicate, Partial, and _StridedShard).

Layer: tensor. Pure data and local index arithmetic; nothing here communicates.

A DTensor has one placement per mesh dimension:
- `Shard(dim)`: the ranks along that mesh dim each hold one `torch.chunk` piece of tensor dim `dim`. Chunks
  are `ceil(size / n)` long, the last ones may be shorter, and trailing ranks may hold empty pieces
  (5 rows over 4 ranks -> 2, 2, 1, 0).
- `Replicate()`: every rank along that mesh dim holds the same full value.
- `Partial(reduce_op)`: every rank holds a partial value; the logical value is `reduce_op` over the ranks.
- `_StridedShard(dim, split_factor=k)`: a Shard that splits tensor dim `dim` AFTER the later mesh dims that
  shard it (see Note: strided sharding). Only FSDP over tensor parallelism makes it.
Placements are frozen and hashable: they are part of the cache keys of op dispatch.

Note: strided sharding
Several mesh dims sharding one tensor dim split it in ascending mesh-dim order (see Note: nested sharding order
in spec.py). FSDP over tensor parallelism splits in the other order: tensor parallelism chunked a weight's rows
over the tp mesh dim first, then FSDP chunks each tp rank's rows over the dp mesh dim, which comes first in a
(dp, tp) mesh. `(_StridedShard(0, split_factor=2), Shard(0))` on a (2, 2) (dp, tp) mesh says exactly that: rank
(d, t) holds torch.chunk(torch.chunk(rows, 2)[t], 2)[d], still one contiguous block of rows (rows 0-1, 4-5, 2-3,
6-7 of 8 on ranks 0..3, where (Shard(0), Shard(0)) gives 0-1, 2-3, 4-5, 6-7). `split_factor` is how many
pieces the later mesh dims cut the dim into before this one splits (the product of their sizes); it is checked
against the mesh. Torch's `_StridedShard` has the same name and meaning, and gives the same blocks whenever the
dim's size divides by split_factor (with other sizes torch's blocks are not the nested chunks FSDP holds).
Supported, and checked on use: one _StridedShard per tensor dim, no earlier mesh dim sharding that dim, and at
least one later plain Shard of it. Every spec function and the redistribution planner handle it; so do the
ops whose operands and outputs are all laid out alike (pointwise, foreach, *_like, detach) and whole-tensor
norms; rules that build plain Shards have it redistributed first (exact); dispatch refuses (never mislabels) any
other op that would keep it (see Note: ops on strided shards in dispatch/decision.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor
from torch._library.opaque_object import MemberType, register_opaque_type

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

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        """How a compiled graph's code rebuilds this placement (its repr calls its class)."""
        return repr(self), {type(self).__name__: type(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim `dim` is split over the mesh dim with torch.chunk semantics."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def with_dim(self, dim: int) -> Shard:
        """The same kind of shard (a _StridedShard keeps its split factor) of tensor dim `dim`."""
        return dataclasses.replace(self, dim=dim)

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclasses.dataclass(frozen=True, slots=True)
class _StridedShard(Shard):
    """Tensor dim `dim` split over the mesh dim after the later mesh dims sharding it cut it into `split_factor`
    pieces: each rank holds a torch.chunk of its piece (see Note: strided sharding). Torch's name and meaning."""

    split_factor: int = dataclasses.field(kw_only=True)

    def __post_init__(self) -> None:
        Shard.__post_init__(self)
        if not isinstance(self.split_factor, int) or isinstance(self.split_factor, bool) or self.split_factor < 1:
            raise TypeError(f"_StridedShard: split_factor must be a positive int, got {self.split_factor!r}")

    def __repr__(self) -> str:
        return f"_StridedShard({self.dim}, split_factor={self.split_factor})"


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


# torch.compile holds placements as constants of its graphs (as torch registers its own): values compared with
# __eq__, their queries answered at compile time (spmd.tensor.api, Note: DTensors under torch.compile).
_QUERIES = {"is_shard": MemberType.USE_REAL, "is_replicate": MemberType.USE_REAL, "is_partial": MemberType.USE_REAL,
            "__eq__": MemberType.USE_REAL, "__hash__": MemberType.USE_REAL}
register_opaque_type(Shard, typ="value", members={**_QUERIES, "dim": MemberType.USE_REAL,
                                                  "with_dim": MemberType.USE_REAL})
register_opaque_type(_StridedShard, typ="value", members={**_QUERIES, "dim": MemberType.USE_REAL,
                                                          "with_dim": MemberType.USE_REAL,
                                                          "split_factor": MemberType.USE_REAL})
register_opaque_type(Replicate, typ="value", members=_QUERIES)
register_opaque_type(Partial, typ="value", members={**_QUERIES, "reduce_op": MemberType.USE_REAL,
                                                    "comm_op": MemberType.USE_REAL,
                                                    "is_linear": MemberType.USE_REAL})


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
            placement = placement.with_dim(dim) if dim != placement.dim else placement
        out.append(placement)
    partial_ops = {p.reduce_op for p in out if isinstance(p, Partial)}
    if len(partial_ops) > 1:
        raise ValueError(f"{what}: placements {out} mix Partial reduce ops {sorted(partial_ops)}; use one")
    check_strided(tuple(out), None, what)
    return tuple(out)


def check_strided(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...] | None, what: str) -> None:
    """Raise ValueError naming `what` unless every _StridedShard in `placements` is one this library supports
    (see Note: strided sharding); with `mesh_shape`, also that its split_factor is the product of the sizes of
    the later mesh dims sharding its tensor dim."""
    for i, placement in enumerate(placements):
        if not isinstance(placement, _StridedShard):
            continue
        dim = placement.dim
        earlier = [j for j in range(i) if isinstance(placements[j], Shard) and placements[j].dim == dim]
        later = [j for j in range(i + 1, len(placements))
                 if isinstance(placements[j], Shard) and placements[j].dim == dim]
        problem = None
        if earlier:
            problem = f"mesh dim {earlier[0]} shards tensor dim {dim} before it"
        elif not later:
            problem = f"no later mesh dim shards tensor dim {dim} (use Shard({dim}))"
        elif any(isinstance(placements[j], _StridedShard) for j in later):
            problem = f"another _StridedShard of tensor dim {dim} follows it"
        elif mesh_shape is not None and math.prod(mesh_shape[j] for j in later) != placement.split_factor:
            problem = (f"the later mesh dims {later} sharding tensor dim {dim} split it into "
                       f"{math.prod(mesh_shape[j] for j in later)} pieces, not split_factor="
                       f"{placement.split_factor}")
        if problem is not None:
            raise ValueError(f"{what}: {placement} on mesh dim {i} of {list(placements)} is not supported: "
                             f"{problem}; a _StridedShard must be the first of the mesh dims sharding its "
                             f"tensor dim, followed by plain Shards of it whose sizes multiply to its "
                             f"split_factor")

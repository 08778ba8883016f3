"""DTensorSpec: the mesh, one placement per mesh dim, and the GLOBAL shape, stride and dtype of a DTensor.

Layer: tensor. Pure metadata and shard arithmetic; nothing here communicates.

Note: nested sharding order
When several mesh dims shard the same tensor dim (e.g. placements (Shard(0), Shard(0)) on a (2, 2) mesh), the
mesh dims split it in ascending order: mesh dim 0 takes a torch.chunk of the global extent, mesh dim 1 takes a
torch.chunk of that chunk. A _StridedShard is the exception: it splits after the later mesh dims sharding its
dim (see Note: strided sharding in placement.py). `split_order` gives the order; every function here and the
redistribution planner follow it. Either way a rank's piece is one contiguous block of each tensor dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard, check_strided, chunk_range

if TYPE_CHECKING:
    from spmd.device_mesh import DeviceMesh

Placements = tuple[Placement, ...]


class TensorMeta(NamedTuple):
    """A DTensor's global shape, stride and dtype, as torch's DTensorSpec takes and gives them."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class DTensorSpec:
    """How a DTensor is laid out: `mesh`, `placements` (one per mesh dim), and global `shape`/`stride`/`dtype`.

    Immutable and hashable (the hash is computed once): specs are the keys of the dispatch and redistribution
    caches. Placements must already be normalized (non-negative shard dims); see placement.normalize_placements.
    """

    __slots__ = ("_hash", "_local_shape", "_relaid", "dtype", "mesh", "placements", "shape", "stride")

    def __init__(self, mesh: DeviceMesh, placements: Placements,
                 shape: torch.Size | tuple[int, ...] | TensorMeta | None = None,
                 stride: tuple[int, ...] | None = None, dtype: torch.dtype | None = None, *,
                 tensor_meta: TensorMeta | None = None) -> None:
        if tensor_meta is not None or isinstance(shape, TensorMeta):   # torch's signature: (mesh, placements, meta)
            shape, stride, dtype = tensor_meta if tensor_meta is not None else shape
        if shape is None or stride is None or dtype is None:
            raise TypeError("DTensorSpec needs the global tensor's shape, stride and dtype (or torch's tensor_meta=)")
        self.mesh = mesh
        self.placements = tuple(placements)
        self.shape = torch.Size(shape)
        self.stride = tuple(stride)
        self.dtype = dtype
        try:
            self._hash: int | None = hash((mesh, self.placements, self.shape, self.stride, dtype))
        except TypeError:    # a symbolic shape (compiled with dynamic shapes): no cache may keep this spec
            self._hash = None
        self._local_shape: torch.Size | None = None
        self._relaid: dict[Placements, DTensorSpec] | None = None     # with_placements' results

    def __hash__(self) -> int:
        if self._hash is None:
            raise TypeError(f"unhashable DTensorSpec: its shape {tuple(self.shape)} is symbolic")
        return self._hash

    def __reduce__(self) -> tuple:
        """Pickled as its fields: the hash and the caches are this process's."""
        return DTensorSpec, (self.mesh, self.placements, tuple(self.shape), self.stride, self.dtype)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (isinstance(other, DTensorSpec) and self._hash == other._hash and self.placements == other.placements
                and self.shape == other.shape and self.stride == other.stride and self.dtype == other.dtype
                and self.mesh == other.mesh)

    def __repr__(self) -> str:
        return (f"DTensorSpec(placements={list(self.placements)}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, mesh={self.mesh})")

    # -- views of the metadata ------------------------------------------------------------------------------

    @property
    def symbolic(self) -> bool:
        """Whether the shape or stride holds symbols (traced with dynamic shapes): then no cache may keep it."""
        return self._hash is None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def tensor_meta(self) -> TensorMeta:
        """The global shape, stride and dtype, as torch's spec holds them."""
        return TensorMeta(self.shape, self.stride, self.dtype)

    @property
    def num_shards_map(self) -> list[int]:
        """Per tensor dim, how many pieces it is split into across the mesh (torch's name)."""
        return [self.num_shards(dim) for dim in range(self.ndim)]

    def with_placements(self, placements: Placements) -> DTensorSpec:
        """The same tensor laid out with other placements. Memoized (specs are immutable): a conversion repeated
        every step (redistribute, a gradient's layout) yields the same spec object, whose dispatch-cache key
        then compares by identity."""
        relaid = self._relaid
        if relaid is None:
            relaid = self._relaid = {}
        spec = relaid.get(placements)
        if spec is None:
            spec = relaid[placements] = DTensorSpec(self.mesh, placements, self.shape, self.stride, self.dtype)
        return spec

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def split_order(self) -> tuple[int, ...]:
        """Every mesh dim, in the order the mesh dims split their tensor dims (see Note: nested sharding order)."""
        return split_order(self.placements, tuple(self.mesh.shape))

    def shard_mesh_dims(self, dim: int) -> list[int]:
        """The mesh dims that shard tensor dim `dim`, in the order they split it (see Note: nested sharding order)."""
        placements = self.placements
        return [i for i in self.split_order() if isinstance(placements[i], Shard) and placements[i].dim == dim]

    def num_shards(self, dim: int) -> int:
        """How many pieces tensor dim `dim` is split into across the whole mesh."""
        count = 1
        for i in self.shard_mesh_dims(dim):
            count *= self.mesh.size(i)
        return count

    def local_numel_estimate(self) -> int:
        """Global numel divided by the number of shards: the per-rank element count used by cost models. Of a
        symbolic shape, from its sizes' hints, with no guard: a cost only picks among correct strategies, and a
        guard on it would recompile the graph at every size where the pick would change."""
        numel = math.prod(self.shape if self._hash is not None else _size_hints(self.shape))
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard):
                numel //= self.mesh.size(i)
        return numel

    # -- shard arithmetic -----------------------------------------------------------------------------------

    def local_shape(self) -> torch.Size:
        """The shape of this rank's local tensor (cached: a spec's mesh belongs to one rank)."""
        if self._local_shape is None:
            self._local_shape = self.local_shape_and_offset(self.mesh.get_coordinate())[0]
        return self._local_shape

    def local_shape_and_offset(self, coordinate: Sequence[int] | None) -> tuple[torch.Size, tuple[int, ...]]:
        """(local shape, global offset of the local block) at mesh `coordinate` (None: a rank outside the mesh).

        Walks mesh dims in split order, each Shard splitting the current extent of its tensor dim with torch.chunk.
        """
        shape = list(self.shape)
        offset = [0] * len(shape)
        if coordinate is None:
            return torch.Size([0] * len(shape)), tuple(offset)
        for mesh_dim in self.split_order():
            placement = self.placements[mesh_dim]
            if isinstance(placement, Shard):
                start, length = chunk_range(shape[placement.dim], self.mesh.size(mesh_dim), coordinate[mesh_dim])
                shape[placement.dim] = length
                offset[placement.dim] += start
        return torch.Size(shape), tuple(offset)

    def extent_at(self, mesh_dim: int, dim: int, coordinate: Sequence[int]) -> int:
        """The extent of tensor dim `dim` that mesh dim `mesh_dim` splits (after the mesh dims that split it first)."""
        extent = self.shape[dim]
        for i in self.split_order():
            if i == mesh_dim:
                break
            placement = self.placements[i]
            if isinstance(placement, Shard) and placement.dim == dim:
                extent = chunk_range(extent, self.mesh.size(i), coordinate[i])[1]
        return extent

    def local_from_full(self, full: Tensor) -> Tensor:
        """This rank's local tensor of the global value `full` (identical on every rank): chunks for Shard,
        the whole for Replicate, Partial.partition for Partial. Returns a tensor that does not alias `full`."""
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return full.new_empty(self.local_shape())
        local = full
        for mesh_dim in self.split_order():
            placement = self.placements[mesh_dim]
            if isinstance(placement, Shard):
                start, length = chunk_range(local.shape[placement.dim], self.mesh.size(mesh_dim),
                                            coordinate[mesh_dim])
                local = local.narrow(placement.dim, start, length)
        local = local.clone(memory_format=torch.contiguous_format)
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Partial):   # several Partial dims: partition each in turn
                local = placement.partition(local, self.mesh.size(mesh_dim), coordinate[mesh_dim])
        return local


def _size_hints(shape: torch.Size) -> list[int]:
    """The concrete sizes a symbolic shape was traced with, read without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint  # only while tracing dynamic shapes

    return [optimization_hint(size, fallback=1) for size in shape]


@functools.lru_cache(maxsize=1024)
def split_order(placements: Placements, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh dims in the order they split their tensor dims: ascending, except that each _StridedShard comes
    right after the last later mesh dim sharding its tensor dim (see Note: nested sharding order). Raises
    ValueError for a _StridedShard this library does not support (placement.check_strided)."""
    if not any(isinstance(p, _StridedShard) for p in placements):
        return tuple(range(len(placements)))
    check_strided(placements, mesh_shape, "DTensorSpec")
    order: list[int] = []
    after: dict[int, list[int]] = {}
    for i, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            last = max(j for j in range(i + 1, len(placements))
                       if isinstance(placements[j], Shard) and placements[j].dim == placement.dim)
            after.setdefault(last, []).append(i)
            continue
        order.append(i)
        order.extend(after.pop(i, ()))
    return tuple(order)


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of `shape`."""
    stride: list[int] = []
    acc = 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def stride_like(local: Tensor, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of a dense tensor of `shape` whose dims lie in memory in the order of `local`'s: the global
    strides of a DTensor whose piece on this rank is `local` (row-major when `local` is contiguous). None when
    `local` is not dense (an expanded tensor, a strided slice): no order of dims describes it."""
    if local.is_contiguous():
        return contiguous_stride(shape)
    sizes, strides = local.shape, local.stride()
    order = sorted(range(local.ndim), key=lambda dim: -strides[dim])     # outermost first; ties keep dim order
    if any(strides[dim] != expected and sizes[dim] > 1
           for dim, expected in zip(order, _dense_strides(sizes, order), strict=True)):
        return None
    return tuple(stride for _, stride in sorted(zip(order, _dense_strides(shape, order), strict=True)))


def _dense_strides(shape: torch.Size | tuple[int, ...], order: list[int]) -> list[int]:
    """The strides of the dims in `order` (outermost first) of a dense tensor of `shape` laid out in that order."""
    strides, acc = [], 1
    for dim in reversed(order):
        strides.append(acc)
        acc *= max(shape[dim], 1)
    return strides[::-1]

"""Redistribution: plan (pure: spec -> placements -> steps) and run (issue the collectives on local tensors).

Layer: tensor. `plan_redistribute` never communicates and is cached; `run_plan` is collective over the mesh.

One step changes the placement of one mesh dim and uses that dim's group:

    from -> to          action
    Shard(d) -> Rep     all-gather along d (uneven torch.chunk pieces padded to the largest, then trimmed)
    Shard(a) -> Shard(b) all-to-all (split b, concatenate a)
    Rep -> Shard(d)     local chunk, no communication
    Partial -> Rep      all-reduce with the Partial's op
    Partial -> Shard(d) reduce-scatter along d
    Rep -> Partial      local Partial.partition, no communication
    Shard -> Partial, Partial(a) -> Partial(b): through Replicate (two steps)

Note: planning order on N-d meshes
The local tensor of a nested sharding (see Note: nested sharding order in spec.py) is a chunk of a chunk, so a
mesh dim's Shard(d) can only be gathered once every mesh dim splitting d AFTER it is gathered, and a Shard whose
meaning changes (the mesh dims splitting d before it differ between source and target, e.g. (S0, S0) -> (R, S0))
must be gathered and re-chunked. Phase 1 walks the source's mesh dims in reverse split order (last to first,
a _StridedShard before the later Shards it follows) and unshards every Shard that doesn't stay (by all-to-all
straight into its target Shard when no other mesh dim shards either tensor dim and neither is strided, else by
all-gather). Phase 2 walks the target's mesh dims in split order and moves every dim to its target; by then
every Shard it creates is the last to split its dim so far, which is what the target means. So
(R, S0) -> (_StridedShard(0, split_factor=n), S0) is a local chunk: each rank keeps its chunk of its tp piece.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from torch import Tensor

from spmd.comm.functional import all_gathered, all_reduced, all_to_all_dims, reduce_scattered
from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard, chunk_range, chunk_sizes
from spmd.tensor.spec import DTensorSpec, Placements, split_order


@dataclasses.dataclass(frozen=True)
class Step:
    """Change mesh dim `mesh_dim` from `source` to `target` (one collective at most)."""

    mesh_dim: int
    source: Placement
    target: Placement

    def __repr__(self) -> str:
        return f"mesh dim {self.mesh_dim}: {self.source} -> {self.target}"


def _prefix(placements: list[Placement] | Placements, mesh_shape: tuple[int, ...], mesh_dim: int,
            dim: int) -> tuple[tuple[int, Placement], ...]:
    """The mesh dims (with their placements) that split tensor dim `dim` before `mesh_dim` does."""
    order = split_order(tuple(placements), mesh_shape)
    before = order[:order.index(mesh_dim)]
    return tuple((j, placements[j]) for j in before
                 if isinstance(placements[j], Shard) and placements[j].dim == dim)


def _can_all_to_all(current: list[Placement], target: Placements, mesh_shape: tuple[int, ...], mesh_dim: int,
                    src: Shard, dst: Shard) -> bool:
    """Shard(src) -> Shard(dst) in one all-to-all is exact when neither is strided, no other mesh dim shards
    either tensor dim now, and no mesh dim will split dst before this one in the target."""
    if isinstance(src, _StridedShard) or isinstance(dst, _StridedShard):
        return False
    for j, placement in enumerate(current):
        if j != mesh_dim and isinstance(placement, Shard) and placement.dim in (src.dim, dst.dim):
            return False
    return not _prefix(target, mesh_shape, mesh_dim, dst.dim)


def plan_redistribute(source: DTensorSpec, target: Placements) -> tuple[Step, ...]:
    """The steps that take `source` to `target` placements (see Note: planning order on N-d meshes). They
    depend on the placements and the mesh's shape only, never on the tensor's (which may be symbolic)."""
    return _plan(source.placements, source.mesh.shape, target)


@functools.lru_cache(maxsize=4096)
def _plan(placements: Placements, mesh_shape: tuple[int, ...], target: Placements) -> tuple[Step, ...]:
    current = list(placements)
    steps: list[Step] = []
    for i in reversed(split_order(placements, mesh_shape)):          # phase 1: unshard what doesn't stay
        placement = current[i]
        if not isinstance(placement, Shard):
            continue
        goal = target[i]
        if placement == goal and _prefix(current, mesh_shape, i, placement.dim) == _prefix(target, mesh_shape, i,
                                                                                           placement.dim):
            continue
        if isinstance(goal, Shard) and goal != placement and _can_all_to_all(current, target, mesh_shape, i,
                                                                             placement, goal):
            steps.append(Step(i, placement, goal))
            current[i] = goal
        else:
            steps.append(Step(i, placement, Replicate()))
            current[i] = Replicate()
    for i in split_order(target, mesh_shape):         # phase 2: move every dim to its target
        goal = target[i]
        placement = current[i]
        if placement == goal:
            continue
        if isinstance(placement, Partial) and isinstance(goal, Partial):
            steps.append(Step(i, placement, Replicate()))
            placement = Replicate()
        steps.append(Step(i, placement, goal))
        current[i] = goal
    return tuple(steps)


def run_plan(local: Tensor, source: DTensorSpec, target: Placements) -> Tensor:
    """This rank's local tensor of `source`'s value laid out as `target`. Collective over the mesh groups of
    the steps' mesh dims. Returns `local` itself when nothing changes, otherwise a new tensor."""
    mesh = source.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return local
    placements = list(source.placements)
    for step in plan_redistribute(source, tuple(target)):
        spec = source.with_placements(tuple(placements))
        local = _run_step(local, spec, step, coordinate)
        placements[step.mesh_dim] = step.target
    return local


def _run_step(local: Tensor, spec: DTensorSpec, step: Step, coordinate: Sequence[int]) -> Tensor:
    mesh = spec.mesh
    i, source, target = step.mesh_dim, step.source, step.target
    n = mesh.size(i)
    if isinstance(source, Replicate):
        if isinstance(target, Shard):
            start, length = chunk_range(local.shape[target.dim], n, coordinate[i])
            return local.narrow(target.dim, start, length).clone()
        assert isinstance(target, Partial)
        return target.partition(local, n, coordinate[i])
    if n == 1:      # a one-rank group: the local value is already the whole (reduced) value
        return local
    group = mesh.get_group(i)
    if isinstance(source, Shard):
        sizes = chunk_sizes(spec.extent_at(i, source.dim, coordinate), n)
        if isinstance(target, Replicate):
            return all_gathered(local, source.dim, group, sizes)
        assert isinstance(target, Shard)
        split_sizes = chunk_sizes(local.shape[target.dim], n)
        return all_to_all_dims(local, target.dim, source.dim, group, split_sizes, sizes)
    assert isinstance(source, Partial)
    if isinstance(target, Replicate):
        return all_reduced(local, source.comm_op, group)
    assert isinstance(target, Shard)
    return reduce_scattered(local, source.comm_op, target.dim, group)

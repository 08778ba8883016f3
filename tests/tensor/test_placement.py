"""Placements, DTensorSpec shard arithmetic, the redistribution planner and the cost model: pure, no ranks."""

from __future__ import annotations

import math

import pytest
import torch

from spmd.tensor.placement import Partial, Replicate, Shard, chunk_range, chunk_sizes, normalize_placements
from spmd.tensor.redistribute import Step, plan_redistribute
from spmd.tensor.rules import redistribute_cost, transition_cost
from spmd.tensor.spec import DTensorSpec, contiguous_stride


class FakeMesh:
    """Just what specs and the planner read: sizes and this rank's coordinate."""

    def __init__(self, shape: tuple[int, ...], coordinate: list[int] | None = None) -> None:
        self.shape, self.ndim = shape, len(shape)
        self.coordinate = coordinate if coordinate is not None else [0] * len(shape)

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]

    def get_coordinate(self) -> list[int] | None:
        return self.coordinate


def spec(mesh: FakeMesh, placements, shape=(7, 5), dtype=torch.float32) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), torch.Size(shape), contiguous_stride(shape), dtype)


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunk_range_follows_torch_chunk(size: int, n: int) -> None:
    pieces = torch.arange(size).chunk(n) if size else ()
    want = [len(p) for p in pieces] + [0] * (n - len(pieces))
    assert chunk_sizes(size, n) == want
    offsets = [chunk_range(size, n, i)[0] for i in range(n)]
    assert offsets == [min(sum(want[:i]), size) for i in range(n)]


def test_placements_are_hashable_values() -> None:
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and Partial("max") != Partial()
    assert {Shard(0), Shard(0), Replicate()} == {Shard(0), Replicate()}
    with pytest.raises(ValueError, match="choose one of"):
        Partial("mean")
    with pytest.raises(TypeError, match="int"):
        Shard("0")


def test_normalize_placements_errors() -> None:
    assert normalize_placements([Shard(-1), Replicate()], 2, 2, "t") == (Shard(1), Replicate())
    with pytest.raises(ValueError, match=r"got 1 placements .* for a 2-d mesh"):
        normalize_placements([Shard(0)], 2, 2, "t")
    with pytest.raises(ValueError, match="out of range for a tensor with 2 dims"):
        normalize_placements([Shard(2)], 2, 1, "t")
    with pytest.raises(TypeError, match="not a Placement"):
        normalize_placements(["S0"], 2, 1, "t")
    with pytest.raises(TypeError, match="list or tuple"):
        normalize_placements(Shard(0), 2, 1, "t")
    with pytest.raises(ValueError, match="mix Partial reduce ops"):
        normalize_placements([Partial("sum"), Partial("max")], 2, 2, "t")


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product", "band", "bor", "bxor"])
def test_partition_reduces_back_exactly(op: str) -> None:
    value = torch.tensor([3, 5, 6]) if op.startswith("b") else torch.tensor([1.5, -2.0, 4.0])
    parts = [Partial(op).partition(value, 3, r) for r in range(3)]
    reducers = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum,
                "product": torch.mul, "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
    acc = parts[0]
    for part in parts[1:]:
        acc = reducers[op](acc, part)
    if op == "avg":
        acc = acc / 3
    torch.testing.assert_close(acc, value)


def test_nested_sharding_local_shapes() -> None:
    # 13 rows over a (2, 2) mesh with (Shard(0), Shard(0)): 7 | 6 first, then each half again.
    want = {(0, 0): (4, 0), (0, 1): (3, 4), (1, 0): (3, 7), (1, 1): (3, 10)}
    for coordinate, (rows, offset) in want.items():
        s = spec(FakeMesh((2, 2), list(coordinate)), (Shard(0), Shard(0)), shape=(13, 3))
        shape, offsets = s.local_shape_and_offset(list(coordinate))
        assert (shape[0], offsets[0]) == (rows, offset)
        full = torch.arange(39.0).view(13, 3)
        torch.testing.assert_close(s.local_from_full(full), full[offset:offset + rows])


def test_plan_uses_one_collective_per_changed_mesh_dim() -> None:
    m1, m2 = FakeMesh((4,)), FakeMesh((2, 2))
    assert plan_redistribute(spec(m1, [Shard(0)]), (Replicate(),)) == (Step(0, Shard(0), Replicate()),)
    assert plan_redistribute(spec(m1, [Shard(0)]), (Shard(1),)) == (Step(0, Shard(0), Shard(1)),)   # all-to-all
    assert plan_redistribute(spec(m1, [Partial()]), (Shard(0),)) == (Step(0, Partial(), Shard(0)),)
    assert plan_redistribute(spec(m1, [Replicate()]), (Replicate(),)) == ()
    assert plan_redistribute(spec(m1, [Shard(0)]), (Partial(),)) == (Step(0, Shard(0), Replicate()),
                                                                       Step(0, Replicate(), Partial()))
    assert plan_redistribute(spec(m1, [Partial("max")]), (Partial(),)) == (Step(0, Partial("max"), Replicate()),
                                                                            Step(0, Replicate(), Partial()))
    # (S0, S0) -> (R, S0): mesh dim 1's shard changes meaning, so gather it first, then mesh dim 0, re-chunk
    assert plan_redistribute(spec(m2, [Shard(0), Shard(0)]), (Replicate(), Shard(0))) == (
        Step(1, Shard(0), Replicate()), Step(0, Shard(0), Replicate()), Step(1, Replicate(), Shard(0)))
    # (S0, S1) -> (S1, S0): mesh dim 1 can't all-to-all while mesh dim 0 shards dim 0; once it is gathered,
    # mesh dim 0 can, and mesh dim 1 re-chunks
    assert plan_redistribute(spec(m2, [Shard(0), Shard(1)]), (Shard(1), Shard(0))) == (
        Step(1, Shard(1), Replicate()), Step(0, Shard(0), Shard(1)), Step(1, Replicate(), Shard(0)))
    assert plan_redistribute(spec(m2, [Replicate(), Shard(1)]), (Replicate(), Shard(0))) == (
        Step(1, Shard(1), Shard(0)),)


def test_costs_prefer_cheap_transitions() -> None:
    mesh = FakeMesh((4,))
    sharded, partial = spec(mesh, [Shard(0)], (64, 64)), spec(mesh, [Partial()], (64, 64))
    replicated = spec(mesh, [Replicate()], (64, 64))
    assert transition_cost(replicated, 0, Shard(0)) < transition_cost(sharded, 0, Shard(1))
    assert transition_cost(sharded, 0, Shard(1)) < transition_cost(sharded, 0, Replicate())
    assert transition_cost(partial, 0, Shard(0)) < transition_cost(partial, 0, Replicate())
    assert transition_cost(sharded, 0, Partial()) == math.inf
    assert redistribute_cost(sharded, (Shard(0),)) == 0

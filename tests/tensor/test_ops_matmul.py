"""Matmul-family sharding rules (mm, addmm, bmm, baddbmm, dot, mv, and matmul / linear through them).

Every test compares full_tensor() of the DTensor result and of the input gradients with the same function on
plain tensors, for every input layout on 1-d meshes and a fixed sample of them on the (2, 2) mesh. Shapes are
odd so that shards are uneven (and on 4 ranks some are empty).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor import Partial, Replicate, Shard
from spmd.tensor.dispatch import MixedTensorError
from spmd.tensor.rules import ShardingError
from spmd.testing import run_ranks
from tests.tensor.rule_checks import MESH_SHAPES, budget, check, combos, layouts, make_dtensor, on_meshes, sample

torch.manual_seed(0)
A = torch.randn(5, 7)
B = torch.randn(7, 3)
BIAS = torch.randn(3)
BATCH_A = torch.randn(3, 5, 6)
BATCH_B = torch.randn(3, 6, 4)


def _not_both_partial(pair: tuple) -> bool:
    return not all(any(p.is_partial() for p in placements) for placements in pair)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_mm_and_addmm_every_layout(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh: DeviceMesh) -> None:
        pairs = [pair for pair in combos(layouts(2, mesh, partial=True), layouts(2, mesh, partial=True))
                 if _not_both_partial(pair)]
        for pa, pb in sample(pairs, budget(mesh)):
            check(torch.mm, [A, B], mesh, [pa, pb])
        for pbias, pa, pb in combos(layouts(1, mesh, partial=True), layouts(2, mesh), layouts(2, mesh),
                                    limit=budget(mesh, on_two=12)):
            check(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), [BIAS, A, B], mesh, [pbias, pa, pb])
    on_meshes(body, [mesh_shape])


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_bmm_and_baddbmm_every_layout(mesh_shape: tuple[int, ...]) -> None:
    added = torch.randn(5, 4)            # broadcast over the batch

    def body(mesh: DeviceMesh) -> None:
        for pa, pb in combos(layouts(3, mesh), layouts(3, mesh), limit=budget(mesh)):
            check(torch.bmm, [BATCH_A, BATCH_B], mesh, [pa, pb])
        for pc, pa, pb in combos(layouts(2, mesh), layouts(3, mesh), layouts(3, mesh), limit=budget(mesh, 12)):
            check(lambda c, x, y: torch.baddbmm(c, x, y, alpha=0.5), [added, BATCH_A, BATCH_B], mesh, [pc, pa, pb])
    on_meshes(body, [mesh_shape])


def test_output_placements_need_no_communication() -> None:
    """The layouts of tensor parallelism: the cheapest plan keeps every operand where it is."""
    def body(mesh: DeviceMesh) -> None:
        check(torch.mm, [A, B], mesh, [[Shard(1)], [Shard(0)]], expect_placements=[Partial()])   # row-parallel
        check(torch.mm, [A, B], mesh, [[Shard(0)], [Replicate()]], expect_placements=[Shard(0)])  # data-parallel
        check(torch.mm, [A, B], mesh, [[Replicate()], [Shard(1)]], expect_placements=[Shard(1)])  # column-parallel
        check(torch.mm, [A, B], mesh, [[Partial()], [Replicate()]], expect_placements=[Partial()])
        check(torch.bmm, [BATCH_A, BATCH_B], mesh, [[Shard(0)], [Shard(0)]], expect_placements=[Shard(0)])
        check(torch.addmm, [BIAS, A, B], mesh, [[Shard(0)], [Replicate()], [Shard(1)]],
              expect_placements=[Shard(1)])
        check(torch.addmm, [BIAS, A, B], mesh, [[Replicate()], [Shard(1)], [Shard(0)]],
              expect_placements=[Partial()])
    on_meshes(body, [(2,), (4,)])


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_dot_mv_and_matmul_decompositions(mesh_shape: tuple[int, ...]) -> None:
    v7, v7b = torch.randn(7), torch.randn(7)
    x3, w = torch.randn(2, 5, 7), torch.randn(3, 7)
    x4, y4 = torch.randn(2, 3, 5, 6), torch.randn(3, 6, 4)

    def body(mesh: DeviceMesh) -> None:
        for pa, pb in combos(layouts(1, mesh), layouts(1, mesh), limit=budget(mesh)):
            check(torch.dot, [v7, v7b], mesh, [pa, pb])
        for pa, pb in combos(layouts(2, mesh), layouts(1, mesh), limit=budget(mesh, 8)):
            check(torch.mv, [A, v7], mesh, [pa, pb])
        for px, pw in combos(layouts(3, mesh, shard_dims=(0, 2)), layouts(2, mesh), limit=budget(mesh)):
            check(lambda x, y: x @ y.t(), [x3, w], mesh, [px, pw])                  # 3-d @ 2-d folds to mm
        for px, py in combos(layouts(4, mesh, shard_dims=(0, 3)), layouts(3, mesh, shard_dims=(0,)),
                             limit=budget(mesh)):
            check(torch.matmul, [x4, y4], mesh, [px, py])                           # broadcast batch -> bmm
    on_meshes(body, [mesh_shape])


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_linear_tensor_parallel_layouts(mesh_shape: tuple[int, ...]) -> None:
    x = torch.randn(3, 4, 7)
    w_up, b_up = torch.randn(10, 7), torch.randn(10)
    w_down, b_down = torch.randn(7, 10), torch.randn(7)

    def mlp(x_: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x_, w1, b1).relu(), w2, b2)

    def body(mesh: DeviceMesh) -> None:
        rep = [Replicate()] * mesh.ndim
        colwise, rowwise = [Shard(0)] * mesh.ndim, [Shard(1)] * mesh.ndim
        check(mlp, [x, w_up, b_up, w_down, b_down], mesh, [rep, colwise, colwise, rowwise, rep])   # Megatron MLP
        check(mlp, [x, w_up, b_up, w_down, b_down], mesh, [[Shard(0)] * mesh.ndim, rep, rep, rep, rep])   # DP
        for pw, pb in combos(layouts(2, mesh), layouts(1, mesh), limit=budget(mesh)):
            check(F.linear, [x, w_up, b_up], mesh, [rep, pw, pb])
    on_meshes(body, [mesh_shape])


def test_plain_scalar_bias_is_not_made_partial() -> None:
    """A one-element plain tensor is the same on every rank; a Partial output would count it once per rank."""
    def body(mesh: DeviceMesh) -> None:
        a = make_dtensor(A, mesh, [Shard(1)])
        b = make_dtensor(B, mesh, [Shard(0)])
        out = torch.addmm(torch.tensor(1.5), a, b)
        assert not any(p.is_partial() for p in out.placements)
        torch.testing.assert_close(out.full_tensor(), torch.addmm(torch.tensor(1.5), A, B))
    on_meshes(body, [(2,)])


def test_bad_operands_are_refused_with_clear_errors() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (4,))
        pair = init_device_mesh("cpu", (2, 2))
        a = make_dtensor(A, mesh, [Shard(0)])
        with pytest.raises(MixedTensorError, match=r"plain torch\.Tensor of shape"):
            torch.mm(a, B)
        with pytest.raises(ValueError, match="different meshes"):
            torch.mm(a, make_dtensor(B, pair, [Replicate(), Replicate()]))
        with pytest.raises(ShardingError, match="same reduction dim"):     # global shapes checked on meta
            torch.mm(a, make_dtensor(A, mesh, [Replicate()]))
    run_ranks(body, world_size=4, timeout=60)

"""_StridedShard: the layout FSDP over tensor parallelism gives a weight both shard along the same dim (see Note:
strided sharding in spmd/tensor/placement.py). Its blocks and split order (pure), torch's _StridedShard as the
oracle where their meanings meet, and on 4 thread ranks ((dp, tp) = (2, 2)): distribute_tensor, full_tensor,
redistribute both ways, the ops that keep it, norms, and the ops that refuse it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard

from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.placement import _StridedShard, chunk_range, normalize_placements
from spmd.tensor.redistribute import Step, plan_redistribute
from spmd.tensor.rules import ShardingError
from spmd.tensor.spec import DTensorSpec, contiguous_stride
from spmd.testing import run_ranks
from tests.tensor.test_placement import FakeMesh

TIMEOUT = 60
SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 12, 13]


def _nested(size: int, outer: tuple[int, int], inner: tuple[int, int]) -> tuple[int, int]:
    """(offset, length) of chunk inner[1] of inner[0] pieces of chunk outer[1] of outer[0] pieces of `size`."""
    start, length = chunk_range(size, *outer)
    sub_start, sub_length = chunk_range(length, *inner)
    return start + sub_start, sub_length


def _spec(mesh: FakeMesh, placements: list, shape: tuple[int, ...]) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), torch.Size(shape), contiguous_stride(shape), torch.float32)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 3), (3, 2), (4, 2)])
@pytest.mark.parametrize("rows", SIZES)
def test_blocks_are_the_tp_chunk_of_the_dp_chunk(mesh_shape: tuple[int, int], rows: int) -> None:
    dp, tp = mesh_shape
    for d in range(dp):
        for t in range(tp):
            mesh = FakeMesh(mesh_shape, [d, t])
            spec = _spec(mesh, [_StridedShard(0, split_factor=tp), Shard(0)], (rows, 3))
            shape, offset = spec.local_shape_and_offset([d, t])
            start, length = _nested(rows, (tp, t), (dp, d))
            assert (tuple(shape), offset) == ((length, 3), (start, 0))
            assert spec.split_order() == (1, 0) and spec.shard_mesh_dims(0) == [1, 0]
            full = torch.arange(rows * 3.0).reshape(rows, 3)
            assert torch.equal(spec.local_from_full(full), full[start:start + length])


@pytest.mark.parametrize("pieces", range(9))
@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("tp", [2, 3])
def test_blocks_match_torch_where_the_dim_divides_by_split_factor(pieces: int, dp: int, tp: int) -> None:
    rows = pieces * tp
    full = torch.arange(float(rows))
    dp_pieces, _ = TorchStridedShard(0, split_factor=tp)._split_tensor(full, dp, with_padding=False)
    for d in range(dp):
        tp_pieces, _ = TorchShard(0)._split_tensor(dp_pieces[d], tp, with_padding=False)
        for t in range(tp):
            spec = _spec(FakeMesh((dp, tp), [d, t]), [_StridedShard(0, split_factor=tp), Shard(0)], (rows,))
            assert torch.equal(spec.local_from_full(full), tp_pieces[t])


def test_hybrid_order_and_a_different_dim() -> None:
    mesh = FakeMesh((2, 2, 2), [1, 0, 1])
    spec = _spec(mesh, [Replicate(), _StridedShard(0, split_factor=2), Shard(0)], (8, 4))
    assert spec.split_order() == (0, 2, 1)
    assert spec.local_shape_and_offset([1, 0, 1]) == (torch.Size([2, 4]), (4, 0))   # tp piece 1, its dp chunk 0
    other = _spec(FakeMesh((2, 2), [1, 0]), [Shard(0), Shard(1)], (8, 4))         # FSDP rows, TP columns
    assert other.split_order() == (0, 1)


def test_unsupported_strided_placements_are_named() -> None:
    strided = _StridedShard(0, split_factor=2)
    assert strided != Shard(0) and strided.with_dim(1) == _StridedShard(1, split_factor=2)
    assert normalize_placements([_StridedShard(-2, split_factor=2), Shard(0)], 2, 2, "t") == (strided, Shard(0))
    with pytest.raises(ValueError, match="no later mesh dim shards tensor dim 0"):
        normalize_placements([strided, Shard(1)], 2, 2, "t")
    with pytest.raises(ValueError, match="mesh dim 0 shards tensor dim 0 before it"):
        normalize_placements([Shard(0), strided, Shard(0)], 2, 3, "t")
    with pytest.raises(ValueError, match="another _StridedShard"):
        normalize_placements([strided, strided, Shard(0)], 2, 3, "t")
    with pytest.raises(ValueError, match="split it into 3 pieces, not split_factor=2"):
        _spec(FakeMesh((2, 3)), [strided, Shard(0)], (8,)).local_shape()
    with pytest.raises(TypeError, match="split_factor must be a positive int"):
        _StridedShard(0, split_factor=0)


def test_plans() -> None:
    mesh = FakeMesh((2, 2))
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    # FSDP's sharding of a tp-sharded weight: each rank chunks its tp piece, no communication
    assert plan_redistribute(_spec(mesh, [Replicate(), Shard(0)], (8, 3)), strided) == (
        Step(0, Replicate(), strided[0]),)
    # the strided dim splits last, so it is gathered first
    assert plan_redistribute(_spec(mesh, list(strided), (8, 3)), (Replicate(), Replicate())) == (
        Step(0, strided[0], Replicate()), Step(1, Shard(0), Replicate()))
    assert plan_redistribute(_spec(mesh, list(strided), (8, 3)), (Replicate(), Shard(0))) == (
        Step(0, strided[0], Replicate()),)
    # never an all-to-all into or out of it
    assert plan_redistribute(_spec(mesh, list(strided), (8, 3)), (Shard(1), Shard(0))) == (
        Step(0, strided[0], Replicate()), Step(0, Replicate(), Shard(1)))
    assert plan_redistribute(_spec(mesh, [Shard(0), Shard(0)], (8, 3)), strided) == (
        Step(1, Shard(0), Replicate()), Step(0, Shard(0), Replicate()), Step(1, Replicate(), Shard(0)),
        Step(0, Replicate(), strided[0]))


# -- on thread ranks -------------------------------------------------------------------------------------------

def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


STRIDED = [_StridedShard(0, split_factor=2), Shard(0)]
TARGETS = [[Replicate(), Replicate()], [Shard(0), Shard(0)], [Shard(1), Shard(0)], [Replicate(), Shard(0)],
           [Shard(0), Replicate()], [Shard(1), Shard(1)], [Partial(), Replicate()], [Replicate(), Shard(1)]]


@pytest.mark.parametrize("rows", [0, 3, 5, 7, 8])
def test_distribute_full_tensor_and_redistribute(rows: int) -> None:
    def body(rank: int, size: int) -> None:
        mesh = _mesh()
        d, t = mesh.get_coordinate()
        full = torch.arange(rows * 3.0).reshape(rows, 3)
        x = distribute_tensor(full, mesh, STRIDED)
        start, length = _nested(rows, (2, t), (2, d))
        assert torch.equal(x.to_local(), full[start:start + length])
        assert torch.equal(x.full_tensor(), full)
        for target in TARGETS:
            y = x.redistribute(placements=target)
            assert torch.equal(y.full_tensor(), full), target
            if not any(p.is_partial() for p in target):
                assert torch.equal(y.to_local(), distribute_tensor(full, mesh, target).to_local()), target
            back = y.redistribute(placements=STRIDED)
            assert back.placements == tuple(STRIDED) and torch.equal(back.to_local(), x.to_local()), target
        wrapped = DTensor.from_local(x.to_local(), mesh, STRIDED, shape=full.shape)
        assert torch.equal(wrapped.full_tensor(), full)
    run_ranks(body, 4, timeout=TIMEOUT)


def test_gradients_flow_through_redistribute() -> None:
    def body(rank: int, size: int) -> None:
        full = torch.arange(21.0).reshape(7, 3)
        x = distribute_tensor(full, _mesh(), STRIDED).requires_grad_()
        (x.redistribute(placements=[Replicate(), Replicate()]).to_local() * 2).sum().backward()
        assert x.grad.placements == tuple(STRIDED)
        torch.testing.assert_close(x.grad.full_tensor(), torch.full((7, 3), 2.0))
    run_ranks(body, 4, timeout=TIMEOUT)


def test_elementwise_ops_and_norms_keep_or_read_the_layout() -> None:
    def body(rank: int, size: int) -> None:
        mesh = _mesh()
        gen = torch.Generator().manual_seed(0)
        a_full, b_full = torch.randn(7, 5, generator=gen), torch.rand(7, 5, generator=gen) + 0.5
        a, b = distribute_tensor(a_full, mesh, STRIDED), distribute_tensor(b_full, mesh, STRIDED)
        plain = distribute_tensor(b_full, mesh, [Shard(0), Shard(0)])
        row = distribute_tensor(b_full[0], mesh, [Replicate(), Replicate()])
        for got, want in [(a * b + a, a_full * b_full + a_full), ((a / b).abs().sqrt(), (a_full / b_full).abs().sqrt()),
                          (a + plain, a_full + b_full), (a * row, a_full * b_full[0]),
                          (torch.zeros_like(a), torch.zeros(7, 5)), (a.clone(), a_full)]:
            assert got.placements == tuple(STRIDED)
            torch.testing.assert_close(got.full_tensor(), want)
        c = a.clone()
        c.mul_(2).addcdiv_(a, b, value=-0.5)
        torch._foreach_lerp_([c], [b], 0.25)
        want = torch.lerp(a_full * 2 - 0.5 * a_full / b_full, b_full, 0.25)
        assert c.placements == tuple(STRIDED)
        torch.testing.assert_close(c.full_tensor(), want)
        for order in (2.0, 1.0, math.inf):
            torch.testing.assert_close(torch.linalg.vector_norm(a, order).full_tensor(),
                                       torch.linalg.vector_norm(a_full, order))
            torch.testing.assert_close(torch._foreach_norm([a, plain], order)[0].full_tensor(),
                                       torch.linalg.vector_norm(a_full, order))
        torch.testing.assert_close(a.sum(1).full_tensor(), a_full.sum(1))
        torch.testing.assert_close(a.mean().full_tensor(), a_full.mean())
    run_ranks(body, 4, timeout=TIMEOUT)


def test_ops_that_would_mislabel_it_refuse() -> None:
    def body(rank: int, size: int) -> None:
        a = distribute_tensor(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), _mesh(), STRIDED)
        for op in (lambda x: x.t(), lambda x: x.view(-1), lambda x: x.view(8, 2, 3), lambda x: x.unsqueeze(0)):
            with pytest.raises(ShardingError, match="can't keep a _StridedShard operand"):
                op(a)
        plain = a.redistribute(placements=[Shard(0), Shard(0)])
        torch.testing.assert_close(plain.t().full_tensor(), a.full_tensor().t())     # the way out it names
    run_ranks(body, 4, timeout=TIMEOUT)


def test_on_a_hybrid_mesh() -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
        _, d, t = mesh.get_coordinate()
        full = torch.arange(30.0).reshape(10, 3)
        placements = [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]
        x = distribute_tensor(full, mesh, placements)
        start, length = _nested(10, (2, t), (2, d))
        assert torch.equal(x.to_local(), full[start:start + length])
        assert torch.equal(x.full_tensor(), full)
        tp_start, tp_length = chunk_range(10, 2, t)
        assert torch.equal(x.redistribute(placements=[Replicate(), Replicate(), Shard(0)]).to_local(),
                           full[tp_start:tp_start + tp_length])
    run_ranks(body, 8, timeout=TIMEOUT)


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_matches_one_process(foreach: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    fulls = [torch.randn(7, 5, generator=gen), torch.randn(6, 3, generator=gen)]
    grads = [torch.randn(7, 5, generator=gen), torch.randn(6, 3, generator=gen)]
    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(plain, 0.5, foreach=foreach)

    def body(rank: int, size: int) -> None:
        mesh = _mesh()
        layouts = [STRIDED, [Shard(0), Shard(1)]]
        params = [torch.nn.Parameter(distribute_tensor(f, mesh, layout)) for f, layout in zip(fulls, layouts)]
        for p, g, layout in zip(params, grads, layouts, strict=True):
            p.grad = distribute_tensor(g, mesh, layout)
        total = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=foreach)
        torch.testing.assert_close(total.full_tensor(), want)
        for p, ref in zip(params, plain, strict=True):
            assert p.grad.placements == p.placements
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad)
    run_ranks(body, 4, timeout=TIMEOUT)

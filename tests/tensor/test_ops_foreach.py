"""Foreach and fused optimizer ops on DTensors: torch.optim steps directly on DTensor parameters.

Each optimizer (SGD with momentum / nesterov, Adam, Adam with amsgrad, AdamW; foreach, single-tensor and
fused implementations) runs three steps on parameters with mixed layouts and gradients that are laid out
like their parameter, differently, or Partial, and must match the same optimizer on plain tensors.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from spmd.device_mesh import DeviceMesh
from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, redistribute
from spmd.tensor.ops import foreach as foreach_ops
from spmd.tensor.rules import ShardingError
from tests.tensor.rule_checks import MESH_SHAPES, layouts, make_dtensor, on_meshes

torch.manual_seed(0)
SHAPES = [(5, 3), (7,), (4, 6)]
INIT = [torch.randn(shape) for shape in SHAPES]
GRADS = [[torch.randn(shape) for shape in SHAPES] for _ in range(3)]

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd_nesterov_decay": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    "adam_decay": (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.1}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
}
IMPLEMENTATIONS = {"foreach": {"foreach": True}, "single_tensor": {"foreach": False}, "fused": {"fused": True}}


def _train(mesh: DeviceMesh, optimizer: type, options: dict, params: Sequence[Sequence[Placement]],
           grads: Sequence[Sequence[Placement]]) -> None:
    plain = [t.clone().requires_grad_() for t in INIT]
    dist = [torch.nn.Parameter(make_dtensor(t, mesh, p)) for t, p in zip(INIT, params)]
    plain_opt, dist_opt = optimizer(plain, **options), optimizer(dist, **options)
    for step_grads in GRADS:
        for p, g in zip(plain, step_grads):
            p.grad = g.clone()
        for p, g, layout in zip(dist, step_grads, grads):
            p.grad = make_dtensor(g, mesh, layout)
        plain_opt.step()
        dist_opt.step()
    for k, (p, d) in enumerate(zip(plain, dist)):
        assert d.placements == tuple(params[k]), f"parameter {k} changed layout to {d.placements}"
        # Elementwise fp32 updates on the same values: only Partial gradients (summed in another order) and
        # sqrt/division rounding differ, a few ulps.
        torch.testing.assert_close(d.full_tensor(), p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{optimizer.__name__} {options} parameter {k}: {m}")


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_optimizers_step_on_dtensor_parameters(mesh_shape: tuple[int, ...], implementation: str) -> None:
    def body(mesh: DeviceMesh) -> None:
        rng = random.Random(sum(mesh_shape))
        for optimizer, options in OPTIMIZERS.values():
            for trial in [1] if mesh.size() > 2 else [0, 1]:
                params = [rng.choice(layouts(len(s), mesh)) for s in SHAPES]
                # trial 0: gradients laid out like their parameter; later: any layout, Partial included
                grads = params if trial == 0 else [rng.choice(layouts(len(s), mesh, partial=True)) for s in SHAPES]
                _train(mesh, optimizer, {**options, **IMPLEMENTATIONS[implementation]}, params, grads)
    on_meshes(body, [mesh_shape])


def test_foreach_ops_follow_each_position() -> None:
    """Position i of every list follows self[i]; other operands are redistributed to it."""
    def body(mesh: DeviceMesh) -> None:
        selves = [make_dtensor(INIT[0], mesh, [Shard(0)]), make_dtensor(INIT[1], mesh, [Replicate()])]
        others = [make_dtensor(GRADS[0][0], mesh, [Partial()]), make_dtensor(GRADS[0][1], mesh, [Shard(0)])]
        sums = torch._foreach_add(selves, others, alpha=2.0)
        assert [s.placements for s in sums] == [(Shard(0),), (Replicate(),)]
        for out, a, b in zip(sums, INIT, GRADS[0]):
            torch.testing.assert_close(out.full_tensor(), a + 2.0 * b)
        roots = torch._foreach_sqrt([make_dtensor(INIT[2].abs(), mesh, [Partial()])])   # not linear: reduced
        assert roots[0].placements == (Replicate(),)
        torch.testing.assert_close(roots[0].full_tensor(), INIT[2].abs().sqrt())
        torch._foreach_mul_(selves, make_dtensor(torch.tensor(0.5), mesh, [Replicate()]))
        torch.testing.assert_close(selves[0].full_tensor(), INIT[0] * 0.5)
    on_meshes(body, [(2,), (4,)])


def test_foreach_ops_over_several_meshes_run_per_mesh() -> None:
    """Lists whose positions live on different meshes (plain parameters on dp beside (dp, tp) ones under FSDP
    over tensor parallelism) run once per mesh; the outputs come back in list order."""
    def body(mesh: DeviceMesh) -> None:
        two_d = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
        dp = two_d["dp"]
        layouts_ = [(dp, [Shard(0)]), (dp, [Replicate()]), (two_d, [Shard(1), Shard(0)])]
        selves = [make_dtensor(t, m, p) for t, (m, p) in zip(INIT, layouts_)]
        others = [make_dtensor(t, m, p) for t, (m, p) in zip(GRADS[0], layouts_)]
        sums = torch._foreach_add(selves, others, alpha=2.0)
        assert [(s.device_mesh, s.placements) for s in sums] == [(m, tuple(p)) for m, p in layouts_]
        for out, a, b in zip(sums, INIT, GRADS[0]):
            torch.testing.assert_close(out.full_tensor(), a + 2.0 * b)
        torch._foreach_addcdiv_(selves, others, sums, [0.5, 0.25, 2.0])
        for out, a, b, c, w in zip(selves, INIT, GRADS[0], sums, [0.5, 0.25, 2.0]):
            torch.testing.assert_close(out.full_tensor(), a + w * b / c.full_tensor())
        crossed = [make_dtensor(GRADS[0][0], two_d, [Shard(0), Replicate()]), *others[1:]]
        with pytest.raises(ValueError, match="different meshes"):        # one position, two meshes: named
            torch._foreach_add(selves, crossed)
    on_meshes(body, [(4,)])


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_over_plain_parameters_beside_dtensors_runs_per_kind(name: str, implementation: str) -> None:
    """A tensor-parallel plan that leaves some parameters plain (a position embedding): torch's optimizers step a
    group's parameters in one foreach (or fused) call, the default on accelerators, plain ones beside DTensors in
    its lists; it runs once for the DTensor positions and once for the plain ones (torch's DTensor refuses it)."""
    optimizer, options = OPTIMIZERS[name]

    def body(mesh: DeviceMesh) -> None:
        plain = [t.clone().requires_grad_() for t in INIT]
        mixed = [torch.nn.Parameter(make_dtensor(INIT[0], mesh, [Shard(0)])), torch.nn.Parameter(INIT[1].clone()),
                 torch.nn.Parameter(make_dtensor(INIT[2], mesh, [Replicate()]))]
        plain_opt = optimizer(plain, **options)
        mixed_opt = optimizer(mixed, **options, **IMPLEMENTATIONS[implementation])
        for step_grads in GRADS:
            for p, g in zip(plain, step_grads):
                p.grad = g.clone()
            for p, g in zip(mixed, step_grads):
                p.grad = make_dtensor(g, mesh, [Partial()]) if isinstance(p, DTensor) else g.clone()
            plain_opt.step()
            mixed_opt.step()
        assert [isinstance(p, DTensor) for p in mixed] == [True, False, True]
        for k, (p, m) in enumerate(zip(plain, mixed)):
            got = m.full_tensor() if isinstance(m, DTensor) else m.detach()
            torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6, msg=lambda msg, k=k: f"{k}: {msg}")
    on_meshes(body, [(2,)])


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_over_parameters_of_two_meshes_runs_per_mesh(name: str, implementation: str) -> None:
    """Expert parallelism as TorchTitan lays it out: dense parameters on one mesh, the experts' on another, one
    optimizer (fused AdamW by default): a fused or foreach step runs once per mesh, as one process's step."""
    optimizer, options = OPTIMIZERS[name]

    def body(mesh: DeviceMesh) -> None:
        two_d = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("efsdp", "ep"))
        layouts_ = [(mesh, [Shard(0)]), (mesh, [Replicate()]), (two_d, [Shard(0), Shard(1)])]
        plain = [t.clone().requires_grad_() for t in INIT]
        spread = [torch.nn.Parameter(make_dtensor(t, m, p)) for t, (m, p) in zip(INIT, layouts_)]
        plain_opt = optimizer(plain, **options)
        spread_opt = optimizer(spread, **options, **IMPLEMENTATIONS[implementation])
        for step_grads in GRADS:
            for p, g in zip(plain, step_grads):
                p.grad = g.clone()
            for p, g, (m, placements) in zip(spread, step_grads, layouts_):
                p.grad = make_dtensor(g, m, placements)
            plain_opt.step()
            spread_opt.step()
        for k, (p, m) in enumerate(zip(plain, spread)):
            torch.testing.assert_close(m.full_tensor(), p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda msg, k=k: f"{k}: {msg}")
    on_meshes(body, [(4,)])


def test_partial_self_stays_partial_through_linear_ops() -> None:
    """A momentum buffer cloned from a Partial gradient is updated without communication."""
    def body(mesh: DeviceMesh) -> None:
        buf = [make_dtensor(GRADS[0][0], mesh, [Partial()])]
        torch._foreach_mul_(buf, 0.9)
        torch._foreach_add_(buf, [make_dtensor(GRADS[1][0], mesh, [Partial()])], alpha=0.1)
        torch._foreach_lerp_(buf, [make_dtensor(GRADS[2][0], mesh, [Replicate()])], 0.5)
        assert buf[0].placements == (Partial(),)
        expected = torch.lerp(GRADS[0][0] * 0.9 + 0.1 * GRADS[1][0], GRADS[2][0], 0.5)
        torch.testing.assert_close(buf[0].full_tensor(), expected)
        with pytest.raises(ShardingError, match="not linear"):
            torch._foreach_sqrt_(buf)
    on_meshes(body, [(2,)])


def test_fused_step_reduces_a_partial_gradient_once_in_place() -> None:
    def body(mesh: DeviceMesh) -> None:
        columns = (Shard(1),) * mesh.ndim
        param = torch.nn.Parameter(make_dtensor(INIT[0], mesh, columns))
        param.grad = make_dtensor(GRADS[0][0], mesh, [Partial()] * mesh.ndim)
        torch.optim.Adam([param], lr=0.1, fused=True).step()
        assert isinstance(param.grad, DTensor) and param.grad.placements == columns
        torch.testing.assert_close(param.grad.full_tensor(), GRADS[0][0])
    on_meshes(body, [(2,), (2, 2)])


def test_foreach_step_reduces_a_partial_gradient_once_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam reads the gradient in lerp_ and twice in addcmul_: it is all-reduced once, by the first."""
    calls: list[str] = []
    original = redistribute.all_reduced

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(redistribute, "all_reduced", counting)

    def body(mesh: DeviceMesh) -> None:
        param = torch.nn.Parameter(make_dtensor(INIT[0], mesh, [Replicate()]))
        param.grad = make_dtensor(GRADS[0][0], mesh, [Partial()])
        torch.optim.Adam([param], lr=0.1, foreach=True).step()
        assert param.grad.placements == (Replicate(),)
        torch.testing.assert_close(param.grad.full_tensor(), GRADS[0][0])
    on_meshes(body, [(2,)])
    assert sorted(calls) == ["spmd-rank0", "spmd-rank1"]      # one all-reduce per rank


def test_optimizers_default_to_foreach_for_dtensors_where_they_do_for_plain_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's optimizers choose foreach by default on accelerators, for the tensor types they list (torch's
    DTensor among them): spmd's DTensor is listed too, so a CUDA run steps its parameters one dispatch per op,
    not one per parameter per op. Checked on CPU by counting it as a foreach device."""
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])

    def body(mesh: DeviceMesh) -> None:
        plain = torch.nn.Parameter(INIT[0].clone())
        param = torch.nn.Parameter(make_dtensor(INIT[0], mesh, [Shard(0)]))
        assert torch_optimizer._default_to_fused_or_foreach([plain], False) == (False, True)
        assert torch_optimizer._default_to_fused_or_foreach([param, plain], False) == (False, True)
    on_meshes(body, [(2,)])


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm(foreach: bool) -> None:
    def body(mesh: DeviceMesh) -> None:
        plain = [t.clone().requires_grad_() for t in INIT]
        dist = [torch.nn.Parameter(make_dtensor(t, mesh, p)) for t, p in
                zip(INIT, [[Shard(0)], [Replicate()], [Shard(1)]])]
        for p, d, g, layout in zip(plain, dist, GRADS[0], [[Shard(0)], [Partial()], [Replicate()]]):
            p.grad, d.grad = g.clone(), make_dtensor(g, mesh, layout)
        for norm_type in (2.0, math.inf):
            want = torch.nn.utils.clip_grad_norm_(plain, 0.5, norm_type, foreach=foreach)
            got = torch.nn.utils.clip_grad_norm_(dist, 0.5, norm_type, foreach=foreach)
            torch.testing.assert_close(got.full_tensor(), want)
            for p, d in zip(plain, dist):
                torch.testing.assert_close(d.grad.full_tensor(), p.grad)
    on_meshes(body, [(2,), (4,)])


def test_foreach_norm_batches_one_all_reduce_per_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """clip_grad_norm_ over many sharded gradients: one all-reduce for all of them, not one each."""
    calls: list[str] = []
    original = foreach_ops.all_reduced

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(foreach_ops, "all_reduced", counting)

    def body(mesh: DeviceMesh) -> None:
        grads = [make_dtensor(g, mesh, [Shard(0)]) for g in GRADS[0]] + [make_dtensor(GRADS[1][2], mesh, [Shard(1)])]
        for order in (2.0, 3.0, math.inf):
            norms = torch._foreach_norm(grads, order)
            want = [torch.linalg.vector_norm(g, order) for g in [*GRADS[0], GRADS[1][2]]]
            for got, expected in zip(norms, want):
                assert got.placements == (Replicate(),)
                torch.testing.assert_close(got.full_tensor(), expected)
    on_meshes(body, [(2,)])
    assert sorted(calls) == ["spmd-rank0"] * 3 + ["spmd-rank1"] * 3     # one per norm order, per rank


# -- GradScaler's unscale-and-check --------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("overflow_rank", [None, 1])
def test_amp_unscale_checks_every_rank(mesh_shape: tuple[int, ...], overflow_rank: int | None) -> None:
    from tests.tensor.conftest import run_on_mesh

    fulls = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.randn(3)]

    def body(mesh: DeviceMesh) -> tuple[float, list[torch.Tensor]]:
        placements = [(Shard(0),) * mesh.ndim, (Partial(),) + (Shard(0),) * (mesh.ndim - 1)]
        grads = [make_dtensor(full, mesh, p) for full, p in zip(fulls, placements, strict=True)]
        if mesh.get_rank() == overflow_rank:
            grads[0]._local_tensor.view(-1)[0] = float("inf")     # rank 1 holds rows of the 5x3 gradient
        found_inf, inv_scale = torch.zeros(1), torch.full((1,), 0.25)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return found_inf.item(), [g.full_tensor() for g in grads]

    for found, grads in run_on_mesh(mesh_shape, body):
        assert found == (0.0 if overflow_rank is None else 1.0)       # every rank, not just the one that overflowed
        if overflow_rank is None:
            for got, full in zip(grads, fulls, strict=True):
                torch.testing.assert_close(got, full * 0.25)


@pytest.mark.parametrize("foreach", [True, False])
def test_sharded_norms_are_torchs_to_the_bit(foreach: bool) -> None:
    """torch's DTensor takes each shard's norm with linalg.vector_norm, then reduces its p-th power: a gradient norm
    logged under FSDP reads the same under spmd (summing |x|^p over the shard, more accurate, differed from
    torch's in the 4th decimal on TorchTitan's gradients)."""
    full = torch.randn(4096, 512, generator=torch.Generator().manual_seed(0)) * 0.01 + 0.003
    shards = full.chunk(2)
    torch_way = sum(torch.linalg.vector_norm(shard).pow(2) for shard in shards).sqrt()
    torch_total = (2 * torch_way.pow(2)).sqrt()

    def body(mesh: DeviceMesh) -> None:
        sharded = make_dtensor(full, mesh, [Shard(0)])
        assert torch.linalg.vector_norm(sharded).full_tensor().item() == torch_way.item()
        total = torch.nn.utils.get_total_norm([sharded, sharded], 2.0, False, foreach).full_tensor()
        assert total.item() == torch_total.item()

    on_meshes(body, [(2,)])

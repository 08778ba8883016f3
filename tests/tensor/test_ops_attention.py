"""Scaled dot-product attention on DTensors: the CPU flash kernel's forward and backward rules, and (on meta
tensors, shapes and placements) those of the CUDA flash, memory-efficient and cuDNN kernels.

q is (B=3, H=4, L=5, E=8) and k, v (3, 4, S=6, 8): 3 batches over 2 or 4 ranks are uneven, 4 heads split
evenly (the tensor-parallel case). Every layout of q, k, v (the same for all three, or q alone) is compared
with plain torch, forward and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spmd.device_mesh import DeviceMesh
from spmd.tensor import Partial, Replicate, Shard
from tests.tensor.rule_checks import MESH_SHAPES, budget, check, combos, layouts, make_dtensor, on_meshes, sample

torch.manual_seed(0)
Q = torch.randn(3, 4, 5, 8)
K = torch.randn(3, 4, 6, 8)
V = torch.randn(3, 4, 6, 8)
KV_GROUPED = torch.randn(3, 2, 6, 8)
MASK = torch.randn(5, 6)
MASK_PER_BATCH = torch.randn(3, 1, 5, 6)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def _attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_attention_every_layout(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh: DeviceMesh) -> None:
        rep = [Replicate()] * mesh.ndim
        for layout in sample(layouts(4, mesh, partial=True), budget(mesh)):
            check(_attend, [Q, K, V], mesh, [layout] * 3)
            check(_attend_causal, [Q, K, V], mesh, [layout] * 3)
            check(_attend_grouped, [Q, KV_GROUPED, KV_GROUPED], mesh, [layout] * 3)
            check(_attend, [Q, K, V], mesh, [layout, rep, layout])
        for layout, mask_layout in combos(layouts(4, mesh), layouts(2, mesh), limit=budget(mesh, on_two=8)):
            check(_attend_masked, [Q, K, V, MASK], mesh, [layout] * 3 + [mask_layout])
        for layout in sample(layouts(4, mesh, shard_dims=(0, 1)), budget(mesh)):
            check(_attend_masked, [Q, K, V, MASK_PER_BATCH], mesh, [layout] * 4)
    on_meshes(body, [mesh_shape])


def test_heads_batch_and_query_sharding_need_no_communication() -> None:
    def body(mesh: DeviceMesh) -> None:
        heads, batch = [Shard(1)] * mesh.ndim, [Shard(0)] * mesh.ndim
        check(_attend_causal, [Q, K, V], mesh, [heads] * 3, expect_placements=heads)
        check(_attend, [Q, K, V], mesh, [batch] * 3, expect_placements=batch)
        rows, rep = [Shard(2)] * mesh.ndim, [Replicate()] * mesh.ndim
        check(_attend, [Q, K, V], mesh, [rows, rep, rep], expect_placements=rows)
    on_meshes(body, [(2,), (2, 2)])


def test_query_sharded_backward_gives_partial_key_value_gradients() -> None:
    """Each rank's query rows attend to all keys: the key/value gradients are sums over rows, so Partial."""
    def body(mesh: DeviceMesh) -> None:
        q = make_dtensor(Q, mesh, [Shard(2)], requires_grad=True)
        k = make_dtensor(K, mesh, [Replicate()], requires_grad=True)
        v = make_dtensor(V, mesh, [Replicate()], requires_grad=True)
        # autograd.grad, not backward: AccumulateGrad re-strides a gradient whose strides differ from the
        # parameter's (through new_empty_strided + copy_), which may change its layout.
        dq, dk, dv = torch.autograd.grad(_attend(q, k, v), [q, k, v], make_dtensor(torch.ones(3, 4, 5, 8), mesh,
                                                                                      [Shard(2)]))
        assert dq.placements == (Shard(2),)
        assert dk.placements == (Partial(),) and dv.placements == (Partial(),)
    on_meshes(body, [(2,)])


# -- the accelerator kernels, on meta tensors (shapes only: their CPU versions don't exist) ---------------------

aten = torch.ops.aten


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> list:
    out = aten._scaled_dot_product_flash_attention(q, k, v, dropout, True)
    o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = out
    return [*out, *aten._scaled_dot_product_flash_attention_backward(o, q, k, v, o, lse, cum_q, cum_k, max_q, max_k,
                                                                     dropout, True, seed, offset)]


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
               bias: torch.Tensor | None = None) -> list:
    out = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout, False)
    o, lse, seed, offset = out
    return [*out, *aten._scaled_dot_product_efficient_attention_backward(
        o, q, k, v, bias, o, lse, seed, offset, dropout, [True, True, True, bias is not None], False)]


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> list:
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout, True)
    o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = out
    return [*out, *aten._scaled_dot_product_cudnn_attention_backward(o, q, k, v, o, lse, seed, offset, None, cum_q,
                                                                     cum_k, max_q, max_k, dropout, True)]


@pytest.mark.parametrize("kernels", [_flash, _efficient, _cudnn], ids=["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=["batch", "heads"])
def test_accelerator_kernels_shard_batch_or_heads_without_communication(kernels, placement,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CUDA attention kernels (flash, memory-efficient, cuDNN) and their backwards run on each rank's
    batch or heads, their random-state outputs replicated; the shapes are those of the kernel on the local
    tensors, no op falls back, no CPU tensor is made (see Note: attention on accelerator kernels)."""
    from spmd.tensor import DeviceMesh as Mesh
    from spmd.tensor import DTensor, distribute_tensor
    from spmd.tensor.rules import record_fallbacks
    from spmd.testing import run_ranks
    from tests.meta_device import MetaTransport, NoCpuTensors, register_fake_transports

    register_fake_transports(monkeypatch)
    q = torch.empty(4, 4, 8, 16, device="meta")

    def body(rank: int, size: int) -> None:
        mesh = Mesh("meta", list(range(size)))
        local = q.chunk(size, dim=placement.dim)[rank]
        want = kernels(local, local, local, 0.0)
        with NoCpuTensors(), record_fallbacks() as fallbacks:
            x = distribute_tensor(q, mesh, [placement])
            got = kernels(x, x, x, 0.0)
            dropped = kernels(x, x, x, 0.1)
        assert fallbacks == []
        assert len(got) == len(want)
        for value, expected in zip(got, want):
            if isinstance(expected, torch.Tensor):
                assert isinstance(value, DTensor) and value.to_local().shape == expected.shape
                sharded = expected.dim() >= 3
                assert value.placements == ((placement,) if sharded else (Replicate(),))
            else:
                assert value == expected
        # with dropout the kernel draws in-kernel from the device's generator: the call runs whole
        assert all(value.placements == (Replicate(),) for value in dropped if isinstance(value, DTensor))

    run_ranks(body, 2, backend=MetaTransport.name, timeout=60)


def test_accelerator_kernels_keep_a_bias_and_a_partial_gradient_sharded_with_the_heads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from spmd.tensor import DeviceMesh as Mesh
    from spmd.tensor import distribute_tensor
    from spmd.testing import run_ranks
    from tests.meta_device import MetaTransport, register_fake_transports

    register_fake_transports(monkeypatch)

    def body(rank: int, size: int) -> None:
        mesh = Mesh("meta", list(range(size)))
        x = distribute_tensor(torch.empty(2, 4, 8, 16, device="meta"), mesh, [Shard(1)])
        bias = distribute_tensor(torch.empty(2, 4, 8, 8, device="meta"), mesh, [Shard(1)])
        *_, grad_bias = _efficient(x, x, x, 0.0, bias)
        assert grad_bias.placements == (Shard(1),) and grad_bias.to_local().shape == (2, 2, 8, 8)
        o, lse, seed, offset = aten._scaled_dot_product_efficient_attention(x, x, x, None, True, 0.0, False)
        whole = [t.redistribute(mesh, [Replicate()]) for t in (x, o, lse)]
        partial = distribute_tensor(torch.empty(2, 4, 8, 16, device="meta"), mesh, [Replicate()]).redistribute(
            mesh, [Partial()])
        grads = aten._scaled_dot_product_efficient_attention_backward(
            partial, whole[0], whole[0], whole[0], None, whole[1], whole[2], seed, offset, 0.0,
            [True, True, True, False], False)
        assert [g.placements for g in grads[:3]] == [(Partial(),)] * 3     # linear in the output's gradient

    run_ranks(body, 2, backend=MetaTransport.name, timeout=60)

"""Scaled dot-product attention on DTensors: the CPU flash kernel's forward and backward rules.

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

"""Training parity: a small MLP and a small transformer block whose parameters are DTensors train with AdamW
and match the same training on plain tensors, step by step.

Letters: B batch, S sequence, D model width, H heads, F feed-forward width, V vocabulary.
The plans are the real ones: Megatron tensor parallelism (column-parallel then row-parallel linears, heads
sharded in attention, a vocab-sharded embedding and lm head) on the last mesh dim, data parallelism (batch
Shard(0), parameters Replicate) on the first, and "everything Shard(0)" as a stress layout. Every parameter
is created by distribute_tensor from the plain model's value; losses are compared at every step and every
parameter's full value after the last one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.device_mesh import DeviceMesh
from spmd.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from tests.tensor.rule_checks import on_meshes

STEPS = 4
# fp32 on CPU. The sharded run sums the same products in other orders (per-shard partial sums reduced
# across ranks): a few ulps per op. AdamW divides by sqrt(v), which keeps those errors relative; after 4 steps
# of lr 1e-2 the largest difference measured, loss or parameter, is 2.4e-7 (2 ulps at magnitude ~1). 2e-6
# leaves room for other summation orders while a wrong gradient (a missing or doubled reduction) moves
# parameters by ~lr = 1e-2 and the loss by more.
RTOL, ATOL = 1e-5, 2e-6


class MLP(nn.Module):
    def __init__(self, d_in: int = 7, d_hidden: int = 12, d_out: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)
        self.down = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Embedding -> pre-norm causal attention -> pre-norm MLP -> lm head (a one-block language model)."""

    def __init__(self, vocab: int = 13, width: int = 8, heads: int = 4, hidden: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.norm1 = nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        return x.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)     # (B, H, S, D/H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)                                                             # (B, S, D)
        h = self.norm1(x)
        q, k, v = self._split_heads(self.q(h)), self._split_heads(self.k(h)), self._split_heads(self.v(h))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)                   # (B, H, S, D/H)
        x = x + self.o(attn.transpose(1, 2).reshape(x.shape))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)                                                             # (B, S, V)


Plan = Callable[[DeviceMesh], dict[str, list[Placement]]]


def _tp(mesh: DeviceMesh, placement: Placement) -> list[Placement]:
    """`placement` on the last (tensor-parallel) mesh dim, Replicate on the others (data parallel)."""
    return [Replicate()] * (mesh.ndim - 1) + [placement]


def _mlp_megatron(mesh: DeviceMesh) -> dict[str, list[Placement]]:
    return {"up.weight": _tp(mesh, Shard(0)), "up.bias": _tp(mesh, Shard(0)), "down.weight": _tp(mesh, Shard(1)),
            "down.bias": _tp(mesh, Replicate())}


def _all_shard0(mesh: DeviceMesh) -> dict[str, list[Placement]]:
    return {}     # every parameter not named: Shard(0) on every mesh dim


def _block_megatron(mesh: DeviceMesh) -> dict[str, list[Placement]]:
    col, row, rep = _tp(mesh, Shard(0)), _tp(mesh, Shard(1)), _tp(mesh, Replicate())
    return {"embed.weight": col, "q.weight": col, "k.weight": col, "v.weight": col, "o.weight": row,
            "o.bias": rep, "up.weight": col, "up.bias": col, "down.weight": row, "down.bias": rep,
            "head.weight": col, "norm1.weight": rep, "norm1.bias": rep, "norm2.weight": rep, "norm2.bias": rep}


def _distribute(model: nn.Module, mesh: DeviceMesh, plan: dict[str, list[Placement]]) -> None:
    """Replace every parameter by a DTensor parameter laid out as `plan` says (names unchanged)."""
    for name, param in list(model.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        placements = plan.get(name, [Shard(0)] * mesh.ndim)
        owner.register_parameter(attr, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))


def _train(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _check_parity(make_model: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor, plan: Plan,
                  mesh_shapes: list[tuple[int, ...]], batch_sharded: bool, fused: bool,
                  backend: str = "threads") -> None:
    torch.manual_seed(0)
    reference = make_model()
    trained = copy.deepcopy(reference)
    want_losses = _train(trained, inputs, targets, fused)

    def body(mesh: DeviceMesh) -> None:
        model = copy.deepcopy(reference)
        _distribute(model, mesh, plan(mesh))
        data = [Shard(0)] + [Replicate()] * (mesh.ndim - 1) if batch_sharded else [Replicate()] * mesh.ndim
        losses = _train(model, distribute_tensor(inputs, mesh, data), distribute_tensor(targets, mesh, data), fused)
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert isinstance(got, DTensor)
            torch.testing.assert_close(got.full_tensor(), want, rtol=RTOL, atol=ATOL, msg=lambda m, s=step:
                                       f"loss at step {s} on mesh {mesh.shape}: {m}")
        for (name, got), want in zip(model.named_parameters(), trained.parameters()):
            assert got.placements == distribute_tensor(want.detach(), mesh, plan(mesh).get(
                name, [Shard(0)] * mesh.ndim)).placements, f"{name} changed layout"
            torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n} on mesh {mesh.shape}: {m}")
    on_meshes(body, mesh_shapes, timeout=90, backend=backend)


@pytest.mark.parametrize(("plan", "batch_sharded", "fused"), [(_mlp_megatron, True, False), (_all_shard0, False, True)])
def test_mlp_matches_plain_training(plan: Plan, batch_sharded: bool, fused: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(10, 7, generator=generator)
    targets = torch.randint(0, 5, (10,), generator=generator)
    _check_parity(MLP, inputs, targets, plan, [(1,), (2,), (4,), (2, 2)], batch_sharded, fused)


@pytest.mark.parametrize(("plan", "batch_sharded", "fused"), [(_block_megatron, True, False),
                                                              (_all_shard0, False, True)])
def test_transformer_block_matches_plain_training(plan: Plan, batch_sharded: bool, fused: bool) -> None:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 13, (3, 6), generator=generator)
    targets = torch.randint(0, 13, (3, 6), generator=generator)
    _check_parity(Block, ids, targets, plan, [(2,), (2, 2)], batch_sharded, fused)


def test_transformer_block_over_tcp() -> None:
    """The same training with every collective over real sockets (the tcp transport), on a (2, 2) mesh."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 13, (3, 6), generator=generator)
    targets = torch.randint(0, 13, (3, 6), generator=generator)
    _check_parity(Block, ids, targets, _block_megatron, [(2, 2)], batch_sharded=True, fused=False, backend="tcp")

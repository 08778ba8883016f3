"""Context parallelism by module, TorchTitan's way (`_context_parallel_shard`, `_ContextParallel` applied with
parallelize_module, `_enable_context_parallel_dispatcher`): DTensor attention sharded on the sequence runs as
ring attention and matches one process, forward and backward, with the head-tail deal and the plain one, the
ring and the gathered blocks, and with heads sharded on a second mesh dim; a causal transformer trained this way
(DDP over the CP ranks) matches training on the whole sequence; torch's helpers give torch's answers (the
head-tail indices, `_is_causal_behavior`); misuse raises before anything is sent. torch's own CP has no CPU
attention kernel, so the single-process run is the oracle."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor
from spmd.tensor.experimental._attention import (
    _CausalBehavior,
    _context_parallel_shard,
    _ContextParallel,
    _cp_options,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _is_causal_behavior,
    context_parallel_unshard,
    set_rotate_method,
)
from spmd.tensor.parallel import parallelize_module
from spmd.testing import seeded
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
SDPA = _ContextParallel.AttentionType.SDPA


@pytest.fixture(params=["allgather", "alltoall"])
def dispatcher(request) -> Iterator[str]:
    """The context-parallel dispatcher on, with each rotate method; off again (and the load balance back on)
    afterwards."""
    set_rotate_method(request.param)
    _enable_context_parallel_dispatcher()
    try:
        yield request.param
    finally:
        _disable_context_parallel_dispatcher()
        set_rotate_method("allgather")
        _cp_options.enable_load_balance = True


class _Attention(nn.Module):
    """TorchTitan's inner attention module: nothing but the attention call."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _tensors(seq: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, seq, 4, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4)]


@pytest.mark.parametrize("balanced", [True, False])
def test_a_context_parallel_attention_module_matches_the_whole_sequence(balanced: bool, dispatcher: str) -> None:
    tensors = _tensors(16)
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    want.backward(tensors[3])

    def body(mesh) -> list[torch.Tensor]:
        attention = parallelize_module(_Attention(), mesh, _ContextParallel(seq_dim=2, attention_type=SDPA))
        balancer = _HeadTailLoadBalancer(16, mesh.size(), "cpu") if balanced else None
        local = _context_parallel_shard(mesh, tensors, [2] * 4, load_balancer=balancer)
        assert _cp_options.enable_load_balance is balanced
        q, k, v = (t.requires_grad_() for t in local[:3])
        out = attention(q, k, v)
        assert type(out) is torch.Tensor and out.shape == (2, 4, 4, 4)
        out.backward(local[3])
        return context_parallel_unshard(mesh, [out.detach(), q.grad, k.grad, v.grad], [2] * 4, balancer)

    for got in run_on_mesh((4,), body, timeout=TIMEOUT):
        torch.testing.assert_close(got[0], want.detach())
        torch.testing.assert_close(got[1:], [leaf.grad for leaf in leaves])


def test_heads_sharded_on_a_second_mesh_dim_compose_with_the_sequence_sharded_on_the_first(dispatcher: str) -> None:
    tensors = [t[:, :2] for t in _tensors(8)]           # as many query heads as key/value heads: H shards
    leaves = [t.clone().requires_grad_() for t in tensors[:3]]
    want = F.scaled_dot_product_attention(*leaves[:3], is_causal=True)
    want.backward(tensors[3])
    _cp_options.enable_load_balance = False

    def body(mesh) -> list[torch.Tensor]:
        placements = [Shard(2), Shard(1)]          # cp on mesh dim 0, heads over tp on mesh dim 1
        q, k, v, grad = (spmd.tensor.distribute_tensor(t, mesh, placements) for t in tensors)
        for t in (q, k, v):
            t.requires_grad_()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.placements == tuple(placements)
        out.backward(grad)
        return [x.full_tensor() for x in (out.detach(), q.grad, k.grad, v.grad)]

    for got in run_on_mesh((2, 2), body, timeout=TIMEOUT):
        torch.testing.assert_close(got[0], want.detach())
        torch.testing.assert_close(got[1:], [leaf.grad for leaf in leaves])


class _Block(nn.Module):
    """A one-block causal transformer with TorchTitan's layout: positions in, attention in its own module."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.attention = _Attention()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm1, self.norm2, self.head = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(positions)
        b, t, d = h.shape
        q, k, v = (x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for x in self.qkv(self.norm1(h)).chunk(3, dim=-1))
        h = h + self.proj(self.attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return self.head(h + self.mlp(self.norm2(h)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 32, (2, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(16).expand(2, 16)


def test_training_the_titan_way_matches_the_whole_sequence(dispatcher: str) -> None:
    with seeded(0):
        initial = _Block()

    def train(model: nn.Module, shard) -> tuple[list[float], list[torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            opt.zero_grad()
            inputs, labels, positions = shard(_batch(step))
            loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), labels.flatten())
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        return losses, [p.detach().clone() for p in model.parameters()]

    want_losses, want_params = train(copy.deepcopy(initial), lambda batch: batch)

    def body(mesh) -> tuple[list[float], list[torch.Tensor]]:
        model = copy.deepcopy(initial)
        parallelize_module(model.attention, mesh, _ContextParallel(seq_dim=2, attention_type=SDPA))
        model = spmd.DistributedDataParallel(model, process_group=mesh.get_group())
        balancer = _HeadTailLoadBalancer(16, mesh.size(), "cpu")
        losses, params = train(model, lambda batch: _context_parallel_shard(mesh, batch, (1, 1, 1), balancer))
        means = []
        for loss in losses:                  # each rank's loss is the mean over its tokens
            spmd.all_reduce(loss, group=mesh.get_group())
            means.append(loss / mesh.size())
        return means, params

    for losses, params in run_on_mesh((2,), body, timeout=TIMEOUT):
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)


def test_torchs_helpers_give_torchs_answers() -> None:
    from torch.distributed.tensor.experimental import _attention as torch_cp

    for size in (2, 3, 4):
        for restore in (False, True):
            ours = _HeadTailLoadBalancer(8 * size, size, "cpu")._generate_indices(restore)
            theirs = torch_cp._HeadTailLoadBalancer(8 * size, size, "cpu")._generate_indices(restore)
            assert ours.tolist() == theirs.tolist()
    saved = torch_cp._cp_options.enable_load_balance
    try:
        for balanced, causal, size in itertools.product([True, False], [True, False], [2, 3, 4]):
            _cp_options.enable_load_balance = torch_cp._cp_options.enable_load_balance = balanced
            for rank, step in itertools.product(range(size), range(size)):
                ours = _is_causal_behavior(rank, size, step, causal)
                assert ours.value == torch_cp._is_causal_behavior(rank, size, step, causal).value
                assert isinstance(ours, _CausalBehavior)
    finally:
        torch_cp._cp_options.enable_load_balance = saved
        _cp_options.enable_load_balance = True


def test_dict_buffers_and_per_row_deals_keep_their_form() -> None:
    class _Reversed(_HeadTailLoadBalancer):
        def _generate_indices(self, restore: bool = False) -> torch.Tensor:
            return torch.stack([torch.arange(8), torch.arange(7, -1, -1)])     # row 1 reversed

    def body(mesh) -> dict[str, torch.Tensor]:
        tokens = torch.arange(16).view(2, 8)
        return _context_parallel_shard(mesh, {"tokens": tokens, "ids": tokens.clone()}, {"tokens": 1, "ids": 1},
                                       _Reversed(8, 2, "cpu"))

    first, second = run_on_mesh((2,), body, timeout=TIMEOUT)
    assert first["tokens"].tolist() == [[0, 1, 2, 3], [15, 14, 13, 12]]
    assert second["ids"].tolist() == [[4, 5, 6, 7], [11, 10, 9, 8]]
    _cp_options.enable_load_balance = True


def test_misuse_raises_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="sequence is dim 2"):
        _ContextParallel(seq_dim=1, attention_type=SDPA)

    def body(mesh) -> None:
        attention = parallelize_module(_Attention(), mesh, _ContextParallel(seq_dim=2, attention_type=SDPA))
        q = torch.zeros(1, 1, 4, 2)
        with pytest.raises(RuntimeError, match=r"before _enable_context_parallel_dispatcher\(\)"):
            attention(q, q, q)
        with pytest.raises(ValueError, match="2 buffers but 1 sequence dims"):
            _context_parallel_shard(mesh, [q, q], [2])
        with pytest.raises(ValueError, match=r"a sequence of 5 .* does not divide over 2 ranks"):
            _context_parallel_shard(mesh, [torch.zeros(1, 5)], [1])
        with pytest.raises(TypeError, match=r"shards tensors and flex_attention's BlockMasks; got a str"):
            _context_parallel_shard(mesh, ["mask"], [0])
        # the dispatcher is process-wide: no thread rank turns it on (or off) while another still checks the
        # other state (a rank that saw it on would run the ring attention alone, waiting for its peer)
        spmd.barrier()
        _enable_context_parallel_dispatcher()
        try:
            replicated = DTensor.from_local(q, mesh, [Replicate()])
            with pytest.raises(ValueError, match=r"a DTensor argument placed \[Replicate\(\)\]"):
                attention(replicated, replicated, replicated)
        finally:
            spmd.barrier()
            _disable_context_parallel_dispatcher()

    run_on_mesh((2,), body, timeout=TIMEOUT)

    def two_d(mesh) -> None:
        with pytest.raises(ValueError, match="needs a 1-d"):
            parallelize_module(_Attention(), mesh, _ContextParallel(seq_dim=2, attention_type=SDPA))

        with pytest.raises(ValueError, match="1-D context-parallel mesh"):
            _context_parallel_shard(mesh, [torch.zeros(1, 8)], [1])

    run_on_mesh((2, 2), two_d, timeout=TIMEOUT)


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_accelerator_attention_ops_run_ring_attention_on_sequence_shards(kernel: str, causal: bool,
                                                                         dispatcher: str) -> None:
    """TorchTitan's context parallelism on CUDA reaches the flash, memory-efficient or cuDNN op with q, k and v
    sharded on the sequence: it runs as ring attention there too (see Note: attention on accelerator kernels).
    Their CUDA kernels don't exist on the CPU, but the ring's CPU block kernels do: the op's outputs and
    gradients equal the whole attention's."""
    _cp_options.enable_load_balance = False          # the sequence dealt in order, not head-tail
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(3)
    q, k, v, weights = (torch.randn(2, 4, 64, 8, generator=gen) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=causal)
    (want * weights).sum().backward()

    def body(mesh) -> list[torch.Tensor]:
        parts = [distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
        if kernel == "flash":
            out = aten._scaled_dot_product_flash_attention(*parts, 0.0, is_causal=causal)[0]
        elif kernel == "efficient":
            out = aten._scaled_dot_product_efficient_attention(*parts, None, True, 0.0, causal)[0]
        else:
            out = aten._scaled_dot_product_cudnn_attention(*parts, None, True, 0.0, causal)[0]
        assert out.placements == (Shard(2),)
        (out * distribute_tensor(weights, mesh, [Shard(2)])).sum().backward()
        return [out.full_tensor(), *(p.grad.full_tensor() for p in parts)]

    for got in run_on_mesh((2,), body, timeout=TIMEOUT):
        for value, expected in zip(got, [want, *(t.grad for t in whole)], strict=True):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [64, 24])
def test_the_memory_efficient_op_rings_only_when_its_padded_rows_shard_as_the_sequence(
        length: int, dispatcher: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its log-sum-exp pads the rows to a multiple of 32: a sequence of 64 rings, one of 24 is resharded onto the
    batch instead (on meta tensors: the op's CUDA kernel doesn't exist on the CPU)."""
    from spmd.tensor import DeviceMesh
    from spmd.testing import run_ranks
    from tests.meta_device import MetaTransport, register_fake_transports

    register_fake_transports(monkeypatch)

    def body(rank: int, size: int) -> tuple:
        mesh = DeviceMesh("meta", list(range(size)))
        q = distribute_tensor(torch.empty(2, 4, length, 8, device="meta"), mesh, [Shard(2)])
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, False)
        return out.placements, lse.placements

    want = (Shard(2),) if length % 32 == 0 else (Shard(0),)
    assert run_ranks(body, 2, backend=MetaTransport.name, timeout=TIMEOUT) == [(want, want)] * 2

"""Context parallelism (torch's `tensor.experimental.context_parallel`): attention over a sequence split across
ranks matches attention over the whole sequence in one process, forward and backward, with the blocks gathered
and passed around the ring, for causal and full attention, the head-tail deal and the plain one, grouped-query
heads and nn.MultiheadAttention; a small causal transformer trained with CP (and DDP over the CP ranks) matches
training on the whole sequence; buffers are sliced and restored; bad arguments raise before anything is sent.
torch's own CP has no CPU attention kernel (it serves flash, efficient and cuDNN attention only), so the
single-process run is the oracle."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd.tensor.experimental import context_parallel
from spmd.tensor.experimental._attention import _cp_options, context_parallel_unshard, set_rotate_method
from spmd.tensor.experimental.load_balancer import _HeadTailLoadBalancer
from tests.tensor.conftest import run_on_mesh

TIMEOUT = 60
SDPA = F.scaled_dot_product_attention


def _qkv(seq: int, heads: int = 2, kv_heads: int = 2, dim: int = 4, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, seq, dim, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]


def _reference(tensors: list[torch.Tensor], grad: torch.Tensor, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = SDPA(*leaves, **kwargs)
    out.backward(grad)
    return out.detach(), [leaf.grad for leaf in leaves]


def _sharded_attention(mesh, tensors: list[torch.Tensor], grad: torch.Tensor, **kwargs):
    """Attention and its input gradients with the sequence (dim 2) split over `mesh`, gathered back in order."""
    buffers = [t.clone() for t in (*tensors, grad)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
        leaves = [b.clone().requires_grad_() for b in buffers[:3]]
        out = F.scaled_dot_product_attention(*leaves, **kwargs)
        out.backward(buffers[3])
        return context_parallel_unshard(mesh, [out.detach(), *(leaf.grad for leaf in leaves)], [2] * 4)


@pytest.fixture(params=["allgather", "alltoall"])
def rotate_method(request) -> Iterator[str]:
    """Each test that takes it runs once with the gathered blocks and once with the ring pass."""
    set_rotate_method(request.param)
    try:
        yield request.param
    finally:
        set_rotate_method("allgather")


@pytest.mark.parametrize(("ranks", "seq", "causal"), [(2, 8, True), (4, 16, True), (3, 12, True), (2, 6, True),
                                                      (3, 9, True), (2, 8, False), (4, 12, False)])
def test_attention_over_a_split_sequence_matches_the_whole(ranks: int, seq: int, causal: bool,
                                                           rotate_method: str) -> None:
    # seq 6 over 2 ranks and 9 over 3 do not split into 2n chunks: the plain deal (rank r holds the r-th slice).
    tensors = _qkv(seq)
    grad = torch.randn(2, 2, seq, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, grads = _reference(tensors, grad, is_causal=causal)
    for got in run_on_mesh((ranks,), lambda mesh: _sharded_attention(mesh, tensors, grad, is_causal=causal),
                           timeout=TIMEOUT):
        torch.testing.assert_close(got[0], out)
        torch.testing.assert_close(got[1:], grads)


def test_grouped_query_heads_a_scale_and_load_balance_off_match_the_whole(rotate_method: str) -> None:
    tensors = _qkv(8, heads=4, kv_heads=2)
    grad = torch.randn(2, 4, 8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kwargs = {"is_causal": True, "scale": 0.3, "enable_gqa": True}
    out, grads = _reference(tensors, grad, **kwargs)
    _cp_options.enable_load_balance = False
    try:
        results = run_on_mesh((2,), lambda mesh: _sharded_attention(mesh, tensors, grad, **kwargs), timeout=TIMEOUT)
    finally:
        _cp_options.enable_load_balance = True
    for got in results:
        torch.testing.assert_close(got[0], out)
        torch.testing.assert_close(got[1:], grads)


def test_the_head_tail_deal_gives_rank_r_chunks_r_and_2n_minus_1_minus_r() -> None:
    balancer = _HeadTailLoadBalancer(8, 2, "cpu")
    assert balancer._generate_indices().tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    dealt = torch.arange(8)[balancer._generate_indices()[0]]
    assert dealt[balancer._generate_indices(restore=True)[0]].tolist() == list(range(8))

    def body(mesh) -> list[int]:
        tokens = torch.arange(8).unsqueeze(0)
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
            return tokens[0].tolist()

    assert run_on_mesh((2,), body, timeout=TIMEOUT) == [[0, 1, 6, 7], [2, 3, 4, 5]]


def test_multihead_attention_modules_attend_over_the_whole_sequence() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 8, 8)
    want = mha(x, x, x, need_weights=False)[0]

    def body(mesh) -> torch.Tensor:
        local_x = x.clone()
        with context_parallel(mesh, buffers=[local_x], buffer_seq_dims=[1]):
            out = mha(local_x, local_x, local_x, need_weights=False)[0]
            return context_parallel_unshard(mesh, [out.detach()], [1])[0]

    for got in run_on_mesh((2,), body, timeout=TIMEOUT):
        torch.testing.assert_close(got, want.detach())


class _CausalLM(nn.Module):
    """A one-block causal transformer whose positions come in as a tensor (so CP can deal them out)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        # No qkv bias: the key bias gets a gradient of zero in exact arithmetic (softmax ignores a shift shared
        # by all keys), rounding noise that AdamW would blow up into a full-size step.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm1, self.norm2, self.head = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(positions)
        b, t, d = h.shape
        q, k, v = (x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for x in self.qkv(self.norm1(h)).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(attended)
        return self.head(h + self.mlp(self.norm2(h)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: nn.Module, step_fn) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        opt.zero_grad()
        losses.append(step_fn(model, *_batch(step)))
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_training_a_causal_transformer_with_context_parallel_matches_the_whole_sequence(rotate_method: str) -> None:
    def whole(model, inputs, labels) -> float:
        positions = torch.arange(16).expand(2, 16)
        loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.item()

    torch.manual_seed(0)
    initial = _CausalLM()
    want_losses, want_params = _train(copy.deepcopy(initial), whole)

    def body(mesh) -> tuple[list[float], list[torch.Tensor]]:
        model = spmd.DistributedDataParallel(copy.deepcopy(initial), process_group=mesh.get_group())

        def sharded(model, inputs, labels) -> float:
            positions = torch.arange(16).expand(2, 16).clone()
            inputs, labels = inputs.clone(), labels.clone()
            with context_parallel(mesh, buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers={inputs, labels, positions}):
                loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), labels.flatten())
                loss.backward()     # DDP averages the ranks' gradients: each holds the mean over its tokens
            total = loss.detach().clone()
            spmd.all_reduce(total, group=mesh.get_group())
            return total.item() / mesh.size()

        return _train(model, sharded)

    for losses, params in run_on_mesh((2,), body, timeout=TIMEOUT):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params, want_params, rtol=1e-5, atol=1e-6)


def test_buffers_get_their_contents_back_and_attention_is_torchs_again_after_the_context() -> None:
    def body(mesh) -> None:
        kept, sliced = torch.arange(8.0).view(1, 8), torch.arange(8.0).view(8, 1)
        with context_parallel(mesh, buffers=[kept, sliced], buffer_seq_dims=[1, 0], no_restore_buffers={sliced}):
            assert kept.shape == (1, 4) and sliced.shape == (4, 1)
            assert F.scaled_dot_product_attention is not SDPA
        torch.testing.assert_close(kept, torch.arange(8.0).view(1, 8))
        assert sliced.shape == (4, 1)
        q = torch.randn(1, 1, 4, 2)      # outside the context, this rank's attention is local again
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), SDPA(q, q, q))

    run_on_mesh((2,), body, timeout=TIMEOUT)
    assert F.scaled_dot_product_attention is SDPA


def test_bad_arguments_raise_before_anything_is_sent() -> None:
    def body(mesh) -> None:
        x = torch.zeros(1, 8)
        with pytest.raises(ValueError, match="2 buffers but 1 sequence dims"):
            with context_parallel(mesh, buffers=[x, x.clone()], buffer_seq_dims=[1]):
                pass
        with pytest.raises(ValueError, match=r"sequence lengths differ \(\[6, 8\]\)"):
            with context_parallel(mesh, buffers=[x, torch.zeros(6)], buffer_seq_dims=[1, 0]):
                pass
        with pytest.raises(ValueError, match="does not divide over 2 ranks"):
            with context_parallel(mesh, buffers=[torch.zeros(7)], buffer_seq_dims=[0]):
                pass
        with pytest.raises(ValueError, match="subset"):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], no_restore_buffers={torch.zeros(8)}):
                pass
        with pytest.raises(ValueError, match="Parameter"):
            with context_parallel(mesh, buffers=[nn.Parameter(torch.zeros(8))], buffer_seq_dims=[0]):
                pass
        q = torch.zeros(1, 1, 4, 2)
        with context_parallel(mesh, buffers=[torch.zeros(8)], buffer_seq_dims=[0]):
            with pytest.raises(NotImplementedError, match=r"mesh rank \d: an explicit attn_mask is not served"):
                F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
            with pytest.raises(ValueError, match="same slice of one sequence"):
                F.scaled_dot_product_attention(q, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
            with pytest.raises(NotImplementedError, match=r"dropout_p=0\.1 is not served"):
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
            grouped = torch.zeros(1, 2, 4, 2)
            with pytest.raises(ValueError, match="need enable_gqa=True"):
                F.scaled_dot_product_attention(grouped, q, q)
        assert x.shape == (1, 8)

    run_on_mesh((2,), body, timeout=TIMEOUT)

    def two_d(mesh) -> None:
        with pytest.raises(ValueError, match="1-D mesh"):
            with context_parallel(mesh, buffers=[torch.zeros(8)], buffer_seq_dims=[0]):
                pass

    run_on_mesh((2, 2), two_d, timeout=TIMEOUT)
    with pytest.raises(NotImplementedError, match=r"'ring' is not one of \['allgather', 'alltoall'\]"):
        set_rotate_method("ring")

"""A Llama-style decoder (RMSNorm, rotary position embedding, grouped-query attention, SwiGLU feed-forward), with
the module names of the model in torch's tensor-parallel tutorial, so the tutorial's plan applies unchanged.

Model code only: nothing here knows about parallelism (see STYLE rule 5). Attention reads its head counts from
`n_heads` / `n_kv_heads` at call time; a tensor-parallel plan that shards wq/wk/wv divides them by the
tensor-parallel size, as the tutorial does. Shape letters: B batch, S sequence, D width, V vocabulary,
N heads, K key/value heads, E head width.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None     # None: as many as n_heads
    vocab_size: int = 4096
    multiple_of: int = 64             # the SwiGLU hidden width is rounded up to a multiple of this
    norm_eps: float = 1e-5
    max_seq_len: int = 128
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(head_dim: int, length: int, theta: float) -> Tensor:
    """(S, E/2) complex rotations e^(i s w_j), w_j = theta^(-2j/E)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: Tensor, table: Tensor) -> Tensor:
    """x (B, S, N, E) rotated pairwise by table (S, E/2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1))
    return rotated.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        repeat = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = int(2 * 4 * args.dim / 3)
        hidden = args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (B, S) -> logits (B, S, V)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rotary", rotary_table(args.dim // args.n_heads, args.max_seq_len, args.rope_theta),
                             persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        table = self.rotary[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, table)
        return self.output(self.norm(h)).float()

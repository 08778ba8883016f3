"""Small models shared by the parity tests: an MLP, a CNN with BatchNorm, and a GPT-style decoder.

Branchy and Reentrant exercise unused parameters and gradients arriving in nested (reentrant) backwards.
Sizes are odd on purpose (7, 15, 13 ...) so nothing divides evenly by 2 or 4 ranks by accident. Every builder
takes a seed, so the single-process reference and each rank build bit-identical initial weights.
Shape letters: B batch, S sequence, H hidden, V vocabulary, C channels.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from spmd.testing import seeded


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (7, 15, 13, 3), unused_branch: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        # A layer the forward skips (for find_unused_parameters tests).
        self.skipped = nn.Linear(dims[0], dims[-1]) if unused_branch else None

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


class CNN(nn.Module):
    """Conv + BatchNorm (a buffer DDP broadcasts) + pooling + linear head; input (B, 3, 9, 9)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 7, 3)
        self.head = nn.Linear(7 * 3 * 3, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.norm(self.conv1(x)))          # (B, 6, 9, 9)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)    # (B, 7, 3, 3)
        return self.head(x.flatten(1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)                          # (B, S, H) each
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)             # (B, heads, S, H/heads)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder with tied input/output embeddings; tokens (B, S) -> logits (B, S, V)."""

    def __init__(self, vocab: int = 37, width: int = 24, heads: int = 4, layers: int = 2, context: int = 16,
                 checkpoint_blocks: str | None = None) -> None:
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks    # recompute each block in backward: "reentrant" or "non-reentrant"
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) / math.sqrt(width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]                 # (B, S, H)
        for block in self.blocks:
            if self.checkpoint_blocks is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpoint_blocks == "reentrant")
        return self.ln(x) @ self.embed.weight.t()                                 # (B, S, V)


class Branchy(nn.Module):
    """An MLP whose `extra` layer only rank 0 uses and whose `never` layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP((7, 9, 3))
        self.extra = nn.Linear(7, 3)
        self.never = nn.Linear(7, 3)

    def forward(self, x: Tensor, use_extra: bool) -> Tensor:
        out = self.body(x)
        return out + self.extra(x) if use_extra else out


class Reentrant(nn.Module):
    """Uses `shared` twice, once inside reentrant checkpointing: its gradient arrives in two backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(7, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.shared(x))
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(x)




def build(kind: str, seed: int = 0, **kwargs: object) -> nn.Module:
    """A model of `kind` initialized from `seed` (thread-safe: thread ranks build concurrently)."""
    with seeded(seed):
        return {"mlp": MLP, "cnn": CNN, "gpt": TinyGPT, "branchy": Branchy, "reentrant": Reentrant}[kind](**kwargs)


def batch(kind: str, size: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """A global batch (inputs, targets) for `kind`, deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("mlp", "branchy", "reentrant"):
        return torch.randn(size, 7, generator=gen), torch.randn(size, 3, generator=gen)
    if kind == "cnn":
        return torch.randn(size, 3, 9, 9, generator=gen), torch.randint(0, 5, (size,), generator=gen)
    tokens = torch.randint(0, 37, (size, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(kind: str, output: Tensor, target: Tensor) -> Tensor:
    if kind in ("mlp", "branchy", "reentrant"):
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

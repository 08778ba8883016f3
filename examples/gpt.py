"""A GPT-style decoder (pre-norm transformer blocks, causal self-attention, untied output head).

Model code only: nothing here knows about parallelism (see STYLE rule 5); train_gpt.py wraps it.
Shape letters: B batch, S sequence (<= context), H width, V vocabulary, N heads.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256          # V: byte-level tokens by default
    context: int = 128        # longest sequence the position table covers
    layers: int = 4
    width: int = 256          # H
    heads: int = 4            # N; must divide width

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"GPTConfig: heads ({self.heads}) must divide width ({self.width})")
        if min(self.vocab, self.context, self.layers, self.width, self.heads) < 1:
            raise ValueError(f"GPTConfig: every size must be positive, got {self}")


class SelfAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections. The head count is read from q's width, so under
    tensor parallelism (q/k/v sharded by output features) each rank runs its own heads unchanged."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_width = config.width // config.heads
        self.q = nn.Linear(config.width, config.width)
        self.k = nn.Linear(config.width, config.width)
        self.v = nn.Linear(config.width, config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_width).transpose(1, 2)                # (B, N, S, H/N)
                   for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)               # (B, N, S, H/N)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))                     # (B, S, H)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """tokens (B, S) -> logits (B, S, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        self.apply(self._init)
        for block in self.blocks:   # GPT-2's scaling: residual branches add up over 2 * layers
            for proj in (block.attn.proj, block.down):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)                         # (B, S, H)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))                                              # (B, S, V)

    @torch.no_grad()
    def generate(self, tokens: Tensor, new_tokens: int, temperature: float = 0.8, top_k: int = 40,
                 generator: torch.Generator | None = None) -> Tensor:
        """Append `new_tokens` sampled tokens to `tokens` (B, S), feeding at most `context` tokens back."""
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.config.context:])[:, -1] / temperature   # (B, V)
            if top_k < logits.shape[-1]:
                cutoff = logits.topk(top_k).values[:, -1:]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            choice = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, choice], dim=1)
        return tokens


def loss_of(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of `model` on (B, S) tokens against (B, S) targets."""
    logits = model(tokens)                                                        # (B, S, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

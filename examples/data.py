"""The training corpus: the Python standard library's own source, read from the running interpreter.

No download: every Python installation carries a few tens of MB of .py files. Tokens are bytes (vocabulary
256), so no tokenizer needs training. Batches are random windows; train_gpt.py draws a whole global batch's
starts from a generator seeded by (seed, step) and each data-parallel rank takes its slice, reproducibly and
the same under every parallel layout.
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch
from torch import Tensor


def stdlib_corpus(max_bytes: int) -> bytes:
    """Up to `max_bytes` of standard-library source, files in sorted path order (the same on every rank)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files found under {root}; is this a full Python installation?")
    return b"".join(chunks)[:max_bytes]


class Corpus:
    """Byte tokens split into train (first 95%) and validation (last 5%), kept as bytes (a batch's windows become
    int64 token ids when drawn, not the whole corpus: 8x less memory on every rank)."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        tokens = torch.frombuffer(bytearray(stdlib_corpus(max_bytes)), dtype=torch.uint8)
        cut = int(len(tokens) * 0.95)
        self.splits = {"train": tokens[:cut], "val": tokens[cut:]}

    def batch(self, split: str, batch_size: int, context: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """`batch_size` random windows: tokens (B, S) and the next-token targets (B, S)."""
        return self.windows(split, self.starts(split, batch_size, context, generator), context)

    def starts(self, split: str, batch_size: int, context: int, generator: torch.Generator) -> Tensor:
        """`batch_size` random window starts (B,): cheap to draw for a whole global batch on every rank."""
        return torch.randint(0, len(self.splits[split]) - context - 1, (batch_size,), generator=generator)

    def windows(self, split: str, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
        """The windows at `starts` (B,): tokens (B, S) and the next-token targets (B, S)."""
        data = self.splits[split]
        windows = torch.stack([data[start:start + context + 1] for start in starts.tolist()]).long()   # (B, S + 1)
        return windows[:, :-1], windows[:, 1:]


def decode(tokens: Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def encode(text: str) -> Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

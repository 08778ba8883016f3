"""What the trainer predicts and measures about a run: memory per rank (predicted from the layout and the
model's shapes, measured as peak live tensor bytes), model FLOPs per token, and the machine's matmul peak.

Note: the memory prediction
Per rank, in bytes, for the GPT of gpt.py (B sequences per microbatch, S context, H width, V vocabulary, t TP
degree, L blocks on this rank, AdamW):
- parameters: this rank's local pieces (DTensor shards under FSDP and TP, its stages under PP), as laid out;
- gradients: the same size (fp32, whatever the compute dtype); optimizer state: twice that (exp_avg and
  exp_avg_sq);
- FSDP's gathered parameters: the root's group (embeddings, final norm, head), unsharded through the whole step,
  plus two blocks' at a time (the one running and the one prefetched), in the compute dtype, and one block's
  unsharded fp32 gradients before their reduce-scatter;
- activations, what autograd keeps for backward, per block and microbatch: the norms' inputs and outputs and the
  residual (4 BSH, or under sequence parallelism 2 BSH of gathered inputs plus 4 BSH/t of sequence shards), and
  the tensor-parallel slices q, k, v, the attention output (proj's input), the MLP's up projection and GELU
  output (12 BSH/t); on the last stage the final norm's input and output (2 BSH) and the loss's log-softmax
  (fp32 BSV, or BSV/t with loss parallelism). With activation
  checkpointing a block keeps only its input, and one block's activations exist again during its recomputation.
  A pipeline rank holds the activations of the microbatches in flight: all of them under GPipe and LoopedBFS,
  at most pp - (its rank) per stage under the 1F1B family.
Temporaries (the backward's gradient buffers, the optimizer's foreach intermediates, communication buffers) are
not predicted: the measured peak exceeds the prediction by them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch
from gpt import Block, GPTConfig
from parallelize import Layout
from torch import Tensor, nn

import spmd
from spmd.tensor import DTensor
from spmd.testing.memory import TensorMemoryTracker, storage_key

MiB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category (see Note: the memory prediction)."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int       # FSDP's unsharded parameters and gradients in flight
    activations: int
    data: int           # the training corpus, which every rank holds

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.data

    def describe(self) -> str:
        return (f"{self.total / MiB:.1f} MiB per rank (parameters {self.parameters / MiB:.1f}, gradients "
                f"{self.gradients / MiB:.1f}, optimizer {self.optimizer / MiB:.1f}"
                + (f", FSDP gathered {self.gathered / MiB:.1f}" if self.gathered else "")
                + f", activations {self.activations / MiB:.1f}, data {self.data / MiB:.1f})")


def local_bytes(tensor: Tensor) -> int:
    """The bytes of this rank's piece of `tensor`."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def predict_memory(parts: dict[int, nn.Module], config: GPTConfig, layout: Layout, microbatch: int,
                   pp_rank: int, data: Iterable[Tensor]) -> MemoryEstimate:
    """The prediction for this rank's `parts` (stage index -> laid-out module) running microbatches of
    `microbatch` sequences, holding the corpus tensors `data`."""
    params = [p for part in parts.values() for p in part.parameters()]
    parameters = sum(local_bytes(p) for p in params)
    compute_bytes = 2 if layout.mixed_precision == "bf16" else 4
    B, S, H, V, t = microbatch, config.context, config.width, config.vocab, layout.tp
    blocks = sum(isinstance(module, Block) for part in parts.values() for module in part.modules())
    block_params = 12 * H * H + 13 * H                   # q, k, v, proj, up, down weights and biases, two norms
    gathered = 0
    if layout.uses_fsdp:
        last_stage = any(s == layout.pp * layout.stages_per_rank - 1 for s in parts)
        root = ((V + S) * H if 0 in parts else 0) + ((H * V + 2 * H) if last_stage else 0)
        gathered = (root + 2 * block_params // t) * compute_bytes + (block_params // t) * 4
    if layout.sequence_parallel:
        per_block = 2 * B * S * H + 4 * B * S * H // t
    else:
        per_block = 4 * B * S * H
    per_block = (per_block + 12 * B * S * H // t) * compute_bytes
    kept = blocks * (B * S * H * compute_bytes // (t if layout.sequence_parallel else 1)) + per_block \
        if layout.activation_checkpointing else blocks * per_block
    if any(s == layout.pp * layout.stages_per_rank - 1 for s in parts):
        kept += 2 * B * S * H * compute_bytes + (B * S * V // t if layout.loss_parallel else B * S * V) * 4
    activations = kept * in_flight_microbatches(layout, pp_rank)
    return MemoryEstimate(parameters, parameters, 2 * parameters, gathered, activations,
                          sum(local_bytes(tensor) for tensor in data))


def in_flight_microbatches(layout: Layout, pp_rank: int) -> int:
    """How many microbatches' activations a rank holds at once (1 without pipelining)."""
    if layout.pp == 1:
        return 1
    if layout.pp_schedule in ("GPipe", "LoopedBFS"):
        return layout.n_microbatches
    return min(layout.n_microbatches, layout.pp - pp_rank)


def flops_per_token(config: GPTConfig) -> int:
    """Model FLOPs of a training step per token (forward and backward): 6 per matmul weight, and attention's
    12 x layers x width x context (PaLM's count; recomputation is not counted)."""
    H = config.width
    matmul_weights = config.layers * 12 * H * H + H * config.vocab
    return 6 * matmul_weights + 12 * config.layers * H * config.context


def measure_matmul_peak(trials: int = 5, seconds: float = 0.04, size: int = 512) -> float:
    """This rank's fp32 matmul FLOP/s with its torch threads, measured while the other ranks measure theirs (so
    that together they are the machine's peak as this job shares it): the best of `trials` short runs, so that
    a moment of load from elsewhere on the machine doesn't lower it. Collective over the world."""
    generator = torch.Generator().manual_seed(0)     # not torch's global RNG, which thread ranks share
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    torch.mm(a, b)
    spmd.barrier()
    best = 0.0
    for _ in range(trials):
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            torch.mm(a, b)
            count += 1
        best = max(best, 2 * size ** 3 * count / (time.perf_counter() - started))
    return best


class MeasuredMemory:
    """Peak live tensor bytes of this rank over what runs inside `with`, split into parameters, gradients,
    optimizer state and the rest (activations, temporaries, communication buffers)."""

    def __init__(self, parameters: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer,
                 data: Iterable[Tensor]) -> None:
        self.parameters, self.optimizer, self.data = list(parameters), optimizer, list(data)
        self.tracker = TensorMemoryTracker(classify=self._classify)

    def _classify(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for category, tensors in (("parameters", self.parameters),
                                  ("gradients", [p.grad for p in self.parameters if p.grad is not None]),
                                  ("optimizer", [v for state in self.optimizer.state.values()
                                                 for v in state.values() if isinstance(v, Tensor)]),
                                  ("data", self.data)):
            for tensor in tensors:
                key = storage_key(tensor)
                if key is not None:
                    names.setdefault(key, category)
        return names

    def __enter__(self) -> MeasuredMemory:
        self.tracker.__enter__()
        self.tracker.track(self.parameters)
        self.tracker.track(p.grad for p in self.parameters if p.grad is not None)
        self.tracker.track(self.optimizer.state.values())
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.__exit__(*exc)

    @property
    def peak(self) -> int:
        return self.tracker.peak_bytes

    def describe(self) -> str:
        breakdown = self.tracker.peak_breakdown
        parts = ", ".join(f"{name} {breakdown[name] / MiB:.1f}"
                          for name in ("parameters", "gradients", "optimizer", "data") if name in breakdown)
        parts += f", activations and temporaries {breakdown.get('other', 0) / MiB:.1f}"
        return f"{self.peak / MiB:.1f} MiB per rank ({parts})"

"""How train_gpt.py lays the GPT of gpt.py out on one DeviceMesh: data (DDP, FSDP2, HSDP), tensor (+ sequence
and loss) and pipeline parallelism, alone or composed, in the spirit of TorchTitan's parallelize_llama.

The mesh has the dims ("pp", "dp_replicate", "dp_shard", "tp"), size-1 dims kept (so a slice by name always
exists). `parallelize` applies, in this order (TorchTitan's, and for the same reasons):
  1. pipeline split: this rank's stages (blocks cut into contiguous parts; embeddings on the first, norm and
     head on the last), each a module keeping the model's parameter names (STYLE rule 13);
  2. tensor parallelism on mesh["tp"], per block: q, k, v, up colwise, proj and down rowwise (+ the norms
     sequence parallel, the head colwise with vocab-sharded logits for the loss-parallel cross-entropy);
  3. activation checkpointing, then torch.compile, per block (both wrap the block's own forward: FSDP's hooks
     on the block stay outside, parameter names unchanged; under TP the DTensor ops run eagerly between the
     compiled plain-tensor pieces: spmd.tensor.api, Note: DTensors under torch.compile);
  4. data parallelism last, on the already tensor-parallel parameters: fully_shard per block and then the root
     (the stage module under PP) over mesh["dp_shard"] (FSDP) or mesh["dp_replicate", "dp_shard"] (HSDP), or,
     when nothing is sharded, DDP over mesh["dp_replicate"] (over TP too: Megatron's TP x DP, each rank's
     DTensor shards averaged over their replicas).
`ParallelGPT` then runs a step (microbatched through a pipeline schedule under PP, gradient accumulation
otherwise), the validation loss, clipping over sharded gradients, and the full model for sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import spmd
from spmd.device_mesh import DeviceMesh, init_device_mesh
from spmd.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from spmd.pipelining import PipelineStage, get_schedule_class, stage_to_rank
from spmd.pipelining.programs import placement_of
from spmd.tensor import DTensor, Replicate, Shard
from spmd.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
PP_SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dim spans, and the options of the parallelisms on them."""

    pp: int = 1                       # pipeline stages' ranks
    dp_replicate: int = 1             # data-parallel replicas (DDP, or HSDP's replicate dim)
    dp_shard: int = 1                 # data-parallel ranks parameters are sharded over (FSDP2)
    tp: int = 1                       # tensor-parallel ranks
    sequence_parallel: bool = False   # norms on sequence shards between tensor-parallel layers
    loss_parallel: bool = False       # cross-entropy on vocab-sharded logits, never gathered
    pp_schedule: str = "1F1B"
    microbatches: int = 0             # microbatches per pipeline step; 0: two per pipeline rank
    mixed_precision: str = "none"     # "none" or "bf16"
    activation_checkpointing: bool = False
    compile: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.pp_schedule.lower() in (s.lower() for s in SINGLE_STAGE_SCHEDULES) else 2

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    def describe(self) -> str:
        """'PP 2 (1F1B, 4 microbatches) x FSDP 2 x TP 2 +SP', or 'DDP 2'."""
        parts = []
        if self.pp > 1:
            parts.append(f"PP {self.pp} ({self.pp_schedule}, {self.n_microbatches} microbatches)")
        if self.dp_shard > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else
                         f"FSDP {self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"DDP {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + "".join(f" +{flag}" for flag, on in (
                ("SP", self.sequence_parallel), ("loss parallel", self.loss_parallel)) if on))
        return " x ".join(parts) or "one rank"

    def check(self, world_size: int, config: GPTConfig, dp_batch: int) -> None:
        """Refuse, before any communication, a layout this world, model or batch can't take."""
        if min(self.shape) < 1:
            raise ValueError(f"every parallel degree must be at least 1, got --pp {self.pp} --dp-replicate "
                             f"{self.dp_replicate} --dp-shard {self.dp_shard} --tp {self.tp}")
        if math.prod(self.shape) != world_size:
            raise ValueError(f"--pp {self.pp} x --dp-replicate {self.dp_replicate} x --dp-shard {self.dp_shard} x "
                             f"--tp {self.tp} = {math.prod(self.shape)} ranks, but the world has {world_size}; "
                             f"choose degrees whose product is {world_size}")
        if self.tp > 1 and config.heads % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --heads {config.heads} (each rank runs whole heads)")
        if (self.sequence_parallel or self.loss_parallel) and self.tp == 1:
            raise ValueError("--sequence-parallel and --loss-parallel need tensor parallelism: add --tp N (N > 1)")
        if self.sequence_parallel and config.context % self.tp:
            raise ValueError(f"--sequence-parallel: --tp {self.tp} must divide --context {config.context}")
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(f"--mixed-precision {self.mixed_precision}: choose none or bf16")
        if self.pp == 1:
            return
        if self.pp_schedule.lower() not in (s.lower() for s in PP_SCHEDULES):
            raise ValueError(f"--pp-schedule {self.pp_schedule}: choose one of {', '.join(PP_SCHEDULES)}")
        stages = self.pp * self.stages_per_rank
        if config.layers < stages:
            raise ValueError(f"--pp {self.pp} with {self.pp_schedule} ({self.stages_per_rank} stage(s) per rank) "
                             f"needs at least {stages} layers, the model has {config.layers}")
        if dp_batch % self.n_microbatches:
            raise ValueError(f"--microbatches {self.n_microbatches} must divide the {dp_batch} sequences each "
                             f"data-parallel rank runs per step (batch-size x grad-accum)")

    @property
    def uses_fsdp(self) -> bool:
        """fully_shard carries the data parallelism: something is sharded (DDP replicates otherwise)."""
        return self.dp_shard > 1


def build_mesh(layout: Layout) -> DeviceMesh:
    """The one mesh every parallelism slices by name (collective over the world)."""
    return init_device_mesh("cpu", layout.shape, mesh_dim_names=MESH_DIMS)


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This rank's data-parallel coordinate: which shard of the global batch it trains on (its TP and PP peers
    train on the same one)."""
    return mesh.get_local_rank("dp_replicate") * mesh.size("dp_shard") + mesh.get_local_rank("dp_shard")


# -- pipeline split ------------------------------------------------------------------------------------------

class GPTStage(nn.Module):
    """The blocks `blocks` of `model`, with its embeddings on the first stage and its norm and head on the last,
    keeping the model's parameter names ("blocks.3.up.weight" stays that)."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed, self.position = (model.embed, model.position) if first else (None, None)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        self.ln, self.head = (model.ln, model.head) if last else (None, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))    # (B, S, H)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None else x


class MergedStages(nn.Module):
    """Several stages of one pipeline rank as one module of the same submodules (not copies), with the model's
    parameter names: one state dict and one optimizer state dict cover them all."""

    def __init__(self, stages: list[GPTStage]) -> None:
        super().__init__()
        for name in ("embed", "position", "ln", "head"):
            owner = next((stage for stage in stages if getattr(stage, name) is not None), None)
            if owner is not None:
                setattr(self, name, getattr(owner, name))
        self.blocks = nn.ModuleDict({index: block for stage in stages for index, block in stage.blocks.items()})


def split_into_stages(model: GPT, layout: Layout, pp_rank: int) -> dict[int, GPTStage]:
    """This pipeline rank's stages by index: the blocks cut into pp x stages-per-rank contiguous runs (the
    earlier ones one block longer when they don't divide), placed as the schedule wants ('loop' or 'v')."""
    num_stages = layout.pp * layout.stages_per_rank
    placement = stage_to_rank(layout.pp, num_stages, placement_of(layout.pp_schedule))
    sizes = [len(chunk) for chunk in torch.arange(model.config.layers).tensor_split(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages + 1)]
    return {s: GPTStage(model, range(starts[s], starts[s + 1]), s == 0, s == num_stages - 1)
            for s in range(num_stages) if placement[s] == pp_rank}


# -- tensor parallelism --------------------------------------------------------------------------------------

def apply_tensor_parallel(module: GPT | GPTStage, tp_mesh: DeviceMesh, layout: Layout) -> None:
    """Megatron's plan on every block of `module` (a whole GPT or one stage). The embeddings stay replicated;
    under sequence parallelism the residual stream between blocks is each rank's slice of the sequence (a
    plain tensor, so it can cross a pipeline stage), cut at the first block and gathered by the head."""
    sp = layout.sequence_parallel
    block_plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                  "attn.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                  "up": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
                  "down": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
    if sp:
        block_plan |= {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                       "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    for index, block in _blocks(module):
        parallelize_module(block, tp_mesh, block_plan)
        if sp and index == 0:   # the embeddings' output (replicated) -> this rank's slice of the sequence
            parallelize_module(block, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    if module.head is not None:
        head_input = Shard(1) if sp else Replicate()
        if sp:
            parallelize_module(module.ln, tp_mesh, SequenceParallel())
        parallelize_module(module.head, tp_mesh, ColwiseParallel(
            input_layouts=head_input, output_layouts=Shard(-1) if layout.loss_parallel else Replicate()))


def _blocks(module: GPT | GPTStage) -> list[tuple[int, nn.Module]]:
    if isinstance(module, GPTStage):
        return [(int(name), block) for name, block in module.blocks.items()]
    return list(enumerate(module.blocks))


def make_loss_fn(layout: Layout, tp_mesh: DeviceMesh, vocab: int):
    """(logits, targets) -> mean cross-entropy. Under loss parallelism the logits are this rank's vocabulary
    slice (a plain tensor, so that it can be a pipeline stage's output) and become a Shard(-1) DTensor here."""
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        if layout.loss_parallel:
            logits = DTensor.from_local(logits, tp_mesh, [Shard(2)], shape=(*logits.shape[:-1], vocab))
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))   # bf16 logits: fp32 loss
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    return loss_fn


# -- activation checkpointing, compile -----------------------------------------------------------------------

def apply_activation_checkpointing(module: GPT | GPTStage) -> None:
    """Recompute each block's activations in backward: only the block inputs are kept from forward."""
    for _, block in _blocks(module):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_compile(module: GPT | GPTStage) -> None:
    """torch.compile each block's forward in place (names unchanged; FSDP's hooks on the block stay outside)."""
    for _, block in _blocks(module):
        block.forward = torch.compile(block.forward)


# -- data parallelism ----------------------------------------------------------------------------------------

def apply_fsdp(module: GPT | GPTStage, dp_mesh: DeviceMesh, layout: Layout) -> None:
    """fully_shard per block, then the root's own parameters (embeddings, norm, head) in one more group."""
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if layout.mixed_precision == "bf16" else MixedPrecisionPolicy())
    for _, block in _blocks(module):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy)


def parallelize(model: GPT, mesh: DeviceMesh, layout: Layout) -> dict[int, nn.Module]:
    """This rank's modules by stage index ({0: the model} without PP), laid out in place; DDP wraps."""
    parts: dict[int, nn.Module] = (split_into_stages(model, layout, mesh.get_local_rank("pp")) if layout.pp > 1
                                   else {0: model})
    for index, part in parts.items():
        if layout.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], layout)
        if layout.activation_checkpointing:
            apply_activation_checkpointing(part)
        if layout.compile:
            apply_compile(part)
        if layout.uses_fsdp:
            apply_fsdp(part, mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"],
                       layout)
        elif layout.dp_replicate > 1:
            parts[index] = spmd.DistributedDataParallel(part, device_mesh=mesh["dp_replicate"])
    return parts


# -- running the parallel model ------------------------------------------------------------------------------

# Note: gradient averaging with accumulation
# Each micro-step adds its gradient into .grad, so k micro-steps produce the gradient of the SUM of k mean
# losses; scaling each loss by 1/k makes that a MEAN again, and DDP / FSDP then average over the data-parallel
# ranks: together one big batch of k x dp micro-batches. Only the last micro-step reduces (no_sync under DDP,
# set_requires_gradient_sync(False) under FSDP before it). A pipeline does the same over its microbatches.

class ParallelGPT:
    """The GPT laid out on `mesh`: one training step's forward and backward, validation, clipping, sampling."""

    def __init__(self, model: GPT, mesh: DeviceMesh, layout: Layout) -> None:
        self.config, self.mesh, self.layout = model.config, mesh, layout
        self.parts = parallelize(model, mesh, layout)
        self.raw_parts = [getattr(part, "module", part) for part in self.parts.values()]   # DDP's module
        self.loss_fn = make_loss_fn(layout, mesh["tp"], model.config.vocab)
        self.schedule = None
        if layout.pp > 1:
            stages = [PipelineStage(part, index, layout.pp * layout.stages_per_rank, "cpu",
                                    group=mesh.get_group("pp")) for index, part in self.parts.items()]
            schedule_cls = get_schedule_class(layout.pp_schedule)
            self.schedule = schedule_cls(stages[0] if layout.stages_per_rank == 1 else stages,
                                         layout.n_microbatches, loss_fn=self.loss_fn)
        self.holds_loss = self.schedule is None or any(s == layout.pp * layout.stages_per_rank - 1
                                                       for s in self.parts)
        self.holds_input = 0 in self.parts

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.raw_parts for p in part.parameters()]

    def state_module(self) -> nn.Module:
        """This rank's part of the model as one module with the plain model's parameter names, for its state
        dicts: the model itself, its pipeline stage, or its stages merged; FSDP's parameters resharded first."""
        for part in self.raw_parts:
            if isinstance(part, FSDPModule):
                part.reshard()
        if len(self.raw_parts) == 1:
            return self.raw_parts[0]
        return MergedStages(self.raw_parts)

    def optimizer_groups(self) -> list[dict]:
        """DTensor and plain parameters in separate groups: the optimizer's foreach kernels run per group, and a
        list mixing both has no one layout."""
        params = self.parameters()
        distributed = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        return [{"params": group} for group in (distributed, plain) if group]

    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """Where forward and backward run: the loss-parallel ops (their backward too), and autocast when bf16 is
        not FSDP's (whose policy casts the gathered parameters instead)."""
        with contextlib.ExitStack() as stack:
            if self.layout.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.layout.mixed_precision == "bf16" and not self.layout.uses_fsdp:
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            yield

    def train_step(self, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
        """Forward and backward over this data-parallel rank's micro-batches, gradients accumulated and reduced
        once; this rank's mean loss (0.0 on a pipeline rank without the last stage)."""
        if self.schedule is not None:    # the micro-batches are one batch to the pipeline, which splits its own
            tokens = torch.cat([t for t, _ in micro_batches])
            targets = torch.cat([t for _, t in micro_batches])
            losses: list[Tensor] = []
            with self._compute():
                self.schedule.step(*((tokens,) if self.holds_input else ()),
                                   target=targets if self.holds_loss else None, losses=losses)
            return torch.stack(losses).mean().item() if self.holds_loss else 0.0
        (model,) = self.parts.values()
        total = 0.0
        for micro, (tokens, targets) in enumerate(micro_batches):
            last = micro == len(micro_batches) - 1   # see Note: gradient averaging with accumulation
            with self._accumulating(model, not last), self._compute():
                loss = self.loss_fn(model(tokens), targets) / len(micro_batches)
                loss.backward()
            total += loss.item()
        return total

    @staticmethod
    @contextlib.contextmanager
    def _accumulating(model: nn.Module, accumulate: bool) -> Iterator[None]:
        """Skip the gradient reduction of a micro-step that isn't the step's last."""
        if isinstance(model, spmd.DistributedDataParallel):
            with model.no_sync() if accumulate else contextlib.nullcontext():
                yield
        elif isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(not accumulate)
            yield
        else:
            yield

    @torch.no_grad()
    def eval_loss(self, tokens: Tensor, targets: Tensor) -> float:
        """This data-parallel rank's loss on one batch (0.0 on a pipeline rank without the last stage)."""
        with self._compute():
            if self.schedule is not None:
                losses: list[Tensor] = []
                self.schedule.eval(*((tokens,) if self.holds_input else ()),
                                   target=targets if self.holds_loss else None, losses=losses)
                return torch.stack(losses).mean().item() if self.holds_loss else 0.0
            (model,) = self.parts.values()
            return self.loss_fn(model(tokens), targets).item()

    def mean_over_data_parallel(self, value: float) -> float:
        """The mean over the data-parallel ranks of a value this rank holds (or not, off the last stage):
        collective over the world; TP peers hold equal values, so summing all holders and dividing by their
        count is the mean over the data-parallel coordinates."""
        total = torch.tensor([value if self.holds_loss else 0.0], dtype=torch.float64)
        spmd.all_reduce(total)
        holders = self.mesh.size() // self.layout.pp
        return total.item() / holders

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that the norm of all of them together (every rank's, over every parallel dim)
        is at most `max_norm`; the norm before clipping. Gradients on different meshes (FSDP x TP puts the plain
        parameters on the dp mesh, the tensor-parallel ones on (dp, tp)) are normed per mesh; pipeline stages
        hold disjoint parameters, so their squared norms add over the pp group."""
        by_mesh: dict[DeviceMesh | None, list[Tensor]] = {}
        for param in self.parameters():
            if param.grad is not None:
                by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None,
                                   []).append(param.grad)
        squared = torch.zeros((), dtype=torch.float64)
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads)
            squared += (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
        if self.layout.pp > 1:
            spmd.all_reduce(squared, group=self.mesh.get_group("pp"))
        total = squared.sqrt().item()
        scale = max_norm / (total + 1e-6)
        if scale < 1:
            for grads in by_mesh.values():
                torch._foreach_mul_(grads, scale)
        return total

    def full_model(self) -> GPT | None:
        """The whole model as a plain GPT on global rank 0 (None elsewhere), for sampling: collective over the
        world (DTensor parameters are gathered within their stage, the stages' values sent over pp)."""
        mine = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
                for part in self.raw_parts for name, p in part.named_parameters()}
        if self.layout.pp > 1:
            gathered: list[dict[str, Tensor] | None] = [None] * self.layout.pp
            spmd.all_gather_object(gathered, mine, group=self.mesh.get_group("pp"))
            mine = {name: value for values in gathered if values for name, value in values.items()}
        if spmd.get_rank() != 0:
            return None
        with torch.random.fork_rng():
            full = GPT(self.config)
        full.load_state_dict(mine)
        return full.eval()

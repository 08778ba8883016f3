"""PipelineStage: one piece of the model, run forward and backward one microbatch at a time.

Layer: pipelining. A stage computes and keeps what its backward needs; it never communicates (runtime.py moves
its activations and gradients, and infers their shapes at the first step: see Note: shapes at the first step).

Note: the stage's autograd
A stage's forward starts its own autograd graph: tensors received from the previous stage are fresh leaves, so
backward stops at them and their `.grad` is what goes back to the previous stage. The stage backward (B) runs
autograd from the stage's outputs (seeded with the gradient received from the next stage, or from the scaled
loss on the last stage) into the parameters and those leaves. Split in two (zero-bubble schedules), I computes
only the leaves' gradients and keeps what W needs to compute the weights' later, so that together they do the
work of one B (backward.py, Note: the split backward); the first stage has no leaves, so its I does nothing and
its W is the whole backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, fx, nn

from spmd.comm.group import ProcessGroup
from spmd.comm.world import AnyGroup, resolve_group
from spmd.pipelining.backward import backward_input
from spmd.tensor import DTensor

if TYPE_CHECKING:
    from spmd.pipelining.tracing import PipeInfo


class PipeliningMetadataError(RuntimeError):
    """Stages disagree about the activations between them, or a stage's output can't travel down the pipeline."""


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a receiving stage must know to allocate one activation: its shape and dtype, and whether a gradient
    flows back through it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(tensor: Tensor) -> TensorMeta:
        return TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def __str__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        return f"{self.shape} {str(self.dtype).removeprefix('torch.')}{grad}"

    def same_data(self, other: TensorMeta) -> bool:
        """Same shape and dtype (requires_grad depends on the step's mode, not on the activation)."""
        return self.shape == other.shape and self.dtype == other.dtype


def _as_tuple(value: Tensor | tuple[Tensor, ...] | None, what: str) -> tuple[Tensor, ...] | None:
    if value is None:
        return None
    values = (value,) if isinstance(value, Tensor) else tuple(value)
    if not all(isinstance(v, Tensor) for v in values):
        raise TypeError(f"PipelineStage {what} must be a tensor or a tuple of tensors, got {value!r}")
    return values


def _detached(value: Any) -> Any:
    """`value` with every tensor detached (what the last stage hands back once its graph is spent)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class PipelineStage:
    """The stage `stage_index` of `num_stages`, running `submodule` on `device`, in the pipeline group `group`
    (default: the whole world).

    `input_args` / `output_args` (example tensors, or a tuple of them) are optional: shapes and dtypes are
    inferred at the first step, and where these are given the inferred ones must match them. The stage's rank
    in `group` is set by the schedule's placement (stage s on rank s % group size for most schedules).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
                 input_args: Tensor | tuple[Tensor, ...] | None = None,
                 output_args: Tensor | tuple[Tensor, ...] | None = None, group: AnyGroup | None = None) -> None:
        if num_stages < 1:
            raise ValueError(f"PipelineStage: num_stages must be at least 1, got {num_stages}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} is out of range for {num_stages} stages "
                             f"(0..{num_stages - 1})")
        self.group: ProcessGroup = resolve_group(group, "PipelineStage")
        if self.group.size() > num_stages:
            raise ValueError(f"PipelineStage: the pipeline group has {self.group.size()} ranks but the model only "
                             f"{num_stages} stages; every rank needs at least one stage")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group_rank = self.group.group_rank
        self.group_size = self.group.size()
        user_inputs = _as_tuple(input_args, "input_args")
        user_outputs = _as_tuple(output_args, "output_args")
        self.expected_inputs = None if user_inputs is None else tuple(map(TensorMeta.of, user_inputs))
        self.expected_outputs = None if user_outputs is None else tuple(map(TensorMeta.of, user_outputs))
        self.inputs_meta: tuple[TensorMeta, ...] | None = None    # set at the first step by the runtime
        self.outputs_meta: tuple[TensorMeta, ...] | None = None
        self.fwd_cache: dict[int, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}   # mb -> (outputs, leaves)
        self.output_chunks: dict[int, Any] = {}          # mb -> the last stage's output, detached
        self._weight_halves: dict[int, Callable[[], None]] = {}     # mb -> its W, kept by its I

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.group_rank})"

    def clear_runtime_states(self) -> None:
        """Forget the previous step's microbatches."""
        self.fwd_cache.clear()
        self.output_chunks.clear()
        self._weight_halves.clear()

    # -- forward ------------------------------------------------------------------------------------------------

    def forward_one_chunk(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        """Run the submodule on microbatch `mb`: `args` are the step's inputs on the first stage and the received
        activations (leaves; see Note: the stage's autograd) on the others. Returns the submodule's output."""
        output = self.submod(*args, **(kwargs or {}))
        leaves = () if self.is_first else tuple(args)
        if self.is_last:              # its backward starts from the loss, computed from the output
            self.output_chunks[mb] = _detached(output)
        self.fwd_cache[mb] = ((() if self.is_last else self.activations(output)), leaves)
        return output

    def activations(self, output: Any) -> tuple[Tensor, ...]:
        """The tensors a non-last stage's `output` sends down the pipeline: the output itself, or its items."""
        values = (output,) if isinstance(output, Tensor) else output
        if not isinstance(values, (tuple, list)) or not values or not all(isinstance(v, Tensor) for v in values):
            raise PipeliningMetadataError(
                f"stage {self.stage_index} returned {type(output).__name__}; a stage that feeds another must "
                f"return a tensor or a tuple of tensors (they become the next stage's positional arguments)")
        if any(isinstance(v, DTensor) for v in values):
            raise PipeliningMetadataError(
                f"stage {self.stage_index} returned a DTensor; activations travel between stages as plain tensors "
                f"(as in torch's pipelining): end the stage with a plain tensor (use_local_output=True in the "
                f"tensor-parallel plan, or to_local()), and rebuild the DTensor at the start of the next stage")
        return tuple(values)

    # -- backward -----------------------------------------------------------------------------------------------

    def _roots(self, mb: int, loss: Tensor | None,
               output_grads: tuple[Tensor | None, ...] | None) -> tuple[list[Tensor], list[Tensor | None]]:
        """Where microbatch `mb`'s backward starts: the loss on the last stage, else each output that takes a
        gradient with the gradient received for it (zeros where the next stage sent none)."""
        outputs, _ = self.fwd_cache[mb]
        if self.is_last:
            if loss is None:
                raise RuntimeError(f"stage {self.stage_index} is the last stage: its backward needs the loss")
            return [loss], [None]
        if output_grads is None or len(output_grads) != len(outputs):
            raise RuntimeError(f"stage {self.stage_index} microbatch {mb}: expected {len(outputs)} output "
                               f"gradients, got {None if output_grads is None else len(output_grads)}")
        pairs = [(o, torch.zeros_like(o) if g is None else g) for o, g in zip(outputs, output_grads, strict=True)
                 if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward_one_chunk(self, mb: int, loss: Tensor | None = None,
                           output_grads: tuple[Tensor | None, ...] | None = None,
                           full_backward: bool = True) -> tuple[Tensor | None, ...]:
        """Microbatch `mb`'s backward (B), or its input half (I) when `full_backward` is False; returns the
        gradient w.r.t. each received activation (None where it takes none). See Note: the stage's autograd."""
        roots, grads = self._roots(mb, loss, output_grads)
        _, leaves = self.fwd_cache.pop(mb)
        if full_backward:
            if roots:
                torch.autograd.backward(roots, grads)
            return tuple(leaf.grad for leaf in leaves)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        if not roots:
            self._weight_halves[mb] = _nothing
            return tuple(None for _ in leaves)
        if not wanted:         # the first stage: no received leaves; W is the whole backward (also into the inputs)
            self._weight_halves[mb] = functools.partial(torch.autograd.backward, roots, grads)
            return tuple(None for _ in leaves)
        found, weight_half = backward_input(roots, grads, wanted)
        self._weight_halves[mb] = weight_half.run
        by_leaf = iter(found)
        return tuple(next(by_leaf) if leaf.requires_grad else None for leaf in leaves)

    def backward_weight_one_chunk(self, mb: int) -> None:
        """Microbatch `mb`'s weight half (W), after its backward_one_chunk(full_backward=False)."""
        if mb not in self._weight_halves:
            raise RuntimeError(f"stage {self.stage_index}: W for microbatch {mb} before its I")
        self._weight_halves.pop(mb)()


def _nothing() -> None:
    """The W of a microbatch whose stage outputs take no gradient."""


_PipelineStageBase = PipelineStage   # torch's base class of its stages, which TorchTitan names in annotations


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: PipeInfo, device: torch.device | str,
                group: AnyGroup | None = None) -> PipelineStage:
    """Wrap one of a Pipe's stage modules in a PipelineStage on `device`: the module moves there (unless its
    parameters are on the meta device, to be materialised later), and so do the tensors its graph creates (export
    writes the tracing device into ops such as `arange`)."""
    device = torch.device(device)
    if isinstance(stage_module, fx.GraphModule):
        creating = [node for node in stage_module.graph.nodes
                    if node.op == "call_function" and node.kwargs.get("device") not in (None, device)]
        for node in creating:
            node.update_kwarg("device", device)
        if creating:
            stage_module.recompile()
    if not any(p.is_meta for p in stage_module.parameters()):
        stage_module.to(device)
    return PipelineStage(stage_module, stage_index, pipe_info.num_stages, device, group=group)

"""loss_parallel: cross-entropy on logits sharded over the vocabulary, without gathering them.

Layer: tensor.parallel. Inside the context, four ops on DTensors take over from their rules on this rank's
thread: `_log_softmax` and its backward, `nll_loss_forward` / `nll_loss2d_forward` and their backwards.

Note: cross-entropy over a sharded class dim
With the class dim C split over one mesh dim (each rank holds classes [lo, lo + n)):
- log_softmax(x) = x - m - log(sum_c exp(x - m)), m the row max: the local max is all-reduced (MAX), the local
  sum of exp(x - m) all-reduced (SUM); the output keeps x's layout. Two all-reduces of one value per row.
- nll_loss: row i reads x[i, t_i], held by exactly one rank. Each rank runs the local op with targets outside
  its range ignored (and its slice of the class weights), so it gets that row's term or 0; one all-reduce of
  the per-row terms (reduction none) or of their sum (sum / mean) gives the loss on every rank. The mean's
  divisor W (the weights of the non-ignored targets) is computed from the whole target, which every rank has.
- nll_loss backward: -w[t_i] * grad (/ W) at (i, t_i): each rank writes its own classes' entries, locally.
- log_softmax backward: grad - exp(out) * sum_c grad: one all-reduce of the per-row sums.
So the logits (rows x C) are never gathered: a step moves a few values per row.
On an N-d mesh, other mesh dims may shard the rows (batch or sequence: data or context parallelism); they stay
sharded. The target is laid out like the logits without their class dim (a plain tensor only where that is
fully replicated). reduction none keeps the rows' layout; sum is Partial over the row mesh dims; mean is exact
and Replicate: the (sum, W) pair is all-reduced over the row mesh dims, so W is the global one (torch's
loss_parallel refuses mean on an N-d mesh). A Partial mesh dim of the logits is reduced first.
label_smoothing works with the target passed as a DTensor: its extra term is a sum over the class dim that
DTensor's own rules reduce; a plain target there meets a DTensor in a masked_fill and is refused as ambiguous.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.comm.functional import all_reduced
from spmd.comm.reduce_op import ReduceOp
from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import dispatch
from spmd.tensor.ops.reduction import all_reduce_mesh_dims
from spmd.tensor.placement import Partial, Replicate, Shard
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import overriding_handlers
from spmd.tensor.spec import DTensorSpec, Placements, contiguous_stride

__all__ = ["loss_parallel"]

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2
_LOCAL_IGNORE = -1          # the ignore_index of the local op: targets of other ranks' classes become this

_inside = threading.local()   # per rank thread: how deep inside loss_parallel()


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross-entropy (`F.cross_entropy`, or `log_softmax` + `nll_loss`) on DTensor logits sharded on the
    class dim (placement Shard(-1), e.g. from ColwiseParallel(use_local_output=False) on the output head)
    without gathering them; the loss comes out a Replicate DTensor. Run `loss.backward()` inside it too.
    See Note: cross-entropy over a sharded class dim."""
    with overriding_handlers(_HANDLERS):
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            yield
        finally:
            _inside.depth -= 1


def _active() -> bool:
    return getattr(_inside, "depth", 0) > 0


def _class_mesh_dim(spec: DTensorSpec, class_dim: int, op: OpOverload) -> int:
    """The one mesh dim that shards `class_dim` (loss_parallel needs exactly one)."""
    dims = spec.shard_mesh_dims(class_dim)
    if len(dims) != 1:
        raise ValueError(f"loss_parallel on rank {spec.mesh.get_rank()}: {op} needs its input sharded on the class "
                         f"dim {class_dim} over exactly one mesh dim, got placements {list(spec.placements)} "
                         f"(shape {tuple(spec.shape)}); lay the logits out as Shard(-1), e.g. "
                         f"ColwiseParallel(use_local_output=False) on the output head")
    return dims[0]


def _class_layout(x: DTensor, class_dim: int, op: OpOverload) -> tuple[Tensor, DTensorSpec, int]:
    """x's local tensor with its Partial mesh dims reduced (rows stay sharded), the spec, the class mesh dim."""
    if not isinstance(x, DTensor):
        raise TypeError(f"loss_parallel: {op} needs DTensor logits, got a plain {type(x).__name__}")
    spec = x._spec
    mesh_dim = _class_mesh_dim(spec, class_dim, op)
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    local = x._local_tensor if target == spec.placements else run_plan(x._local_tensor, spec, target)
    return local, spec.with_placements(target), mesh_dim


def _row_layout(spec: DTensorSpec, class_dim: int) -> Placements:
    """The placements of the target (and of the per-row loss): the logits' with the class dim removed."""
    return tuple(Replicate() if isinstance(p, Shard) and p.dim == class_dim else
                 Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > class_dim else p for p in spec.placements)


def _row_mesh_dims(spec: DTensorSpec, class_dim: int) -> list[int]:
    """The mesh dims that shard the rows (any dim but the class dim)."""
    return [i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim != class_dim]


def _laid_out(value: Any, mesh: DeviceMesh, placements: Placements, what: str) -> Any:
    """This rank's piece of `value` laid out as `placements`: a DTensor is redistributed; a plain tensor is taken
    as the whole value, which only a fully replicated layout can use."""
    if value is None:
        return None
    if isinstance(value, DTensor):
        if value._spec.placements == placements:
            return value._local_tensor
        return run_plan(value._local_tensor, value._spec, placements)
    if not all(isinstance(p, Replicate) for p in placements):
        raise ValueError(f"loss_parallel on rank {mesh.get_rank()}: the logits' rows are sharded, so the {what} must "
                         f"be a DTensor laid out as {list(placements)} (a plain tensor would be ambiguous)")
    return value


def _full(value: Any) -> Any:
    """A plain tensor's value, or a DTensor's whole value as a plain tensor (None stays None)."""
    if isinstance(value, DTensor):
        return run_plan(value._local_tensor, value._spec, (Replicate(),) * value._spec.mesh.ndim)
    return value


def _wrap(local: Tensor, mesh: DeviceMesh, placements: Placements, shape: torch.Size, dtype: torch.dtype) -> DTensor:
    return DTensor._wrap_local(local, DTensorSpec(mesh, placements, shape, contiguous_stride(shape), dtype))


# -- log_softmax --------------------------------------------------------------------------------------------------

def _log_softmax(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    x, dim, half_to_float = args
    dim %= max(x.ndim, 1)
    local, spec, mesh_dim = _class_layout(x, dim, op)
    if half_to_float:
        local = local.float()
    group = spec.mesh.get_group(mesh_dim)
    if local.shape[dim] == 0:
        local_max = local.new_full((*local.shape[:dim], 1, *local.shape[dim + 1:]), float("-inf"))
    else:
        local_max = local.amax(dim, keepdim=True)
    row_max = all_reduced(local_max, ReduceOp.MAX, group)
    shifted = local - row_max
    row_sum = all_reduced(shifted.exp().sum(dim, keepdim=True), ReduceOp.SUM, group)
    return _wrap(shifted - row_sum.log(), spec.mesh, spec.placements, x.shape, local.dtype)


def _log_softmax_backward(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    grad, output, dim, input_dtype = args
    dim %= max(output.ndim, 1)
    out_local, spec, mesh_dim = _class_layout(output, dim, op)
    grad_local = grad._local_tensor if grad._spec.placements == spec.placements else run_plan(
        grad._local_tensor, grad._spec, spec.placements)
    row_sum = all_reduced(grad_local.sum(dim, keepdim=True), ReduceOp.SUM, spec.mesh.get_group(mesh_dim))
    grad_input = (grad_local - out_local.exp() * row_sum).to(input_dtype)
    return _wrap(grad_input, spec.mesh, spec.placements, output.shape, input_dtype)


# -- nll_loss -----------------------------------------------------------------------------------------------------

def _local_targets(target: Tensor, weight: Tensor | None, ignore_index: int, spec: DTensorSpec,
                   class_dim: int) -> tuple[Tensor, Tensor | None]:
    """Targets of this rank's classes shifted to local indices, the others `_LOCAL_IGNORE`; this rank's weights."""
    local_shape, offset = spec.local_shape_and_offset(spec.mesh.get_coordinate())
    lo, count = offset[class_dim], local_shape[class_dim]
    mine = (target != ignore_index) & (target >= lo) & (target < lo + count)
    local_target = torch.where(mine, target - lo, torch.full_like(target, _LOCAL_IGNORE))
    return local_target, None if weight is None else weight[lo: lo + count]


def _total_weight(target: Tensor, weight: Tensor | None, ignore_index: int, dtype: torch.dtype) -> Tensor:
    """W: the summed class weights (or count) of the targets that aren't ignore_index."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    return torch.where(valid, weight[target.clamp(min=0, max=weight.numel() - 1)], 0).sum().to(dtype)


class _NllCall:
    """What nll_loss's forward and backward both derive from their arguments: the logits' local tensor in the
    class layout, the target laid out like the rows, the whole class weights, and this rank's share of both."""

    def __init__(self, x: DTensor, target: Any, weight: Any, ignore_index: int, class_dim: int,
                 op: OpOverload) -> None:
        self.local, self.spec, self.mesh_dim = _class_layout(x, class_dim, op)
        self.rows = _row_layout(self.spec, class_dim)
        self.target = _laid_out(target, self.spec.mesh, self.rows, "target")
        self.weight = _full(weight)
        self.local_target, self.local_weight = _local_targets(self.target, self.weight, ignore_index, self.spec,
                                                              class_dim)


def _nll_loss_forward(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    x, target, weight, reduction, ignore_index = args
    class_dim = 0 if x.ndim == 1 else 1
    call = _NllCall(x, target, weight, ignore_index, class_dim, op)
    spec, mesh, rows = call.spec, call.spec.mesh, call.rows
    terms, _ = op(call.local, call.local_target, call.local_weight, _NONE, _LOCAL_IGNORE)
    total_weight = _total_weight(call.target, call.weight, ignore_index, call.local.dtype)
    class_group = mesh.get_group(call.mesh_dim)
    row_dims = _row_mesh_dims(spec, class_dim)
    partial_over_rows = tuple(Partial() if i in row_dims else Replicate() for i in range(mesh.ndim))
    if reduction == _NONE:
        loss, placements, weight_placements = all_reduced(terms, ReduceOp.SUM, class_group), rows, partial_over_rows
    elif reduction == _SUM:
        loss = all_reduced(terms.sum(), ReduceOp.SUM, class_group)
        placements = weight_placements = partial_over_rows
    else:       # mean: the global sum over the global W (one all-reduce of the pair over the row mesh dims)
        total = all_reduced(terms.sum(), ReduceOp.SUM, class_group)
        pair = all_reduce_mesh_dims(torch.stack([total, total_weight]), spec, row_dims, ReduceOp.SUM)
        loss, total_weight = pair[0] / pair[1], pair[1]
        placements = weight_placements = (Replicate(),) * mesh.ndim
    return (_wrap(loss, mesh, placements, _loss_shape(x, class_dim, reduction), loss.dtype),
            _wrap(total_weight, mesh, weight_placements, torch.Size([]), total_weight.dtype))


def _loss_shape(x: DTensor, class_dim: int, reduction: int) -> torch.Size:
    """The global shape of the loss: the rows for reduction none, else a scalar."""
    if reduction != _NONE:
        return torch.Size([])
    return torch.Size([*x.shape[:class_dim], *x.shape[class_dim + 1:]])


def _nll_loss_backward(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    grad, x, target, weight, reduction, ignore_index, total_weight = args
    call = _NllCall(x, target, weight, ignore_index, 0 if x.ndim == 1 else 1, op)
    if reduction == _NONE:
        grad = _laid_out(grad, call.spec.mesh, call.rows, "gradient")
    else:
        grad = _full(grad)
    total_weight = _full(total_weight) if reduction == _MEAN else (
        total_weight._local_tensor if isinstance(total_weight, DTensor) else total_weight)
    grad_input = op(grad, call.local, call.local_target, call.local_weight, reduction, _LOCAL_IGNORE, total_weight)
    return _wrap(grad_input, call.spec.mesh, call.spec.placements, x.shape, grad_input.dtype)


_HANDLERS = {aten._log_softmax.default: _log_softmax,
             aten._log_softmax_backward_data.default: _log_softmax_backward,
             aten.nll_loss_forward.default: _nll_loss_forward,
             aten.nll_loss2d_forward.default: _nll_loss_forward,
             aten.nll_loss_backward.default: _nll_loss_backward,
             aten.nll_loss2d_backward.default: _nll_loss_backward}

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
Other mesh dims of the logits are made Replicate first (tensor parallelism has the logits on a 1-d mesh).
The target may be a plain tensor (the whole target, the same on every rank) or a DTensor.
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
from spmd.tensor.api import DTensor
from spmd.tensor.dispatch import dispatch
from spmd.tensor.placement import Replicate, Shard
from spmd.tensor.redistribute import run_plan
from spmd.tensor.rules import overriding_handlers
from spmd.tensor.spec import DTensorSpec, contiguous_stride

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
    """x's local tensor laid out as Shard(class_dim) on its class mesh dim and Replicate on the others."""
    if not isinstance(x, DTensor):
        raise TypeError(f"loss_parallel: {op} needs DTensor logits, got a plain {type(x).__name__}")
    spec = x._spec
    mesh_dim = _class_mesh_dim(spec, class_dim, op)
    target = tuple(Shard(class_dim) if i == mesh_dim else Replicate() for i in range(spec.mesh.ndim))
    local = x._local_tensor if target == spec.placements else run_plan(x._local_tensor, spec, target)
    return local, spec.with_placements(target), mesh_dim


def _full(value: Any) -> Any:
    """A plain tensor's value, or a DTensor's whole value as a plain tensor (None stays None)."""
    if isinstance(value, DTensor):
        return run_plan(value._local_tensor, value._spec, (Replicate(),) * value._spec.mesh.ndim)
    return value


def _wrap(local: Tensor, spec: DTensorSpec, shape: torch.Size, dtype: torch.dtype) -> DTensor:
    return DTensor._wrap_local(local, DTensorSpec(spec.mesh, spec.placements, shape, contiguous_stride(shape), dtype))


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements((Replicate(),) * spec.mesh.ndim)


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
    return _wrap(shifted - row_sum.log(), spec, x.shape, local.dtype)


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
    return _wrap(grad_input, spec, output.shape, input_dtype)


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


def _nll_loss_forward(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    x, target, weight, reduction, ignore_index = args
    class_dim = 0 if x.ndim == 1 else 1
    local, spec, mesh_dim = _class_layout(x, class_dim, op)
    target, weight = _full(target), _full(weight)
    local_target, local_weight = _local_targets(target, weight, ignore_index, spec, class_dim)
    terms, _ = op(local, local_target, local_weight, _NONE, _LOCAL_IGNORE)
    group = spec.mesh.get_group(mesh_dim)
    total_weight = _total_weight(target, weight, ignore_index, local.dtype)
    if reduction == _NONE:
        loss = all_reduced(terms, ReduceOp.SUM, group)
    else:
        loss = all_reduced(terms.sum(), ReduceOp.SUM, group)
        if reduction == _MEAN:
            loss = loss / total_weight
    replicated = _replicated(spec)
    return (_wrap(loss, replicated, loss.shape, loss.dtype),
            _wrap(total_weight, replicated, total_weight.shape, total_weight.dtype))


def _nll_loss_backward(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    if not _active():
        return dispatch(DTensor, op, (), args, kwargs, by_rule=True)
    grad, x, target, weight, reduction, ignore_index, total_weight = args
    class_dim = 0 if x.ndim == 1 else 1
    local, spec, _ = _class_layout(x, class_dim, op)
    target, weight = _full(target), _full(weight)
    local_target, local_weight = _local_targets(target, weight, ignore_index, spec, class_dim)
    grad_input = op(_full(grad), local, local_target, local_weight, reduction, _LOCAL_IGNORE, _full(total_weight))
    return _wrap(grad_input, spec, x.shape, grad_input.dtype)


_HANDLERS = {aten._log_softmax.default: _log_softmax,
             aten._log_softmax_backward_data.default: _log_softmax_backward,
             aten.nll_loss_forward.default: _nll_loss_forward,
             aten.nll_loss2d_forward.default: _nll_loss_forward,
             aten.nll_loss_backward.default: _nll_loss_backward,
             aten.nll_loss2d_backward.default: _nll_loss_backward}

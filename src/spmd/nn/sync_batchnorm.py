"""Batch normalization whose training statistics span every rank's batch: torch's `nn.SyncBatchNorm`, on spmd's
groups and on any device (torch's runs only on accelerators: its statistics kernels have no CPU version).

Layer: nn. In training each rank computes its batch's per-channel count, mean and sum of squared deviations; one
all-gather brings every rank's to every rank, which combine them in rank order (Chan's parallel formulas: exact
where the sums of squares would cancel), so all ranks normalise with the same global mean and variance and update
the same running statistics. Backward all-reduces the two per-channel sums the input's gradient needs; the
weight's and bias's gradients stay local, as in torch (DDP averages them). Half-precision inputs keep their
statistics in float32. In eval, or with a one-rank group, or with no spmd world, it is plain batch norm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from spmd.comm import collectives as c
from spmd.comm.group import ProcessGroup
from spmd.comm.world import AnyGroup, is_initialized, resolve_group

__all__ = ["SyncBatchNorm"]


def _per_channel(values: Tensor, like: Tensor) -> Tensor:
    """A (C,) tensor shaped to broadcast over channel dim 1 of `like`."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, eps: float, momentum: float | Tensor, group: ProcessGroup) -> Tensor:
        channels = input.shape[1]
        reduced_dims = [dim for dim in range(input.dim()) if dim != 1]
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        count = input.numel() // channels
        if count:
            variance, mean = torch.var_mean(x, reduced_dims, correction=0)      # one pass (Welford's)
            squares = variance * count
        else:                   # a rank with an empty batch counts for nothing
            mean = squares = x.new_zeros(channels)
        # combined in float64: counts past 2**24 elements a channel stay exact, and so do the corrections
        local = torch.cat([mean.new_full((1,), count, dtype=torch.float64), mean.double(), squares.double()])
        gathered = local.new_empty(group.size(), local.numel())
        c.all_gather_into_tensor(gathered, local, group=group)
        counts, means, all_squares = gathered[:, :1], gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_squares = (all_squares + counts * (means - global_mean).square()).sum(0)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                rate = momentum.to(running_mean.dtype) if isinstance(momentum, Tensor) else momentum
                running_mean.lerp_(global_mean.to(running_mean.dtype), rate)
                running_var.lerp_((global_squares / (total - 1)).to(running_var.dtype), rate)
        invstd = torch.rsqrt(global_squares / total + eps).to(x.dtype)
        global_mean = global_mean.to(x.dtype)
        total = total.to(x.dtype)
        scale = invstd if weight is None else invstd * weight.to(x.dtype)     # out = x * scale + shift, one
        shift = -global_mean * scale if bias is None else bias.to(x.dtype) - global_mean * scale   # kernel, as
        out = torch.addcmul(_per_channel(shift, x), x, _per_channel(scale, x))          # torch's CPU batch norm
        ctx.save_for_backward(input, weight, global_mean, invstd, total)
        ctx.group = group
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd, total = ctx.saved_tensors
        reduced_dims = [dim for dim in range(input.dim()) if dim != 1]
        x = input.to(mean.dtype)
        dy = grad_output.to(mean.dtype)
        centred = x - _per_channel(mean, x)
        sum_dy = dy.sum(reduced_dims)
        sum_dy_centred = (dy * centred).sum(reduced_dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_centred])
            c.all_reduce(sums, group=ctx.group)
            mean_dy, mean_dy_centred = (sums / total).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            # (dy - mean_dy - centred * invstd^2 * mean_dy_centred) * scale, as two fused multiply-adds
            grad_input = torch.addcmul(_per_channel(-mean_dy * scale, x), dy, _per_channel(scale, x))
            grad_input = grad_input.addcmul_(centred, _per_channel(-invstd.square() * mean_dy_centred * scale, x))
            grad_input = grad_input.to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_centred * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_output.dtype if weight is None else weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """torch's `nn.SyncBatchNorm` (the same arguments, state dict and `convert_sync_batchnorm`), its training
    statistics over `process_group` (default: the world) on spmd's transports, on any device."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: AnyGroup | None = None,
                 device: Any = None, dtype: torch.dtype | None = None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"spmd.nn.SyncBatchNorm: expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("spmd.nn.SyncBatchNorm: the input has no channels")
        cumulative = self.training and self.track_running_stats and self.momentum is None
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)   # type: ignore[union-attr,operator]
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group = self._group() if self.training else None
        if group is None:
            factor = 1.0 / float(self.num_batches_tracked) if cumulative else self.momentum or 0.0   # type: ignore
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_statistics, factor,
                                self.eps)
        # a cumulative average's factor stays a tensor on the device: no host sync a step (torch's reads it back)
        factor = self.num_batches_tracked.reciprocal() if cumulative else self.momentum   # type: ignore[union-attr]
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            factor, group)

    def _group(self) -> ProcessGroup | None:
        """The group whose batches make the statistics, or None where there is nothing to synchronise."""
        if self.process_group is None and not is_initialized():
            return None
        group = resolve_group(self.process_group, "spmd.nn.SyncBatchNorm")
        return group if group.size() > 1 else None

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: AnyGroup | None = None) -> nn.Module:
        """`module` with every batch norm layer (BatchNorm1d/2d/3d, torch's SyncBatchNorm) replaced by an spmd
        SyncBatchNorm holding the same parameters and buffers, as torch's `convert_sync_batchnorm` does."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,     # every tensor
                            module.track_running_stats, process_group, device="meta",            # is replaced
                            bias=module.bias is not None if module.affine else True)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted

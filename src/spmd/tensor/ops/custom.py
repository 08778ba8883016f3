"""Ops whose local computation is not the op itself: what their kernels are given, and a helper for them.

Layer: tensor. A rule registered with `kernel=make_kernel` (rules.register_rule / register_strategy) runs
like every other op: the same cache key, decision checks, redistribution and wrapping (the dispatch
package); the only thing it adds is its local kernel, which `make_kernel(LocalPlan)` builds once per distinct
call. Used in this package by `mean` over a sharded dim (a local sum scaled by the GLOBAL count, exact for
uneven shards), max/min with empty shards, var/std and norms over sharded dims (one small all-reduce inside
the kernel), the vocab-sharded `embedding` (ids outside this rank's rows masked), `nll_loss` and `mse_loss`
with mean reduction, attention with an empty query shard, GradScaler's unscale (found_inf all-reduced over
the mesh), and the foreach ops.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from spmd.tensor.rules import KernelFactory, LocalKernel, LocalPlan

__all__ = ["KernelFactory", "LocalKernel", "LocalPlan", "empty_outputs"]


def empty_outputs(plan: LocalPlan, like: Tensor, zeros: bool = False) -> Any:
    """This rank's outputs for an empty local piece: empty (or zero) tensors of the output specs' local shapes."""
    make = like.new_zeros if zeros else like.new_empty
    outs = [make(spec.local_shape(), dtype=spec.dtype) for spec in plan.output_specs if spec is not None]
    return outs[0] if len(outs) == 1 else tuple(outs)

"""Gradient accumulation over the data-parallel wrappers of a model, with the communication strategy named:
`spmd.accumulate(model, micro_batches, reduce=...)` yields the micro-batches of one optimizer step and sets
every DDP and FSDP module of `model` for each, so that no wrapper is forgotten and the gradient after the last
micro-batch is the big batch's.

Layer: accumulation (above ddp and fsdp; imports them only).

Note: what each strategy sends
For k micro-batches per step, on a model of G FSDP groups (or DDP buckets):
- "last": only the last micro-batch's backward reduces, the sum of all k (DDP's no_sync, FSDP's
  set_requires_gradient_sync(False) before it): G reductions per step, but FSDP holds every group's unsharded
  gradients until then (the memory of an unsharded model's gradients).
- "each": every backward reduces (k x G reductions); FSDP frees the unsharded gradients each time and adds the
  reduced shards up, so memory stays that of one micro-batch.
- "scatter_each" (HSDP only): every backward reduce-scatters within the shard group, freeing the unsharded
  gradients, and only the last all-reduces across replicas (set_requires_all_reduce): k x G reduce-scatters,
  G all-reduces.
Every strategy gives the same gradient: the loss of each micro-batch must be divided by k, as for one process.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import TypeVar

from torch import nn

from spmd.ddp import DistributedDataParallel
from spmd.ddp.composable import replicate_state_of
from spmd.fsdp import FSDPModule
from spmd.fsdp.state import state_of

T = TypeVar("T")


class Reduce(enum.Enum):
    """When gradients are reduced across ranks during accumulation (see Note: what each strategy sends)."""

    LAST = "last"
    EACH = "each"
    SCATTER_EACH = "scatter_each"


def accumulate(model: nn.Module, micro_batches: Iterable[T], reduce: Reduce | str = Reduce.LAST) -> Iterator[T]:
    """Yield the micro-batches of one optimizer step, each with every data-parallel module of `model` (DDP, FSDP2,
    FSDP1 and the composable replicates' modules) set to reduce as `reduce` says; run forward and backward on
    each, dividing its loss by their number. Leaving the loop early leaves the modules reducing every backward
    again, and the gradients accumulated so far unreduced.

        for micro_batch in spmd.accumulate(model, batch.chunk(4), reduce="each"):
            (loss_fn(model(micro_batch)) / 4).backward()
        optimizer.step()

    A ValueError before anything runs when `model` has no data-parallel module, when a trainable parameter is
    outside every one (its gradient would not be averaged), or when a module cannot do `reduce`.
    """
    strategy = _strategy(reduce)
    items = list(micro_batches)
    ddp, fsdp = _wrappers(model, strategy)
    try:
        for index, item in enumerate(items):
            _set(ddp, fsdp, strategy, last=index == len(items) - 1)
            yield item
    finally:
        _set(ddp, fsdp, strategy, last=True)


def _strategy(reduce: Reduce | str) -> Reduce:
    if isinstance(reduce, Reduce):
        return reduce
    try:
        return Reduce(reduce)
    except ValueError:
        raise ValueError(f"spmd.accumulate: reduce must be one of {[r.value for r in Reduce]}, got {reduce!r}") \
            from None


def _wrappers(model: nn.Module, strategy: Reduce) -> tuple[list[nn.Module], list[FSDPModule]]:
    """The DDP modules (DistributedDataParallel wrappers, and modules the composable replicate made data parallel
    by DDP) and FSDP modules of `model`, checked to cover its trainable parameters and to serve `strategy`."""
    ddp = [m for m in model.modules() if isinstance(m, DistributedDataParallel) or replicate_state_of(m) is not None]
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule) and state_of(m) is not None]
    if not ddp and not fsdp:
        raise ValueError(f"spmd.accumulate: {type(model).__name__} has no DistributedDataParallel or fully_shard "
                         f"module, so no gradient would be reduced across ranks; wrap the model first")
    if strategy is Reduce.SCATTER_EACH:
        if ddp:
            raise ValueError(f"spmd.accumulate: reduce='scatter_each' needs HSDP (fully_shard on a 2-d mesh); "
                             f"{_name(ddp[0])} is under DistributedDataParallel, which has no reduce-scatter; use "
                             f"'last' or 'each'")
        flat = [state_of(m).name for m in fsdp if _is_flat(m)]   # type: ignore[union-attr]
        if flat:
            raise ValueError(f"spmd.accumulate: reduce='scatter_each' needs HSDP (fully_shard on a 2-d (replicate, "
                             f"shard) mesh), but {flat[0]} is sharded over a 1-d mesh; use 'last' or 'each'")
    covered = {id(p) for m in ddp for p in _reduced_by(m)}
    for module in fsdp:
        covered.update(id(param.sharded_param) for param in state_of(module).params)   # type: ignore[union-attr]
    outside = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if outside:
        raise ValueError(f"spmd.accumulate: trainable parameters of {type(model).__name__} are outside every "
                         f"data-parallel module, so their gradients would not be averaged across ranks: "
                         f"{', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}")
    return ddp, fsdp


def _name(module: nn.Module) -> str:
    return type(module.module if isinstance(module, DistributedDataParallel) else module).__name__


def _reduced_by(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a DDP module averages: a wrapper's, or a replicated module's but its ignored modules'."""
    replicated = replicate_state_of(module)
    if replicated is None:
        return list(module.parameters())
    ignored = {id(p) for m in replicated.ignored_modules for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in ignored]


def _is_flat(module: FSDPModule) -> bool:
    return any(group.replicate_group is None for group in state_of(module).groups)   # type: ignore[union-attr]


def _set(ddp: list[nn.Module], fsdp: list[FSDPModule], strategy: Reduce, last: bool) -> None:
    """Set every module for a micro-batch: the last (or any micro-batch under 'each') reduces in full."""
    for module in ddp:
        sync = last or strategy is Reduce.EACH
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = sync
        else:
            module.set_requires_gradient_sync(sync)   # type: ignore[operator]
    for module in fsdp:
        module.set_requires_gradient_sync(last or strategy is not Reduce.LAST, recurse=False)
        module.set_requires_all_reduce(last or strategy is not Reduce.SCATTER_EACH, recurse=False)

"""ZeroRedundancyOptimizer stepped inside DistributedDataParallel's backward: torch's `ddp_zero_hook` hooks.

Layer: optim. `hook_with_zero_step(hook, ddp, zero)` and `hook_with_zero_step_interleaved(hook, ddp, zero)` wrap a
DDP communication hook (allreduce_hook, a compression hook, ...) so that each rank's ZeRO step runs as the
gradients arrive, rather than in `zero.step()` after backward; register the result with
`ddp.register_comm_hook(state, ...)`. The optimizer must be built with `overlap_with_ddp=True`. The DDP module is
used through its reducer's buckets alone (`ddp.reducer.buckets`: each bucket's `index` and `params`), as this layer
sits below ddp.

Note: ZeRO inside DDP's backward
Building the hook makes ZeRO own parameters by DDP bucket (bucket i to rank i % world_size; with
shard_buckets=True each bucket cut into runs of about 1/world_size of the elements, each run to the least-loaded
rank) and builds the local optimizer over them; spmd's DDP buckets are fixed when the module is built, so the
steps run from the first iteration (torch's skip the first two or three while its DDP settles its buckets).
Each rank steps the parameters it owns with the bucket's averaged gradient (the hook's result, written into the
bucket's buffer, each parameter's view of it as its .grad for the step; its own .grad is put back after, and DDP
writes the averaged one as usual). When the last bucket has been launched, every rank waits for the steps and then
broadcasts every owner's parameters, all broadcasts in flight at once, before backward returns: the next forward
sees the updated model. hook_with_zero_step steps everything then, after all the all-reduces have been waited
for (one optimizer step over the owned parameters: the numbers of `zero.step()` after backward);
hook_with_zero_step_interleaved steps each bucket as soon as its all-reduce completes (in the thread that
completes it), while backward goes on. Both issue their broadcasts from the thread that runs the last bucket's
hook, in rank order, so every rank issues the same collectives in the same order (torch's interleaved variant
broadcasts from the completion callbacks, and refuses gloo, where that order can hang). Gradients of parameters
that no rank used are zeros in the bucket (find_unused_parameters=True): they are stepped on, as in torch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from spmd.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

CommHook = Callable[[Any, Any], torch.futures.Future]


def hook_with_zero_step(hook: CommHook, ddp: Any, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> CommHook:
    """`hook`, then, once the last bucket is launched, ZeRO's step on every bucket's averaged gradients and the
    parameters' broadcasts (see Note: ZeRO inside DDP's backward)."""
    return _OverlappedHook(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(hook: CommHook, ddp: Any, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> CommHook:
    """`hook`, with ZeRO's step on each bucket as soon as its all-reduce completes, while backward goes on; the
    parameters' broadcasts once the last bucket is launched (see Note: ZeRO inside DDP's backward)."""
    return _OverlappedHook(hook, ddp, zero, shard_buckets, interleaved=True)


class _OverlappedHook:
    """The hook DDP calls per bucket; one iteration's futures, in bucket order."""

    def __init__(self, hook: CommHook, ddp: Any, zero: ZeroRedundancyOptimizer, shard_buckets: bool,
                 interleaved: bool) -> None:
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(f"hook_with_zero_step: zero must be a ZeroRedundancyOptimizer, got {type(zero).__name__}")
        buckets = getattr(getattr(ddp, "reducer", None), "buckets", None)
        if buckets is None:
            raise TypeError(f"hook_with_zero_step: ddp must be an spmd.DistributedDataParallel, got "
                            f"{type(ddp).__name__}")
        zero._own_by_buckets([list(bucket.params) for bucket in buckets], shard_buckets)
        self.hook, self.zero, self.interleaved = hook, zero, interleaved
        self.buckets = len(buckets)
        self.launched: list[tuple[Any, torch.futures.Future]] = []    # this iteration's buckets and futures
        self.lock = threading.Lock()                       # interleaved steps may complete on different threads

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        if bucket.index() == 0:          # a new iteration (one that failed part-way left its futures behind)
            self.launched = []
        future = self.hook(state, bucket)
        if self.interleaved:
            future = future.then(functools.partial(self._step, bucket))
        self.launched.append((bucket, future))
        if len(self.launched) < self.buckets:
            return future
        launched, self.launched = self.launched, []
        for _, earlier in launched:
            earlier.wait()
        if not self.interleaved:
            gradients: dict[Tensor, Tensor] = {}
            for earlier_bucket, earlier in launched:
                gradients.update(_gradients(earlier_bucket, earlier.value()))
            self.zero._step_on(gradients)
        self.zero._sync_params()
        return future

    def _step(self, bucket: Any, reduced: torch.futures.Future) -> Tensor:
        """One bucket's step, once its reduction completed (interleaved); the future's value stays the bucket's."""
        value = reduced.value()
        with self.lock:
            self.zero._step_on(_gradients(bucket, value))
        return value


def _gradients(bucket: Any, reduced: Tensor) -> dict[Tensor, Tensor]:
    """Each of `bucket`'s parameters and its averaged gradient: its view of the reduced buffer (written into the
    bucket's own buffer first when the hook returned another tensor)."""
    if reduced is not bucket.buffer():
        bucket.set_buffer(reduced)
    return dict(zip(bucket.parameters(), bucket.gradients(), strict=True))

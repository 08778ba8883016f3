"""The post-local SGD communication hook (torch's `post_localSGD_hook`): gradients are averaged over the whole
group for the first `start_localSGD_iter` steps, then only within a subgroup (by default the ranks of each
host), or not at all; a model averager (spmd.algorithms.model_averaging, through
spmd.optim.PostLocalSGDOptimizer) then averages the parameters every few steps.

Layer: ddp. Each average divides by its own group's size, as torch's does.
"""

from __future__ import annotations

import torch

from spmd.comm.collectives import all_reduce
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import AnyGroup, new_subgroups, resolve_group
from spmd.ddp.bucket import GradBucket
from spmd.ddp.comm_hooks import noop_hook


class PostLocalSGDState:
    """When the hook switches from global to local averaging, and over which groups.

    `process_group`: the group of the global phase (None: the world). `subgroup`: the local phase's (None: the
    ranks of this host, made here, which is collective over the world). `start_localSGD_iter`: the number of
    global steps. `post_local_gradient_allreduce=False`: no gradient averaging at all once local (each rank steps
    on its own gradients). `iter` counts the steps the hook has seen.
    """

    __slots__ = ("iter", "post_local_gradient_allreduce", "process_group", "start_localSGD_iter", "subgroup")

    def __init__(self, process_group: AnyGroup | None, subgroup: AnyGroup | None, start_localSGD_iter: int,
                 post_local_gradient_allreduce: bool = True) -> None:
        if start_localSGD_iter < 0:
            raise ValueError(f"PostLocalSGDState: start_localSGD_iter must be >= 0, got {start_localSGD_iter}")
        self.process_group = process_group
        self.subgroup = subgroup if subgroup is not None else new_subgroups()[0]
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a step when its last bucket passes."""
        if bucket.is_last():
            self.iter += 1


def _average(group: AnyGroup | None, bucket: GradBucket) -> torch.futures.Future:
    pg = resolve_group(group, "post_localSGD_hook")
    buffer = bucket.buffer().div_(pg.size())
    work = all_reduce(buffer, ReduceOp.SUM, group=pg, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over `state.process_group` during the first `start_localSGD_iter` steps, then over
    `state.subgroup` (or leave it as this rank's own gradient); see PostLocalSGDState."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _average(state.process_group, bucket)
    if not state.post_local_gradient_allreduce:
        return noop_hook(state, bucket)
    return _average(state.subgroup, bucket)

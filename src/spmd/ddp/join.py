"""Join: let ranks with fewer batches keep pace with the others instead of leaving them hanging.

Layer: ddp. It drives the module only through the Reducer's `set_divisor`, `shadow_iteration` and `device` and
`sync.broadcast_module_state`; DistributedDataParallel owns which block, if any, a rank is inside.

Note: the join protocol
Inside `with ddp.join():` every training forward (one that records gradients) starts with an all_reduce of
[1, sync] (sync = 1 unless under no_sync): the first entry counts the ranks still training this step, the
second how many of them reduce gradients. A rank that runs out of batches leaves the block, where
`JoinProtocol.keep_pace` repeats:
  1. all_reduce [0, 0]: matches the others' forward all_reduce; if no rank is still training, stop;
  2. broadcast buffers if the module does (matching their forward), then, if they reduce gradients, run one
     iteration of the reducer on zero gradients (matching their backward: same buckets, same order).
When every rank has joined, the ranks that joined last (they ran the most steps and hold the trained model)
are found with an all_reduce MAX, and the highest of them broadcasts parameters and buffers to the others.
Gradients are divided by the initial group size by default, or, with divide_by_initial_world_size=False, by
the number of ranks still training that step.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.ddp.reducer import Reducer
from spmd.ddp.sync import broadcast_module_state


class JoinProtocol:
    """One `with ddp.join():` block (see Note: the join protocol). DistributedDataParallel.join() makes it, calls
    `notify_forward` at each training forward inside the block, and `keep_pace` when this rank leaves the block."""

    def __init__(self, module: nn.Module, group: ProcessGroup, reducer: Reducer, broadcast_buffers: bool,
                 divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        self.module = module
        self.group = group
        self.reducer = reducer
        self.broadcast_buffers = broadcast_buffers
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.shadow_iterations = 0

    def notify_forward(self, sync: bool) -> None:
        """Every training forward inside the block: count the ranks still training. Collective."""
        counts = torch.tensor([1, int(sync)], dtype=torch.int64, device=self.reducer.device)
        all_reduce(counts, ReduceOp.SUM, group=self.group)
        active = int(counts[0])
        if self.throw_on_early_termination and active < self.group.size():
            raise RuntimeError(self._early_message(self.group.size() - active))
        if not self.divide_by_initial_world_size:
            self.reducer.set_divisor(active)

    def keep_pace(self) -> None:
        """This rank has no more batches: shadow the others' iterations until all have joined. Collective."""
        while True:
            counts = torch.zeros(2, dtype=torch.int64, device=self.reducer.device)
            all_reduce(counts, ReduceOp.SUM, group=self.group)
            active, syncing = int(counts[0]), int(counts[1])
            if active == 0:
                break
            if self.throw_on_early_termination:
                raise RuntimeError(self._early_message(self.group.size() - active))
            if not self.divide_by_initial_world_size:
                self.reducer.set_divisor(active)
            if self.broadcast_buffers and self.group.size() > 1:
                broadcast_module_state(self.module, self.group, src=0, include_params=False)
            if syncing:
                self.reducer.shadow_iteration()
            self.shadow_iterations += 1
        self.reducer.set_divisor(self.group.size())
        self._sync_final_model()

    def _sync_final_model(self) -> None:
        """Broadcast the model from the highest rank among those that joined last. Collective."""
        candidate = torch.tensor([self.group.group_rank if self.shadow_iterations == 0 else -1], dtype=torch.int64,
                                 device=self.reducer.device)
        all_reduce(candidate, ReduceOp.MAX, group=self.group)
        broadcast_module_state(self.module, self.group, src=int(candidate), include_params=True)

    def _early_message(self, joined: int) -> str:
        return (f"DistributedDataParallel.join on rank {self.group.global_rank} of {self.group.description}: "
                f"{joined} rank(s) ran out of inputs before the others, and throw_on_early_termination=True")

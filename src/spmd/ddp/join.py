"""DDP's join hook: let ranks with fewer batches keep pace with the others instead of leaving them hanging.

Layer: ddp. DistributedDataParallel is a Joinable (spmd.comm.join, Note: the join protocol); this hook is what a
rank that ran out of batches runs for it. It drives the module only through the Reducer's `set_divisor`,
`shadow_iteration` and `device` and `sync.broadcast_module_state`.

Note: DDP under Join
Inside `with Join([ddp, ...]):` (or `with ddp.join():`, the same with DDP alone) every training forward (one that
records gradients) runs, after the Join's notify: an all_reduce of [sync] (1 unless under no_sync), telling the
joined ranks whether this iteration reduces gradients; the buffers' broadcast, if the module does it; then
backward's bucket all-reduces. The joined rank's main hook runs the same: all_reduce [0], the broadcast, and if
any rank reduces, one iteration of the reducer on zero gradients (same buckets, same order). Gradients are
divided by the initial group size by default, or, with divide_by_initial_world_size=False, by the number of
ranks still training (the notify's sum). When every rank has joined, the ranks that joined last (they ran the
most steps and hold the trained model) are found with an all_reduce MAX, and the highest of them broadcasts
parameters and buffers to the others.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd.comm.collectives import all_reduce
from spmd.comm.group import ProcessGroup
from spmd.comm.join import JoinHook
from spmd.comm.reduce_op import ReduceOp
from spmd.ddp.reducer import Reducer
from spmd.ddp.sync import broadcast_module_state


def announce_sync(group: ProcessGroup, device: torch.device, sync: bool) -> bool:
    """The all_reduce of [sync] every training forward under Join runs (Note: DDP under Join); True if any rank
    reduces gradients this iteration. Collective."""
    flag = torch.tensor([int(sync)], dtype=torch.int64, device=device)
    all_reduce(flag, ReduceOp.SUM, group=group)
    return bool(flag.item())


class DDPJoinHook(JoinHook):
    """What a joined rank runs for one DistributedDataParallel (see Note: DDP under Join)."""

    def __init__(self, module: nn.Module, group: ProcessGroup, reducer: Reducer, broadcast_buffers: bool) -> None:
        self.module = module
        self.group = group
        self.reducer = reducer
        self.broadcast_buffers = broadcast_buffers

    def main_hook(self) -> None:
        """One training iteration's collectives, on zero gradients. Collective."""
        syncing = announce_sync(self.group, self.reducer.device, sync=False)
        if self.broadcast_buffers and self.group.size() > 1:
            broadcast_module_state(self.module, self.group, src=0, include_params=False)
        if syncing:
            self.reducer.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the highest rank among those that joined last. Collective."""
        self.reducer.set_divisor(self.group.size())
        candidate = torch.tensor([self.group.group_rank if is_last_joiner else -1], dtype=torch.int64,
                                 device=self.reducer.device)
        all_reduce(candidate, ReduceOp.MAX, group=self.group)
        broadcast_module_state(self.module, self.group, src=int(candidate), include_params=True)

"""ShardedGradScaler (torch's `fsdp.sharded_grad_scaler`): torch.amp.GradScaler whose inf/NaN check is agreed by
every rank of a group, so that ranks holding different gradients (pipeline stages, plain sharded parameters)
all skip the same steps and keep the same scale.

Layer: fsdp. One all-reduce (MAX of the found-inf flags) per unscale. Gradients that are DTensors already agree
over their mesh (see Note: GradScaler on sharded gradients in spmd.tensor.ops.foreach): the group's agreement
then adds ranks the mesh does not hold.
"""

from __future__ import annotations

import torch

from spmd.comm.collectives import all_reduce
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import AnyGroup, resolve_group


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler with the found-inf flags all-reduced over `process_group` (default: the world)
    before each optimizer step; same arguments and defaults as torch's."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, backoff_factor: float = 0.5,
                 growth_factor: float = 2.0, growth_interval: int = 2000, enabled: bool = True,
                 process_group: AnyGroup | None = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then make the found-inf flag the same on every rank of the group.
        Collective over the group."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        scale_device = self._scale.device
        if not found:     # no gradients here: this rank still takes part, and step() needs a flag
            found[scale_device] = torch.zeros((), dtype=torch.float32, device=scale_device)
        agreed = torch.stack([flag.to(scale_device).reshape(()) for flag in found.values()]).amax()
        all_reduce(agreed, ReduceOp.MAX, group=resolve_group(self.process_group, "ShardedGradScaler.unscale_"))
        for flag in found.values():
            flag.copy_(agreed)

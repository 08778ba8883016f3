"""Make a module's parameters and buffers equal to one rank's: DDP's construction, its training forwards (buffers)
and the end of join().

Layer: ddp. Collective over the group passed in.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spmd.comm.collectives import broadcast
from spmd.comm.group import ProcessGroup


def broadcast_module_state(module: nn.Module, group: ProcessGroup, src: int, include_params: bool) -> None:
    """Overwrite buffers (and parameters) with group rank `src`'s, one broadcast per dtype. Collective."""
    tensors = [buf for buf in module.buffers()]
    if include_params:
        tensors = [param.detach() for param in module.parameters()] + tensors
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            flat = torch.cat([tensor.reshape(-1) for tensor in same_dtype])
            broadcast(flat, group=group, group_src=src)
            offset = 0
            for tensor in same_dtype:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

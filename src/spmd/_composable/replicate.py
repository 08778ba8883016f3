"""replicate: DDP applied to a module in place, by hooks instead of a wrapper (torch's
`_composable.replicate.replicate`, as TorchTitan's `apply_ddp` calls it).

Layer: _composable (L4: may import ddp and fsdp). The module keeps its class's behaviour and its parameter names
(no `module.` prefix in state dicts); its class becomes `DDP<Class>`, gaining `set_requires_gradient_sync` and
`register_comm_hook`. A DistributedDataParallel over the module, built at the first forward (so comm hooks
and fully_shard submodules added before it count), does the work: its forward-pre and forward hooks run DDP's
own steps around the module's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spmd.ddp.composable import ReplicateState, attach, replicate_state_of
from spmd.fsdp.state import state_of


def replicate(module: nn.Module, ignored_modules: Iterable[nn.Module] | None = None, **kwargs: Any) -> nn.Module:
    """Make `module` data parallel in place: DistributedDataParallel(module, **kwargs) runs its steps in hooks
    around the module's own forward, built at the first forward. Parameters of `ignored_modules` (and of
    fully_shard submodules, which reduce their own) are neither broadcast nor reduced. `device_id` (an int or a
    device) stands for `device_ids=[device_id]`, as in torch. Collective at the first forward."""
    if "device_id" in kwargs:
        device_id = kwargs.pop("device_id")
        if device_id is not None and (isinstance(device_id, bool) or not isinstance(device_id, int | torch.device)):
            raise RuntimeError(f"replicate: device_id must be an int or a torch.device, got "
                               f"{type(device_id).__name__}")
        cpu = device_id is None or (isinstance(device_id, torch.device) and device_id.type == "cpu")
        kwargs["device_ids"] = None if cpu else [device_id]
    if state_of(module) is not None:
        raise RuntimeError(f"replicate: {type(module).__name__} is already managed by fully_shard; apply "
                           f"replicate to a module fully_shard does not manage")
    if replicate_state_of(module) is not None:
        raise RuntimeError(f"replicate: {type(module).__name__} is already replicated; call replicate once per "
                           f"module")
    attach(module, ReplicateState(module, set(ignored_modules or ()), kwargs, lambda sub: state_of(sub) is not None))
    return module


replicate.state = replicate_state_of   # type: ignore[attr-defined]

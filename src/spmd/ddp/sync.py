"""Make a module's parameters and buffers equal to one rank's: DDP's construction, its training forwards (buffers)
and the end of join().

Layer: ddp. Collective over the group passed in.
"""

from __future__ import annotations

from torch import nn

from spmd.comm.collectives import broadcast_coalesced
from spmd.comm.group import ProcessGroup
from spmd.ddp.dtensor_params import local_of


def broadcast_module_state(module: nn.Module, group: ProcessGroup, src: int, include_params: bool) -> None:
    """Overwrite buffers (and parameters) with group rank `src`'s, one broadcast per dtype and device; those
    named in the module's DDP ignore list (ignored_names) keep their own values. Collective.

    Every rank groups the same tensors the same way (same module, same order), so the broadcasts line up. A
    DTensor's local shard is what is sent: the group's ranks hold replicas of it (see Note: DDP over DTensor
    parameters).
    """
    ignored = ignored_names(module)
    tensors = [local_of(buf) for name, buf in module.named_buffers() if name not in ignored]
    if include_params:
        tensors = [local_of(param.detach()) for name, param in module.named_parameters()
                   if name not in ignored] + tensors
    broadcast_coalesced(tensors, group=group, group_src=src)


IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def ignored_names(module: nn.Module) -> set[str]:
    """The names of the parameters and buffers DDP leaves alone in `module` (torch's
    `_set_params_and_buffers_to_ignore_for_model`): not broadcast, not reduced."""
    return set(getattr(module, IGNORE_ATTR, ()))

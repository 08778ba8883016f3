"""Averaging parameters over a group (torch's `model_averaging.utils`).

Layer: algorithms. One all-reduce of all the parameters flattened together; the average is written back into
each parameter in place, so it keeps its storage (optimizer state, views and hooks stay attached; torch's
rebinds `param.data` instead). As torch, each value is divided by the group size before the sum. A DTensor
parameter (tensor parallel under DDP) averages its local shard over the group, which holds its replicas (see
Note: DDP over DTensor parameters in spmd/ddp/dtensor_params.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from spmd.comm.collectives import all_reduce
from spmd.comm.group import NonMemberGroup
from spmd.comm.reduce_op import ReduceOp
from spmd.comm.world import AnyGroup, resolve_group
from spmd.ddp.dtensor_params import local_of

__all__ = ["average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average"]

Params = Iterable[nn.Parameter] | Iterable[dict]


def average_parameters(params: Iterator[nn.Parameter], process_group: AnyGroup | None) -> None:
    """Replace each parameter by its mean over `process_group` (default: the world). Collective over the group;
    a rank outside it returns at once."""
    if isinstance(process_group, NonMemberGroup):
        return
    group = resolve_group(process_group, "average_parameters")
    params = list(params)
    if not params:
        return
    shards = [local_of(p) for p in params]     # a DTensor's local shard, averaged over its replicas (as DDP's)
    with torch.no_grad():
        flat = torch.cat([shard.reshape(-1) for shard in shards])
        flat /= group.size()
        all_reduce(flat, ReduceOp.SUM, group=group)
        offset = 0
        for shard in shards:
            shard.copy_(flat[offset:offset + shard.numel()].view_as(shard))
            offset += shard.numel()


def get_params_to_average(params: Params) -> list[nn.Parameter]:
    """The parameters (from a list of them, or of an optimizer's param groups) that have a gradient: those the
    step trained, as torch picks them."""
    chosen = []
    for item in params:
        if isinstance(item, nn.Parameter):
            members = [item]
        elif isinstance(item, dict):
            members = list(item["params"])
        else:
            raise TypeError(f"average_parameters: expected parameters or param-group dicts, got "
                            f"{type(item).__name__}")
        chosen.extend(p for p in members if p.grad is not None)
    return chosen


def average_parameters_or_parameter_groups(params: Params, process_group: AnyGroup | None) -> None:
    """average_parameters over the parameters of `params` that have a gradient."""
    average_parameters(iter(get_params_to_average(params)), process_group)

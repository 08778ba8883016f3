"""torch's private c10d helpers that libraries call (`_rank_not_in_group`, `_resolve_process_group`,
`_get_pg_default_device`, ...), served at torch's underscore names by spmd.distributed_c10d.

Layer: comm. Each answers for spmd's groups what torch's answers for its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spmd.comm.group import NonMemberGroup, ProcessGroup
from spmd.comm.objects import staging_device
from spmd.comm.store.base import Store
from spmd.comm.world import AnyGroup, current_world, is_initialized, resolve_group

_VIEW_PREFIX = "spmd/"    # torch's name for its view of an spmd group (torch_backend.torch_group)


def rank_not_in_group(group: AnyGroup | None) -> bool:
    """Whether this rank is outside `group` (None: the default group, which holds every rank)."""
    return isinstance(group, NonMemberGroup)


def resolve_process_group(group_name: str) -> ProcessGroup:
    """This rank's group named `group_name` (its `group_name`, or the name torch gives its view of it)."""
    world = current_world()
    name = group_name.removeprefix(_VIEW_PREFIX)
    for group in world.groups:
        if isinstance(group, ProcessGroup) and group.group_name == name:
            return group
    known = [group.group_name for group in world.groups if isinstance(group, ProcessGroup)]
    raise ValueError(f"_resolve_process_group on rank {world.rank}: no group of this rank is named "
                     f"{group_name!r} (its groups: {known})")


def process_group_name(pg: AnyGroup) -> str:
    """The name `resolve_process_group` takes back (torch's `_get_process_group_name`)."""
    return resolve_group(pg, "_get_process_group_name").group_name


def default_store() -> Store:
    """The store init_process_group made or was given (torch's `_get_default_store`)."""
    if not is_initialized():
        raise ValueError("_get_default_store: the default process group has not been initialized; call "
                         "spmd.init_process_group first")
    return current_world().store


def group_size(group: AnyGroup | None) -> int:
    """The size of `group` (None: the default group)."""
    return resolve_group(group, "_get_group_size").size()


def pg_default_device(group: AnyGroup | None = None) -> torch.device:
    """The device the group's objects are staged on (torch's deprecated `_get_pg_default_device`): the CPU, or
    the current accelerator where the group's transport moves its tensors."""
    return staging_device(resolve_group(group, "_get_pg_default_device"))


def check_single_tensor(param: Any, param_name: str) -> None:
    """TypeError unless `param` is a tensor (torch's `_check_single_tensor`)."""
    if not isinstance(param, Tensor):
        raise TypeError(f"Invalid function argument. Expected parameter `{param_name}` of type torch.Tensor, "
                        f"but got {type(param).__name__} instead")


def check_tensor_list(param: Any, param_name: str) -> None:
    """TypeError unless `param` is a list of tensors (torch's `_check_tensor_list`)."""
    if not isinstance(param, list) or not all(isinstance(item, Tensor) for item in param):
        raise TypeError(f"Invalid function argument. Expected parameter `{param_name}` of type List[torch.Tensor], "
                        f"but got {type(param).__name__} instead")

"""torch's `checkpoint.utils` path: finding the object a plan item names in a state dict, for planners that
resolve items themselves (a SavePlanner's resolve_data, a LoadPlanner's lookup). Layer: checkpoint."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spmd.checkpoint.layout import local_tensor
from spmd.checkpoint.metadata import STATE_DICT_TYPE, MetadataIndex

__all__ = ["find_state_dict_object", "find_tensor_shard"]


def find_tensor_shard(tensor: Tensor, index: MetadataIndex) -> Tensor:
    """The part of `tensor` the item `index` names: a DTensor's local tensor when its box starts at `index.offset`,
    a plain tensor itself when the offset is its origin (or not given); ValueError for another offset."""
    local = local_tensor(index.fqn, tensor)
    if index.offset is None or tuple(index.offset) == local.box.offsets:
        return local.data
    kind = "DTensor whose box on this rank starts" if local.distributed else "plain tensor, which starts"
    raise ValueError(f"find_tensor_shard: {index.fqn!r} is a {kind} at {list(local.box.offsets)}, not at "
                     f"{list(index.offset)}")


def find_state_dict_object(state_dict: STATE_DICT_TYPE, index: MetadataIndex) -> Any:
    """The object at `index.fqn` of a flat state dict: for a tensor, the part `index` names (find_tensor_shard);
    ValueError for a key the state dict lacks, or an offset given for a value that is not a tensor."""
    if index.fqn not in state_dict:
        raise ValueError(f"find_state_dict_object: the state dict has no {index.fqn!r}")
    value = state_dict[index.fqn]
    if isinstance(value, torch.Tensor):
        return find_tensor_shard(value, index)
    if index.offset is not None:
        raise ValueError(f"find_state_dict_object: {index.fqn!r} is a {type(value).__name__}, not a tensor: it has "
                         f"no box at {list(index.offset)}")
    return value

"""DefaultSavePlanner and DefaultLoadPlanner (torch's names and arguments): the planners save and load use unless
given another, and the functions they are built of, for a subclass that changes one step.

Layer: checkpoint. No I/O, no communication (see planner, Note: a planner's calls).

Note: who writes what
Every rank plans every box it holds (layout: a DTensor's local shard is one box, a plain tensor the whole) and
every value. Ranks that hold the same box (a replicated mesh dim, other submeshes of a larger mesh, a plain
tensor every rank has) propose the same item, named by its key and offsets; the coordinator keeps one of each.
By default it balances, choosing as torch's does: item by item, in the order the ranks' plans list them (rank 0's
first), each goes to the rank among its holders with the fewest bytes planned so far (ties to the lowest rank; a
value counts one byte), so a replicated model is written by all ranks in parallel, and replicas that differ
(TorchTitan's router weights under tensor and expert parallelism) are saved from the rank torch's would save them
from. With dedup_save_to_lowest_rank=True, the lowest holding rank writes each. Keys only some ranks have
(pipeline stages) are written by those ranks.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.layout import Path, flatten, local_tensor
from spmd.checkpoint.metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorEntry,
    TensorProperties,
    decode_value,
    encode_value,
)
from spmd.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from spmd.checkpoint.planner_helpers import create_read_items_for_chunk_list
from spmd.tensor.api import DTensor

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner", "create_default_global_load_plan",
           "create_default_global_save_plan", "create_default_local_load_plan", "create_default_local_save_plan"]


class EncodedValue(io.BytesIO):
    """A value's bytes as the default planners write and read them: its JSON encoding (metadata.encode_value),
    which the checkpoint's metadata keeps as JSON. `value` is the value, `encoded` its JSON form."""

    def __init__(self, value: Any, key: str) -> None:
        self.value, self.encoded = value, encode_value(value, key)
        super().__init__(json.dumps(self.encoded).encode())


def _flattened(state_dict: STATE_DICT_TYPE, flatten_state_dict: bool) -> tuple[STATE_DICT_TYPE, dict[str, Path]]:
    """The state dict keyed by dotted path and each key's path (flatten_state_dict=False: the top level as is)."""
    if not flatten_state_dict:
        return state_dict, {key: (key,) for key in state_dict}
    flat = flatten(state_dict)
    return {key: leaf for key, (_, leaf) in flat.items()}, {key: path for key, (path, _) in flat.items()}


def _local(obj: Any) -> Any:
    """What this rank holds of a state-dict entry: a DTensor's local shard, anything else itself."""
    return obj._local_tensor if isinstance(obj, DTensor) else obj


def _lookup(state_dict: STATE_DICT_TYPE, index: MetadataIndex, planner: str) -> Any:
    try:
        return _local(state_dict[index.fqn])
    except KeyError:
        raise CheckpointError(f"{planner}: the plan names {index.fqn!r}, which the state dict it was set up with "
                              f"lacks") from None


def _assign(state_dict: STATE_DICT_TYPE, path: Path, value: Any) -> None:
    """Replace the leaf at `path` of the nested `state_dict` by `value`."""
    parent: Any = state_dict
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, tuple):
        raise CheckpointError(f"load: can't replace {'.'.join(map(str, path))!r} inside a tuple; use a list")
    parent[path[-1]] = value


# -- save -----------------------------------------------------------------------------------------------------

class DefaultSavePlanner(SavePlanner):
    """save's planner: every tensor box and value once (Note: who writes what). `flatten_state_dict`: nested dicts
    and lists of tensors are saved by dotted key (False: the top level only). `flatten_sharded_tensors` is accepted
    for torch's signature (spmd has no ShardedTensor); `enable_plan_caching` too (spmd plans each save afresh).
    `dedup_replicated_tensors=False` (torch: write every replica) is refused: the format holds each box once."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        if dedup_replicated_tensors is False:
            raise ValueError("DefaultSavePlanner: spmd's checkpoints hold each box of a tensor once; "
                             "dedup_replicated_tensors=False is not supported")
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.enable_plan_caching = enable_plan_caching
        self.state_dict: STATE_DICT_TYPE = {}
        self.mappings: dict[str, Path] = {}
        self.is_coordinator = False
        self.storage_meta: StorageMeta | None = None

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings = _flattened(state_dict, self.flatten_state_dict)
        self.storage_meta, self.is_coordinator = storage_meta, is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(_dedup(all_plans, self.dedup_save_to_lowest_rank))
        if self.flatten_state_dict:
            for plan in plans:
                metadata.paths.update({key: list(path) for key, path in (plan.planner_data or {}).items()})
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        return self.transform_object(write_item, self.lookup_object(write_item.index))

    def lookup_object(self, index: MetadataIndex) -> Any:
        """What the state dict holds at `index` (a DTensor: its local shard): a hook for subclasses."""
        return _lookup(self.state_dict, index, type(self).__name__)

    def transform_object(self, write_item: WriteItem, object: Any) -> Tensor | io.BytesIO:
        """What is written for `object`: a tensor as it is, a value as its JSON bytes; a hook for subclasses."""
        if write_item.type is WriteItemType.BYTE_IO:
            return EncodedValue(object, write_item.index.fqn)
        return object


def create_default_local_save_plan(state_dict: STATE_DICT_TYPE, is_coordinator: bool) -> SavePlan:
    """An item for each box this rank holds and each value (values that can't be saved are refused here, on the
    rank that holds them). A DTensor on a mesh this rank is not part of gives none."""
    items = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, Tensor):
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            held = local_tensor(fqn, obj)
            chunk = ChunkStorageMetadata(torch.Size(held.box.offsets), torch.Size(held.box.sizes))
            items.append(WriteItem(MetadataIndex(fqn, held.box.offsets, len(items)),
                                   WriteItemType.SHARD if held.distributed else WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(held.data),
                                                               torch.Size(held.shape))))
        else:
            encode_value(obj, fqn)
            items.append(WriteItem(MetadataIndex(fqn, index=len(items)), WriteItemType.BYTE_IO))
    return SavePlan(items)


def _dedup(all_plans: list[SavePlan], to_lowest_rank: bool) -> list[SavePlan]:
    """Each item in one plan only (Note: who writes what)."""
    holders: dict[MetadataIndex, list[int]] = {}        # in the order the plans list them, rank 0's first
    sizes: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            sizes[item.index] = item.tensor_storage_size() or 1
    planned = [0] * len(all_plans)
    writer: dict[MetadataIndex, int] = {}
    for index, ranks in holders.items():
        chosen = ranks[0] if to_lowest_rank else min(ranks, key=lambda rank: (planned[rank], rank))
        writer[index] = chosen
        planned[chosen] += sizes[index]
    return [dataclasses.replace(plan, items=[item for item in plan.items if writer[item.index] == rank])
            for rank, plan in enumerate(all_plans)]


def create_default_global_save_plan(all_plans: list[SavePlan], rewrite_index_hints: bool = True
                                    ) -> tuple[list[SavePlan], Metadata]:
    """The plans as they are and the metadata they make: each tensor's dtype and global shape, checked to be the
    same in every rank's items (the boxes and values are added as they are written). `rewrite_index_hints`: items
    without an index hint get their position (the default local plan numbers its items itself)."""
    tensors: dict[str, TensorEntry] = {}
    plans = []
    for rank, plan in enumerate(all_plans):
        items = []
        for position, item in enumerate(plan.items):
            if rewrite_index_hints and item.index.index is None:
                item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=position))
            items.append(item)
            if item.tensor_data is None:
                continue
            dtype, shape = tensor_format.dtype_name(item.tensor_data.properties.dtype), tuple(item.tensor_data.size)
            known = tensors.setdefault(item.index.fqn, TensorEntry(dtype, shape))
            if (known.dtype, known.shape) != (dtype, shape):
                raise CheckpointError(f"save: ranks disagree about {item.index.fqn!r}: {known.dtype} of shape "
                                      f"{list(known.shape)} on one, {dtype} of shape {list(shape)} on rank {rank}")
        plans.append(dataclasses.replace(plan, items=items))
    return plans, Metadata("", tensors, {}, {})


# -- load -----------------------------------------------------------------------------------------------------

class DefaultLoadPlanner(LoadPlanner):
    """load's planner: every tensor of the state dict gets the values of its box, every value is replaced.
    `allow_partial_load`: keys of the state dict the checkpoint lacks are left as they are instead of raising.
    `flatten_state_dict` as DefaultSavePlanner's; `flatten_sharded_tensors` is accepted for torch's signature."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_partial_load = allow_partial_load
        self.original_state_dict: STATE_DICT_TYPE = {}
        self.state_dict: STATE_DICT_TYPE = {}
        self.mappings: dict[str, Path] = {}
        self.metadata: Metadata | None = None
        self.is_coordinator = False

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = _flattened(state_dict, self.flatten_state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise CheckpointError(f"{type(self).__name__}: set_up_planner was not given the checkpoint's metadata")
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return create_default_global_load_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(value, EncodedValue):
            decoded = value.value
        else:
            try:
                decoded = decode_value(json.loads(value.getvalue()))
            except ValueError:
                raise CheckpointError(f"load: {fqn!r} was saved as bytes of a custom save planner's own, not as "
                                      f"spmd's JSON; load it with a planner whose load_bytes reads them") from None
        if self.flatten_state_dict:
            _assign(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        """The tensor this rank holds at `index` (a DTensor: its local shard): a hook for subclasses."""
        return _lookup(self.state_dict, index, type(self).__name__)

    def transform_tensor(self, read_item: ReadItem, tensor: Tensor) -> Tensor:
        """The region of `tensor` the item fills: a hook for subclasses. A dim read whole is not narrowed (a
        quantized weight such as NF4 slices no part of a dim, but takes a copy into all of it)."""
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            if length < tensor.shape[dim]:
                tensor = tensor.narrow(dim, start, length)
        return tensor


def create_default_local_load_plan(state_dict: STATE_DICT_TYPE, metadata: Metadata, strict: bool = True) -> LoadPlan:
    """An item for each overlap of a box this rank holds with a saved box, and for each value. Refuses a tensor
    saved with another dtype or shape, and (`strict`) keys the checkpoint lacks."""
    items: list[ReadItem] = []
    missing = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, Tensor):
            entry = metadata.tensors.get(fqn)
            if entry is None:
                missing.append(fqn)
            else:
                items.extend(_tensor_reads(fqn, obj, entry, metadata))
        elif fqn in metadata.values or fqn in metadata.blobs:
            items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), torch.Size(), MetadataIndex(fqn),
                                  torch.Size(), torch.Size()))
        elif fqn in metadata.tensors:
            raise CheckpointError(f"{metadata.where}: {fqn!r} is a tensor in the checkpoint but a "
                                  f"{type(obj).__name__} in the state dict loaded into")
        elif not _torch_writes_a_key_for(obj):
            continue        # nothing to load, and torch's DCP saves nothing for it (LambdaLR's lr_lambdas: [{}])
        else:
            missing.append(fqn)
    if missing and strict:
        raise CheckpointError(f"{metadata.where} has no {', '.join(repr(k) for k in missing[:8])}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} keys of the state dict; "
                              f"pass planner=DefaultLoadPlanner(allow_partial_load=True) to leave them be)")
    return LoadPlan(items)


def _torch_writes_a_key_for(value: object) -> bool:
    """Whether torch's DCP flattening of `value` writes any key: not for an empty mapping, nor for a list it walks
    (one holding a mapping) whose every entry writes none."""
    if isinstance(value, Mapping):
        return any(_torch_writes_a_key_for(item) for item in value.values())
    if isinstance(value, list) and value and all(isinstance(item, (Mapping, list)) for item in value):
        return any(_torch_writes_a_key_for(item) for item in value)
    return True


def _tensor_reads(fqn: str, tensor: Tensor, entry: TensorEntry, metadata: Metadata) -> list[ReadItem]:
    target = local_tensor(fqn, tensor)
    dtype, where = tensor_format.dtype_of(entry.dtype), metadata.where
    if target.shape != entry.shape or (target.data.dtype != dtype and not metadata.casts_on_load):
        raise CheckpointError(f"{where}: {fqn!r} was saved as {dtype} of shape {list(entry.shape)}, but the state "
                              f"dict holds {target.data.dtype} of shape {list(target.shape)}")
    held = ChunkStorageMetadata(torch.Size(target.box.offsets), torch.Size(target.box.sizes))
    reads = create_read_items_for_chunk_list(fqn, entry, [held])
    filled = sum(math.prod(read.lengths) for read in reads)
    if filled != target.box.volume:
        raise CheckpointError(f"{where}: the saved boxes of {fqn!r} cover {filled} of the {target.box.volume} "
                              f"elements this rank holds")
    return reads


def create_default_global_load_plan(all_plans: list[LoadPlan]) -> list[LoadPlan]:
    """The plans as they are: each rank reads what it planned."""
    return all_plans

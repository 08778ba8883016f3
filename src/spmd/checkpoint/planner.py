"""torch's planner protocol for save and load: the plans (SavePlan of WriteItems, LoadPlan of ReadItems) and the
two planner interfaces a user subclasses to rename, filter, cast or add what a checkpoint holds.

Layer: checkpoint. No I/O, no communication: save and load (api.py) call a planner's methods in torch's order
(Note: a planner's calls); the default planners are in default_planner.py.

Note: a planner's calls
  save (collective): set_up_planner(state dict, StorageMeta, is_coordinator) -> create_local_plan() on every
      rank; the local plans are exchanged as JSON (planner_data and storage_data must be JSON-able: nothing is
      unpickled); the coordinator (rank 0 of the group) runs create_global_plan(all plans) -> (plans, metadata);
      each rank gets its plan back and runs finish_plan(plan), then resolve_data(item) for each of its items,
      and writes what that returns. A rank whose planner raises still takes part, so every rank raises the
      same CheckpointError and none waits for it.
  load (not collective: each rank plans what it reads by itself): set_up_planner(state dict, Metadata,
      is_coordinator) -> create_local_plan() -> create_global_plan([this rank's plan])[0] -> finish_plan(plan);
      then for each item: a tensor box is copied into resolve_tensor(item), then commit_tensor(item, tensor);
      a value's bytes go to load_bytes(item, BytesIO).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import io
import math
from typing import Any

import torch

from spmd.checkpoint.metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)

__all__ = ["BytesIOWriteData", "LoadItemType", "LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner",
           "TensorWriteData", "WriteItem", "WriteItemType"]


class WriteItemType(enum.Enum):
    """What a WriteItem writes: a whole plain tensor, one box of a distributed one, or a value's bytes."""

    TENSOR = enum.auto()
    SHARD = enum.auto()
    BYTE_IO = enum.auto()


class LoadItemType(enum.Enum):
    """What a ReadItem reads: a region of a saved box, or a value's bytes."""

    TENSOR = 0
    BYTE_IO = 1


@dataclasses.dataclass(frozen=True, slots=True)
class BytesIOWriteData:
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class TensorWriteData:
    """The box a tensor WriteItem writes, the dtype it is saved as, and the global size."""

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclasses.dataclass(frozen=True, slots=True)
class WriteItem:
    """One thing a rank writes: a tensor's box (tensor_data) or a value (BYTE_IO)."""

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """The bytes the box takes, or None for a value."""
        if self.tensor_data is None:
            return None
        return math.prod(self.tensor_data.chunk.sizes) * torch.empty((), dtype=self.tensor_data.properties.dtype
                                                                     ).element_size()


@dataclasses.dataclass(frozen=True, slots=True)
class ReadItem:
    """One copy a load makes: `lengths` elements per dim, from `storage_offsets` inside the saved box named by
    `storage_index` to `dest_offsets` inside the tensor this rank holds (dest_index); or a value's bytes."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclasses.dataclass(slots=True)
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """What save asks of a planner (see Note: a planner's calls). Subclass DefaultSavePlanner to change one step."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        """Take the state dict this rank saves (Stateful values already replaced by their state_dict())."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """What this rank could write."""

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Every rank's plan, deduplicated or rebalanced, and the metadata they make."""

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's plan as the coordinator decided it, before its items are resolved."""

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The data of one item: the box's tensor (the item's sizes and dtype, any device), or a value's bytes."""


class LoadPlanner(abc.ABC):
    """What load asks of a planner (see Note: a planner's calls). Subclass DefaultLoadPlanner to change one step."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """Take the state dict this rank fills and the checkpoint's metadata."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """What this rank reads."""

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as they run (spmd's load passes this rank's alone)."""

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """This rank's plan as it runs."""

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Take a saved value's bytes."""

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The tensor a region is copied into: `read_item.lengths` in shape."""

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Called once the region is in `tensor` (resolve_tensor's), to move it where it belongs if it wasn't."""

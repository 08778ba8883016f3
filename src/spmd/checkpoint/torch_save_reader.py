"""Loading a torch.save file straight into a model of any layout (torch's `format_utils.BroadcastingTorchSaveReader`
with its `DynamicMetaLoadPlanner`): one rank reads the file, every tensor is broadcast whole, and each rank keeps
its boxes.

Layer: checkpoint.

    dcp.load({"model": model_sd}, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(),
             checkpoint_id="model.pt")

Note: loading a torch.save file
A torch.save file has no index, so the planner makes one from the state dict it loads into: each tensor saved
whole, as one box of its global shape, which each rank's plan reads its own boxes of. The reader's read_data is
collective over the default group: the coordinator (global rank `coordinator_rank`) loads the file
(`torch.load(weights_only=True)`: tensors and plain values, never arbitrary objects), checks that it holds every
key of the state dict with the global shape expected, and broadcasts its verdict, so a wrong file fails on every
rank with the same error instead of hanging the others; then it broadcasts each tensor in the state dict's order,
cast to the state dict's dtype, and every rank copies the regions its plan reads. The broadcasts follow the
state dict, not the plans, so a rank whose plan reads nothing of a tensor (an empty shard) still takes part.
Only tensors load, as in torch's; the whole of each tensor passes through every rank's memory in turn.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.default_planner import DefaultLoadPlanner, _flattened
from spmd.checkpoint.metadata import Chunk, Metadata, TensorEntry
from spmd.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from spmd.checkpoint.storage import StorageReader
from spmd.comm.collectives import broadcast
from spmd.comm.objects import broadcast_object_list
from spmd.comm.world import get_rank
from spmd.tensor.api import DTensor

__all__ = ["BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]


class BroadcastingTorchSaveReader(StorageReader):
    """A torch.save file read by global rank `coordinator_rank` and broadcast, tensor by tensor, for
    DynamicMetaLoadPlanner's load (see Note: loading a torch.save file). Collective over the default group."""

    def __init__(self, checkpoint_id: str | os.PathLike[str] | None = None, coordinator_rank: int = 0) -> None:
        self.checkpoint_id = checkpoint_id
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.checkpoint_id = checkpoint_id

    def read_metadata(self) -> Metadata:
        """An empty index: DynamicMetaLoadPlanner makes the real one from the state dict."""
        return Metadata("torch.save", {}, {}, {}, where=self._where())

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **_: Any) -> None:
        if self.checkpoint_id is None:
            raise CheckpointError("BroadcastingTorchSaveReader: pass checkpoint_id (the torch.save file) to load")
        self.is_coordinator = get_rank() == self.coordinator_rank

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Broadcast every tensor of the planner's state dict from the coordinator; each rank fills what its plan
        reads. Collective."""
        if not isinstance(planner, DynamicMetaLoadPlanner):
            raise CheckpointError(f"BroadcastingTorchSaveReader: load with planner=DynamicMetaLoadPlanner() (got "
                                  f"{type(planner).__name__}): a torch.save file has no index to plan from")
        targets = {key: value for key, value in planner.state_dict.items() if isinstance(value, Tensor)}
        saved = self._load_on_coordinator(planner, targets)
        items: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type is LoadItemType.BYTE_IO:
                raise CheckpointError(f"BroadcastingTorchSaveReader loads tensors only; {item.storage_index.fqn!r} "
                                      f"is not one")
            items.setdefault(item.storage_index.fqn, []).append(item)
        for key, target in targets.items():
            whole = (saved[key].to(target.dtype).contiguous() if saved is not None
                     else torch.empty(target.shape, dtype=target.dtype))
            broadcast(whole, src=self.coordinator_rank)
            for item in items.get(key, []):
                region = whole
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    region = region.narrow(dim, start, length)
                destination = planner.resolve_tensor(item).detach()
                destination.copy_(region)
                planner.commit_tensor(item, destination)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _load_on_coordinator(self, planner: DynamicMetaLoadPlanner, targets: dict[str, Tensor]
                             ) -> dict[str, Tensor] | None:
        """The file's tensors by flattened key (on the coordinator; None elsewhere), after every rank learned
        whether the file can fill `targets`."""
        saved, verdict = None, [None]
        if self.is_coordinator:
            try:
                loaded = torch.load(self.checkpoint_id, map_location="cpu", weights_only=True)
                saved = _flattened(loaded, planner.flatten_state_dict)[0] if isinstance(loaded, dict) else None
                verdict = [_mismatch(saved, targets, self._where())]
            except Exception as error:
                verdict = [f"{self._where()} can't be read as a torch.save file: {type(error).__name__}: {error}"]
        broadcast_object_list(verdict, src=self.coordinator_rank)
        if verdict[0] is not None:
            raise CheckpointError(verdict[0])
        return saved

    def _where(self) -> str:
        return os.fspath(self.checkpoint_id) if self.checkpoint_id is not None else "BroadcastingTorchSaveReader"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isfile(checkpoint_id)


def _mismatch(saved: dict[str, Any] | None, targets: dict[str, Tensor], where: str) -> str | None:
    """Why the file's tensors can't fill `targets` (None when they can)."""
    if saved is None:
        return f"{where} holds no dict of tensors (a torch.save file of a state dict is expected)"
    missing = [key for key in targets if not isinstance(saved.get(key), Tensor)]
    if missing:
        return (f"{where} has no tensor {', '.join(repr(k) for k in missing[:8])}{' ...' if len(missing) > 8 else ''}"
                f" ({len(missing)} keys of the state dict loaded into)")
    wrong = [f"{key!r} {list(saved[key].shape)} (expected {list(target.shape)})" for key, target in targets.items()
             if saved[key].shape != target.shape]
    if wrong:
        return f"{where} holds tensors of other shapes: {'; '.join(wrong[:8])}"
    return None


class DynamicMetaLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with the index made from the state dict loaded into (each tensor one whole box), for
    BroadcastingTorchSaveReader (see Note: loading a torch.save file). Tensors only, as torch's."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        tensors = {}
        for key, value in self.state_dict.items():
            if not isinstance(value, Tensor):
                raise CheckpointError(f"DynamicMetaLoadPlanner loads tensors only; {key!r} is a "
                                      f"{type(value).__name__}")
            shape = tuple(value.shape)          # a DTensor's global shape
            dtype = value._local_tensor.dtype if isinstance(value, DTensor) else value.dtype
            tensors[key] = TensorEntry(tensor_format.dtype_name(dtype), shape,
                                       [Chunk("", key, (0,) * len(shape), shape, None)])
        where = metadata.where if metadata is not None else "a torch.save file"
        self.metadata = Metadata("torch.save", tensors, {}, {}, where=where)

"""load_sharded_optimizer_state_dict (torch's, from the FSDP1 checkpoint tutorials): read the optimizer state
saved under one key of a checkpoint, each state tensor laid out like its parameter in the model's sharded
state dict, ready for FullyShardedDataParallel.optim_state_dict_to_load.

Layer: checkpoint. A state tensor shaped like its parameter (exp_avg, momentum_buffer) is read as a DTensor with
the parameter's layout, so each rank reads only its shard; a scalar (step), or a tensor whose parameter the
model state dict lacks, is read whole; values (param_groups) come from the checkpoint's index.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.checkpoint.api import _read_metadata, load
from spmd.checkpoint.format import dtype_of
from spmd.checkpoint.planner import LoadPlanner
from spmd.checkpoint.storage import StorageReader
from spmd.tensor import DTensor


def load_sharded_optimizer_state_dict(model_state_dict: dict[str, Any], optimizer_key: str,
                                      storage_reader: StorageReader,
                                      planner: LoadPlanner | None = None) -> dict[str, Any]:
    """{optimizer_key: the optimizer state dict saved under that key}, its state tensors laid out like their
    parameters in `model_state_dict` (the model's sharded state dict: DTensors), read with `storage_reader`."""
    metadata = _read_metadata(storage_reader, type(storage_reader).__name__)
    flat: dict[str, Any] = {}
    for key, path in metadata.paths.items():
        if not path or path[0] != optimizer_key:
            continue
        if key in metadata.values:
            flat[key] = metadata.values[key]
            continue
        entry = metadata.tensors.get(key)
        if entry is None:
            continue
        like = model_state_dict.get(str(path[2])) if len(path) > 3 and path[1] == "state" else None
        if isinstance(like, DTensor) and tuple(like.shape) == entry.shape:
            flat[key] = torch.empty_like(like, dtype=dtype_of(entry.dtype))
        else:
            flat[key] = torch.empty(entry.shape, dtype=dtype_of(entry.dtype))
    tensors = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
    load(tensors, storage_reader=storage_reader, planner=planner)
    flat.update(tensors)
    return metadata.nested(flat)

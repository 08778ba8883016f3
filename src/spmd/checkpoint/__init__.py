"""Distributed checkpoints: `import spmd.checkpoint as dcp` where torch's DCP is imported as `dcp`.

Layer: checkpoint (L5). save / load / async_save (api.py), the storage interface (storage.py), the format
(format.py: safetensors files; metadata.py: the JSON index), the layout of each tensor (layout.py) and, in state_dict.py,
state dicts of plain, DDP, FSDP2, tensor-parallel and pipeline-stage models.
"""

from spmd._core.errors import CheckpointError
from spmd.checkpoint.api import DefaultLoadPlanner, DefaultSavePlanner, Stateful, async_save, load, save
from spmd.checkpoint.metadata import Metadata
from spmd.checkpoint.storage import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter

__all__ = [
    "CheckpointError", "DefaultLoadPlanner", "DefaultSavePlanner", "FileSystemReader", "FileSystemWriter",
    "Metadata", "Stateful", "StorageReader", "StorageWriter", "async_save", "load", "save",
]

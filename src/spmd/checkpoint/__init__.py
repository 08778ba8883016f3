"""Distributed checkpoints: `import spmd.checkpoint as dcp` where torch's DCP is imported as `dcp`.

Layer: checkpoint (L5). save / load / async_save (api.py), torch's planner protocol (planner.py, default_planner.py),
the storage interface (storage.py), Hugging Face checkpoints (hf_storage.py), torch's DCP format (torch_format.py
reads it, torch_format_writer.py writes it), the format (format.py: safetensors files; metadata.py: the JSON
index), the layout of each tensor (layout.py) and, in state_dict.py, state dicts of plain, DDP, FSDP2,
tensor-parallel and pipeline-stage models.
"""

from spmd._core.errors import CheckpointError
from spmd.checkpoint.api import CheckpointException, Stateful, async_save, load, load_state_dict, save, save_state_dict
from spmd.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from spmd.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from spmd.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from spmd.checkpoint.optimizer import load_sharded_optimizer_state_dict
from spmd.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from spmd.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from spmd.checkpoint.storage import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from spmd.checkpoint.torch_format_writer import TorchFormatWriter

__all__ = [
    "BytesStorageMetadata", "CheckpointError", "CheckpointException", "ChunkStorageMetadata", "DefaultLoadPlanner",
    "DefaultSavePlanner", "FileSystemReader", "FileSystemWriter", "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter", "LoadPlan", "LoadPlanner", "Metadata", "QuantizedHuggingFaceStorageReader", "ReadItem",
    "SavePlan", "SavePlanner", "Stateful", "StorageReader", "StorageWriter", "TensorStorageMetadata",
    "TorchFormatWriter", "WriteItem", "async_save", "load", "load_sharded_optimizer_state_dict", "load_state_dict",
    "save", "save_state_dict",
]

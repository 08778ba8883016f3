"""The checkpoint's index, `metadata.json`: every tensor's global shape and dtype and which file holds which box of
it at which key, each box's CRC-32, every data file's size, and the non-tensor values, all as JSON; and torch's
names for what a planner sees of it (MetadataIndex, ChunkStorageMetadata, TensorStorageMetadata, ...).

Layer: checkpoint. Pure data. Non-tensor values are JSON with a few tags for what JSON lacks (tuples, bytes,
non-finite floats, dicts with non-string keys); anything else can't be saved, since loading must never run code.
The bytes a custom planner writes for a value itself (resolve_data returning its own BytesIO) are kept as they
are, as `blobs`, for its load planner to read.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
from typing import Any

import torch

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format

FORMAT_VERSION = 2             # 2: boxes may be stored as their tensors (Chunk.encoding); written only by such saves
METADATA_FILE = "metadata.json"
# Beside the index, once it is written: a note under torch's DCP index name, so tools that find complete DCP
# checkpoints by that file (TorchTitan's resume looks for step-N/.metadata) find spmd's too. Not torch's pickle:
# torch's DCP can't read spmd's format (spmd reads torch's, torch_format.py; for torch, save with TorchFormatWriter
# or convert, torch_format_writer.py).
DCP_MARKER_FILE = ".metadata"
DCP_MARKER = (b"spmd checkpoint: its index is metadata.json. torch's DCP can't read this format; spmd reads "
              b"torch's.\n")
FORMAT_NAME = "spmd.checkpoint"


STATE_DICT_TYPE = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class MetadataIndex:
    """One item of a flattened state dict (torch's name): its key and, for a tensor, where the box starts in the
    global tensor; `index`, a position hint, takes no part in equality."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.offset is not None and not isinstance(self.offset, torch.Size):
            object.__setattr__(self, "offset", torch.Size(self.offset))


@dataclasses.dataclass(slots=True)
class ChunkStorageMetadata:
    """One box of a tensor (torch's name): where it starts in the global tensor, and its extent."""

    offsets: torch.Size
    sizes: torch.Size


@dataclasses.dataclass(slots=True)
class TensorProperties:
    """What a tensor is besides its values (torch's name); a checkpoint keeps the dtype."""

    dtype: torch.dtype = dataclasses.field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        return TensorProperties(tensor.dtype, tensor.layout, tensor.requires_grad, torch.contiguous_format,
                                tensor.device.type == "cpu" and tensor.is_pinned())


@dataclasses.dataclass(slots=True)
class TensorStorageMetadata:
    """A saved tensor as a load planner sees it (torch's name): properties, global size, and the saved boxes."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclasses.dataclass(slots=True)
class BytesStorageMetadata:
    """A saved non-tensor value, as a load planner sees it (torch's name)."""


STORAGE_TYPES = TensorStorageMetadata | BytesStorageMetadata


@dataclasses.dataclass(slots=True)
class StorageMeta:
    """Where a save goes, as a save planner's set_up_planner is told (torch's name)."""

    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One box of a global tensor, as one file holds it."""

    file: str                    # the data file, relative to the checkpoint directory
    key: str                     # the tensor's name inside that file
    offsets: tuple[int, ...]     # where the box starts in the global tensor, per dim
    sizes: tuple[int, ...]
    crc32: int | None            # of the box's bytes, contiguous, in the file (None: a format without, e.g. HF's)
    encoding: str | None = None  # None: the values; "torch.save": the tensor itself (storage.py, Note: compressed
                                 # tensors)


@dataclasses.dataclass(slots=True)
class TensorEntry:
    dtype: str                   # the safetensors name (format.dtype_name)
    shape: tuple[int, ...]       # global
    chunks: list[Chunk] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Metadata:
    save_id: str
    tensors: dict[str, TensorEntry]
    values: dict[str, Any]       # flattened key -> the value (decoded)
    files: dict[str, int]        # data file -> its size in bytes
    paths: dict[str, list[str | int]] = dataclasses.field(default_factory=dict)
    """key -> where it sat in the nested state dict saved (dict keys and list indices), to rebuild the nesting."""
    version: int = 1
    blobs: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """key -> the bytes a custom save planner's resolve_data gave for a value (its load planner reads them)."""
    where: str = dataclasses.field(default="the checkpoint", compare=False, repr=False)
    """What error messages call the checkpoint (not saved)."""
    casts_on_load: bool = dataclasses.field(default=False, compare=False, repr=False)
    """Whether a load casts a tensor saved in another dtype to the state dict's (a Hugging Face checkpoint's
    bfloat16 weights into float32 parameters); spmd's own checkpoints refuse the mismatch (not saved)."""
    storage_data: Any = dataclasses.field(default=None, compare=False, repr=False)
    """torch's: where a storage of torch's protocol put each item ({MetadataIndex: its WriteResult's
    storage_data}), set by that writer's finish and kept by however it stores this object (not in spmd's JSON)."""

    @property
    def state_dict_metadata(self) -> dict[str, STORAGE_TYPES]:
        """torch's view of the index: each key's saved boxes, or that it is a value."""
        view: dict[str, STORAGE_TYPES] = {
            key: TensorStorageMetadata(TensorProperties(tensor_format.dtype_of(entry.dtype)), torch.Size(entry.shape),
                                       [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                                        for c in entry.chunks])
            for key, entry in self.tensors.items()}
        view.update({key: BytesStorageMetadata() for key in [*self.values, *self.blobs]})
        return view

    @property
    def planner_data(self) -> dict[str, tuple[str | int, ...]]:
        """torch's name for what the default planners keep: each key's path in the nested state dict."""
        return {key: tuple(path) for key, path in self.paths.items()}

    def nested(self, state: dict[str, Any]) -> dict[str, Any]:
        """The flat `state` (keys of this checkpoint) put back into the nesting it was saved with (lists where it
        had list indices)."""
        root: dict[Any, Any] = {}
        for key, value in state.items():
            path = self.paths.get(key, key.split("."))
            node = root
            for step in path[:-1]:
                node = node.setdefault(step, {})
            node[path[-1]] = value
        return _lists(root)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_NAME, "version": self._written_version(), "save_id": self.save_id, "files": self.files,
            "tensors": {key: {"dtype": e.dtype, "shape": list(e.shape),
                              "chunks": [{"file": c.file, "key": c.key, "offsets": list(c.offsets),
                                          "sizes": list(c.sizes), "crc32": c.crc32,
                                          **({"encoding": c.encoding} if c.encoding else {})} for c in e.chunks]}
                        for key, e in self.tensors.items()},
            "values": {key: encode_value(value, key) for key, value in self.values.items()},
            "paths": self.paths,
        }
        if self.blobs:
            body["blobs"] = {key: base64.b64encode(blob).decode() for key, blob in self.blobs.items()}
        return json.dumps(body, indent=1).encode()

    def _written_version(self) -> int:
        """The oldest format version that holds this checkpoint, so an older spmd reads what it can and says
        "newer" for the rest (version 2: a box stored as its tensor)."""
        encoded = any(chunk.encoding for entry in self.tensors.values() for chunk in entry.chunks)
        return max(self.version, 2 if encoded else 1)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Metadata:
        try:
            body = json.loads(data)
        except ValueError as error:
            raise CheckpointError(f"{where}: the metadata is not valid JSON ({error}); the file is corrupted") \
                from error
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not an spmd checkpoint's metadata")
        version = body.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(f"{where}: written in checkpoint format version {version}, newer than this spmd "
                                  f"reads ({FORMAT_VERSION}); load it with a newer spmd")
        try:
            tensors = {key: TensorEntry(e["dtype"], tuple(e["shape"]),
                                        [Chunk(c["file"], c["key"], tuple(c["offsets"]), tuple(c["sizes"]),
                                               None if c["crc32"] is None else int(c["crc32"]), c.get("encoding"))
                                         for c in e["chunks"]])
                       for key, e in body["tensors"].items()}
            values = {key: decode_value(value) for key, value in body["values"].items()}
            blobs = {key: base64.b64decode(blob, validate=True) for key, blob in body.get("blobs", {}).items()}
            return cls(str(body["save_id"]), tensors, values, {k: int(v) for k, v in body["files"].items()},
                       {k: list(v) for k, v in body.get("paths", {}).items()}, version, blobs, where)
        except (KeyError, TypeError, ValueError) as error:   # a bad base64 blob is a ValueError
            raise CheckpointError(f"{where}: malformed metadata ({type(error).__name__}: {error})") from error


# -- values ---------------------------------------------------------------------------------------------------

_TAG = "__spmd__"


def encode_value(value: Any, key: str) -> Any:
    """`value` as JSON (tagged where JSON has no such type); raises naming `key` for what can't be saved."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode_value(item, key) for item in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode_value(item, key) for item in value]}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode_value(v, key) for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode_value(k, key), encode_value(v, key)] for k, v in value.items()]}
    raise CheckpointError(f"checkpoint: {key!r} holds a {type(value).__name__}, which can't be saved without "
                          f"pickle; save tensors, numbers, strings, bytes, or lists, tuples and dicts of them "
                          f"(or an object with state_dict/load_state_dict returning such values)")


def decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode_value(v) for k, v in value.items()}
    if tag == "float":
        return float(value["value"])
    if tag == "tuple":
        return tuple(decode_value(item) for item in value["items"])
    if tag == "bytes":
        return base64.b64decode(value["base64"])
    if tag == "dict":
        return {_hashable(decode_value(k)): decode_value(v) for k, v in value["items"]}
    raise CheckpointError(f"checkpoint metadata: unknown value tag {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {key: _lists(value) for key, value in node.items()}
    if items and all(isinstance(key, int) for key in items) and sorted(items) == list(range(len(items))):
        return [items[index] for index in range(len(items))]
    return items

"""Checkpoints torch's DCP wrote (its FileSystemWriter's `.metadata` and `__<rank>_<n>.distcp` files), loaded by
spmd into any layout: a job moving to spmd resumes from the checkpoints it already has. load() picks this reader
for a directory holding torch's `.metadata` and no `metadata.json`.

Layer: checkpoint. Nothing of the checkpoint's author runs: `.metadata` is a pickle, read by an unpickler that
builds only the metadata's own records (torch's dataclasses, as plain records here), torch dtypes, layouts and
sizes, and refuses any other global; each saved tensor and value is a torch.save blob, read with
torch.load(weights_only=True). A box is loaded whole the first time a region of it is asked for (torch.save
blobs can't be sliced on disk) and kept until the next box.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.layout import Box
from spmd.checkpoint.metadata import Chunk, Metadata, TensorEntry
from spmd.checkpoint.storage import FileSystemReader

TORCH_METADATA_FILE = ".metadata"


class _Record:
    """One of torch's metadata dataclasses, as its pickle's state (a dict; TensorProperties's is a tuple)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):        # TensorProperties: (dtype, layout, requires_grad, memory format, pin)
            self.__dict__["dtype"] = state[0]
        else:
            self.__dict__.update(state)


def _layout(name: str) -> torch.layout:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _path(*parts: str) -> str:
    return os.path.join(*parts) if parts else ""


# torch's checkpoint records, by the path of the module that defines them inside its distributed package (the
# pickle names them there; spmd builds its own plain records instead of importing torch's)
_RECORDS = {("checkpoint", "metadata"): {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                         "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                         "StorageMeta"},
            ("checkpoint", "filesystem"): {"_StorageInfo"}}
_MEMORY_FORMAT = (("checkpoint", "metadata"), "_MEM_FORMAT_ENCODING")    # an enum, pickled as its int value


def torch_module(*within: str) -> str:
    """The name of a module of torch's distributed package (`within` it: ("checkpoint", "metadata")), as torch's
    pickles name it."""
    return ".".join(("torch", "distributed", *within))


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch's checkpoint metadata out of plain records; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        package, _, inner = module.partition(".")
        within = tuple(inner.split(".")[1:]) if package == "torch" and inner.startswith("distributed.") else ()
        if (within, name) == _MEMORY_FORMAT:
            return int
        if name in _RECORDS.get(within, ()):
            return type(name, (_Record,), {})
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("torch.serialization", "torch._utils") and name == "_get_layout":
            return _layout
        if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath"):
            return _path
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not part of torch's checkpoint metadata")


class _Node(dict):
    """An inner node of the tree of saved values (a dict that is not itself a saved value)."""


def _gathered_values(values: dict[str, Any], tensors: dict[str, TensorEntry],
                     paths: dict[str, list[Any]]) -> dict[str, Any]:
    """Each container holding values only, under its own key: torch flattens a list of dicts of numbers (an
    optimizer's param_groups) down to each number ("optim.param_groups.0.lr"); spmd's state dicts may ask for the
    list whole ("optim.param_groups")."""
    root = _Node()
    for key, value in values.items():
        path = paths.get(key, [key])
        node = root
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, _Node):
                child = node[part] = _Node()
            node = child
        node[path[-1]] = value
    holding_tensors = {tuple(path[:depth]) for path in (paths.get(key, [key]) for key in tensors)
                       for depth in range(1, len(path))}
    gathered: dict[str, Any] = {}

    def build(node: _Node, path: tuple[Any, ...]) -> Any:
        items = {part: build(child, (*path, part)) if isinstance(child, _Node) else child
                 for part, child in node.items()}
        whole: Any = dict(items)
        if items and all(isinstance(part, int) for part in items) and set(items) == set(range(len(items))):
            whole = [items[index] for index in range(len(items))]
        if path and path not in holding_tensors:
            gathered[".".join(map(str, path))] = whole
        return whole

    build(root, ())
    return {key: value for key, value in gathered.items() if key not in values}


def is_torch_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether directory `path` holds a checkpoint torch's DCP wrote (and not spmd's)."""
    from spmd.checkpoint.metadata import DCP_MARKER, METADATA_FILE

    where = os.path.join(path, TORCH_METADATA_FILE)
    if not os.path.isfile(where) or os.path.exists(os.path.join(path, METADATA_FILE)):
        return False
    with open(where, "rb") as file:
        return file.read(len(DCP_MARKER)) != DCP_MARKER       # spmd's note of an incomplete save, not torch's index


class TorchCheckpointReader(FileSystemReader):
    """Reads a checkpoint directory torch's DCP FileSystemWriter wrote (torch.save serialization, the default)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._boxes: dict[str, tuple[str, int, int]] = {}      # chunk key -> file, offset, length
        self._held: tuple[str, Tensor] | None = None
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._boxes, self._held = {}, None
        super().reset(checkpoint_id)

    def read_metadata(self) -> Metadata:
        where = os.path.join(self.path, TORCH_METADATA_FILE)
        try:
            with open(where, "rb") as file:
                torch_metadata = _MetadataUnpickler(file).load()
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} is not a torch checkpoint: it has no {TORCH_METADATA_FILE}") \
                from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint {self.path}: {TORCH_METADATA_FILE} is not torch's checkpoint "
                                  f"metadata ({error})") from error
        storage = {(index.fqn, tuple(getattr(index, "offset", None) or ())): info
                   for index, info in (torch_metadata.storage_data or {}).items()}
        tensors: dict[str, TensorEntry] = {}
        values: dict[str, Any] = {}
        files: dict[str, int] = {}
        for fqn, entry in torch_metadata.state_dict_metadata.items():
            if type(entry).__name__ == "BytesStorageMetadata":
                values[fqn] = self._value(fqn, self._storage(storage, fqn, ()))
                continue
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                info = self._storage(storage, fqn, offsets)
                key = f"{fqn}@{','.join(map(str, offsets))}"
                self._boxes[key] = (info.relative_path, int(info.offset), int(info.length))
                files.setdefault(info.relative_path, 0)
                chunks.append(Chunk(info.relative_path, key, offsets, sizes, None))
            tensors[fqn] = TensorEntry(tensor_format.dtype_name(entry.properties.dtype), tuple(entry.size), chunks)
        for name in files:
            files[name] = self.file_size(name) or 0
        paths = {key: list(path) for key, path in (torch_metadata.planner_data or {}).items()}
        values.update(_gathered_values(values, tensors, paths))
        return Metadata(save_id="", tensors=tensors, values=values, files=files, paths=paths, casts_on_load=True)

    def _storage(self, storage: dict[tuple[str, tuple[int, ...]], Any], fqn: str, offsets: tuple[int, ...]) -> Any:
        info = storage.get((fqn, offsets))
        if info is None:
            raise CheckpointError(f"checkpoint {self.path}: its metadata names {fqn!r} at {list(offsets)} but not "
                                  f"where it is stored")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"checkpoint {self.path}: {fqn!r} was saved through stream transforms "
                                  f"{info.transform_descriptors}, which spmd does not read; load it with torch")
        return info

    def _blob(self, file: str, offset: int, length: int) -> Any:
        try:
            return torch.load(io.BytesIO(bytes(self.read(file, offset, length))), map_location="cpu",
                              weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"checkpoint {self.path}: {file} at {offset} holds something torch.load refuses "
                                  f"to load safely ({error})") from error

    def _value(self, fqn: str, info: Any) -> Any:
        return self._blob(info.relative_path, int(info.offset), int(info.length))

    def read_region(self, chunk: Chunk, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor | None:
        with self._lock:
            held = self._held
            if held is None or held[0] != chunk.key:
                box = self._blob(*self._boxes[chunk.key])
                if not isinstance(box, Tensor) or tuple(box.shape) != chunk.sizes:
                    raise CheckpointError(f"checkpoint {self.path}: {chunk.key!r} is not the tensor of shape "
                                          f"{list(chunk.sizes)} its metadata says")
                held = self._held = (chunk.key, box)
        return Box((0,) * len(chunk.sizes), chunk.sizes).view(held[1], Box(offsets, lengths))

    def close(self) -> None:
        self._held = None
        super().close()

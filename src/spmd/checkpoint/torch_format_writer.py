"""Checkpoints in torch's DCP format (its FileSystemWriter's `.metadata` and `__<rank>_<n>.distcp` files), written by
spmd's save: `dcp.save(state, storage_writer=TorchFormatWriter(path))` leaves a directory that torch's own DCP
`load` (and its format_utils, and the tools built on them) reads, resharding as it does for its own;
`python -m spmd.checkpoint.convert` rewrites a checkpoint of spmd's format this way.

Layer: checkpoint. No communication: save's protocol drives the writer (storage.py). Each rank writes its boxes as
torch.save blobs, back to back, in one data file; the coordinator writes the values (torch.save of each, as torch's
planner reads them back) in a file of their own, then the index: torch's Metadata, pickled. spmd does not import
torch's checkpoint classes to let pickle name them, so the index is written as pickle opcodes here, naming the
records exactly as torch's own pickle names them (checked against torch's load in the tests).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.metadata import METADATA_FILE, Metadata
from spmd.checkpoint.storage import (
    DATA_FILE,
    PARTIAL_SUFFIX,
    TORCH_DATA_FILE,
    TORCH_SAVE,
    BoxWrite,
    FileSystemWriter,
    WrittenBox,
    WrittenBoxes,
    encoded,
    host_contiguous,
    sync_directory,
)
from spmd.checkpoint.torch_format import TORCH_METADATA_FILE, torch_module

TORCH_DCP_VERSION = "1.0.0"      # the version torch 2.13's FileSystemWriter stamps on its metadata
_METADATA_MODULE = torch_module("checkpoint", "metadata")
_FILESYSTEM_MODULE = torch_module("checkpoint", "filesystem")


class _Record:
    """One of torch's dataclasses in the pickle: built by its class with no arguments, then given `state` (its
    __dict__, or what its __getstate__ returns)."""

    def __init__(self, module: str, name: str, state: Any) -> None:
        self.module, self.name, self.state = module, name, state


class _Call:
    """A value torch's pickle rebuilds by calling a global with arguments (a torch.Size, an enum member)."""

    def __init__(self, module: str, name: str, args: tuple) -> None:
        self.module, self.name, self.args = module, name, args


class _Pickle:
    """Pickle protocol 2 opcodes for the values torch's checkpoint metadata holds; no memo (nothing is shared)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")      # PROTO 2

    def dump(self, value: Any) -> bytes:
        self._value(value)
        self.out += b"."                        # STOP
        return bytes(self.out)

    def _global(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _value(self, value: Any) -> None:
        out = self.out
        if value is None:
            out += b"N"
        elif value is True or value is False:
            out += b"\x88" if value else b"\x89"
        elif isinstance(value, int):
            if -(1 << 31) <= value < (1 << 31):
                out += b"J" + struct.pack("<i", value)
            else:
                encoded = pickle.encode_long(value)
                out += b"\x8a" + bytes([len(encoded)]) + encoded
        elif isinstance(value, float):
            out += b"G" + struct.pack(">d", value)
        elif isinstance(value, str):
            encoded = value.encode("utf-8", "surrogatepass")
            out += b"X" + struct.pack("<I", len(encoded)) + encoded
        elif isinstance(value, torch.dtype):
            self._global("torch", str(value).removeprefix("torch."))
        elif isinstance(value, torch.Size):
            self._value(_Call("torch", "Size", (tuple(value),)))
        elif isinstance(value, tuple):
            out += b"("
            for item in value:
                self._value(item)
            out += b"t"
        elif isinstance(value, list):
            out += b"]("
            for item in value:
                self._value(item)
            out += b"e"
        elif isinstance(value, dict):
            out += b"}("
            for key, item in value.items():
                self._value(key)
                self._value(item)
            out += b"u"
        elif isinstance(value, _Record):
            self._global(value.module, value.name)
            out += b")\x81"                     # EMPTY_TUPLE, NEWOBJ
            self._value(value.state)
            out += b"b"                         # BUILD
        elif isinstance(value, _Call):
            self._global(value.module, value.name)
            self._value(value.args)
            out += b"R"                         # REDUCE
        else:
            raise TypeError(f"torch checkpoint metadata: no pickle form for a {type(value).__name__}")


def _record(name: str, state: Any) -> _Record:
    return _Record(_FILESYSTEM_MODULE if name == "_StorageInfo" else _METADATA_MODULE, name, state)


def _properties(dtype: torch.dtype) -> _Record:
    """torch's TensorProperties, whose pickle state is (dtype, layout, requires_grad, memory format code, pinned)."""
    layout = _Call("torch.serialization", "_get_layout", ("torch.strided",))
    contiguous = _Call(_METADATA_MODULE, "_MEM_FORMAT_ENCODING", (0,))
    return _record("TensorProperties", (dtype, layout, False, contiguous, False))


def _index(fqn: str, offsets: tuple[int, ...] | None) -> _Record:
    return _record("MetadataIndex", {"fqn": fqn, "offset": None if offsets is None else torch.Size(offsets),
                                     "index": None})


def _storage_info(file: str, offset: int, length: int) -> _Record:
    return _record("_StorageInfo", {"relative_path": file, "offset": offset, "length": length})


def metadata_pickle(metadata: Metadata, where: Mapping[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
                    checkpoint_id: str) -> bytes:
    """torch's `.metadata` for `metadata`: each tensor's boxes and each value, and where each lies (`where`: (key,
    box offsets, or None for a value) -> (file, byte offset, byte length))."""
    entries: dict[str, _Record] = {}
    for key, entry in metadata.tensors.items():
        chunks = [_record("ChunkStorageMetadata", {"offsets": torch.Size(chunk.offsets),
                                                   "sizes": torch.Size(chunk.sizes)}) for chunk in entry.chunks]
        entries[key] = _record("TensorStorageMetadata", {"properties": _properties(tensor_format.dtype_of(entry.dtype)),
                                                         "size": torch.Size(entry.shape), "chunks": chunks})
    for key in [*metadata.values, *metadata.blobs]:
        entries[key] = _record("BytesStorageMetadata", {})
    storage = {_index(key, offsets): _storage_info(*place) for (key, offsets), place in where.items()}
    meta = _record("StorageMeta", {"checkpoint_id": checkpoint_id, "save_id": metadata.save_id, "load_id": None,
                                   "modules": []})
    return _Pickle().dump(_record("Metadata", {
        "state_dict_metadata": entries, "planner_data": metadata.planner_data or None, "storage_data": storage,
        "storage_meta": meta, "version": TORCH_DCP_VERSION}))


def _blob(value: Any) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


class TorchFormatWriter(FileSystemWriter):
    """Writes a checkpoint directory in torch's DCP format (see the module's docstring), for torch's load and the
    tools built on it; spmd's load reads it too. Saves are as safe as spmd's own (see Note: never lose the last
    good checkpoint in storage.py): each file is written under a temporary name and renamed, the index last, and
    only then are an earlier checkpoint's files in the directory removed."""

    def write_boxes(self, rank: int, save_id: str, boxes: Mapping[str, BoxWrite], storage_data: Any) -> WrittenBoxes:
        boxes = {key: box for key, box in boxes.items() if box.item.tensor_data is not None}
        if not boxes:
            return WrittenBoxes({}, [])
        name = f"__{rank}_{save_id}.distcp"
        written: list[WrittenBox] = []

        def blobs() -> Iterator[memoryview]:
            """Each box's blob in turn, made as the file is written (one box's copy in memory at a time)."""
            offset = 0
            for box in boxes.values():
                box = encoded(box)                   # a compressed tensor as itself, as torch stores every box
                if box.encoding == TORCH_SAVE:
                    blob = box.data.numpy().tobytes()
                else:
                    data = host_contiguous(box.data)
                    if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                        data = data.clone()          # torch.save writes a view's whole storage
                    blob = _blob(data)
                chunk = box.item.tensor_data.chunk
                written.append(WrittenBox(name, f"{offset}+{len(blob)}", box.item.index.fqn, tuple(chunk.offsets),
                                          tuple(chunk.sizes), None))
                offset += len(blob)
                yield memoryview(blob)

        return WrittenBoxes({name: self.write_file(name, blobs())}, written)

    def finish(self, metadata: Metadata, storage_data: Any) -> Metadata:
        where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        for key, entry in metadata.tensors.items():
            for chunk in entry.chunks:
                start, _, length = chunk.key.partition("+")
                where[(key, chunk.offsets)] = (chunk.file, int(start), int(length))
        files = dict(metadata.files)
        values = [(key, _blob(value)) for key, value in metadata.values.items()]
        values += list(metadata.blobs.items())
        if values:
            name, offset = f"__values_{metadata.save_id}.distcp", 0
            for key, blob in values:
                where[(key, None)] = (name, offset, len(blob))
                offset += len(blob)
            files[name] = self.write_file(name, [memoryview(blob) for _, blob in values])
        try:
            index = metadata_pickle(metadata, where, self.path)
        except TypeError as error:
            raise CheckpointError(f"checkpoint {self.path}: {error}") from error
        self.write_file(TORCH_METADATA_FILE, [memoryview(index)])
        if self.sync_files:
            sync_directory(self.path)
        for entry in os.listdir(self.path):
            stale = (TORCH_DATA_FILE.match(entry) or DATA_FILE.match(entry) or entry.endswith(PARTIAL_SUFFIX)) \
                and entry not in files
            if stale or entry == METADATA_FILE:     # an earlier checkpoint here, of either format (spmd's index
                # beside torch's would be read first)
                os.unlink(os.path.join(self.path, entry))
        return metadata

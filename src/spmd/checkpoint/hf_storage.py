"""Hugging Face checkpoints (torch's HuggingFaceStorageWriter / HuggingFaceStorageReader): save a state dict of any
layout as `model-0000i-of-0000N.safetensors` files of whole tensors with their `model.safetensors.index.json`,
which `transformers` and `safetensors` load as they are, and load such a directory (a model downloaded from the
Hub) into tensors and DTensors of any layout, each rank reading only the byte ranges of its shards.

Layer: checkpoint. Used through save and load (api.py), whose protocol is unchanged: the writer lays the boxes
out (Note: writing whole tensors from shards), the reader builds the metadata from the files' headers.

Note: writing whole tensors from shards
torch writes each rank's shards into files of their own and then, on the coordinator, reads them back and
copies them into the whole-tensor files ("consolidation"). spmd writes the whole-tensor files once, in place:
  step 2 (coordinator, prepare_global_plan) lays out every output file from the plans, which name every tensor's
          global shape and dtype: its header, and where each tensor's bytes start; it creates the files under
          a temporary name, header written and sized to their final length, and tells every rank the layout.
  step 3 (each rank, write_boxes) opens those files, never creating one, and writes each of its boxes at the
          byte ranges the box covers in its tensor (one run for a box of leading rows, one per row for a box
          of columns), then flushes them. A rank that can't see a file the coordinator made is on a filesystem
          the coordinator does not share, and says so.
  step 5 (coordinator, finish) renames each file to its name, writes the index last, and removes files of an
          earlier save there that this one did not write (not the temporary files of a save of this process
          still in flight: an async_save lays out the next save's files before the last one finished). The
          layout travels in the plans' storage_data, so a writer keeps no state between the steps.
The save protocol's check that each tensor is tiled by the boxes written (api.py, step 5) comes before any
rename, so a file with a hole is never published. The names are Hugging Face's, fixed, so unlike spmd's own
format an earlier checkpoint in the same directory is replaced file by file, not at once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import json
import math
import os
import re
import secrets
import threading
from collections.abc import Mapping
from typing import Any

import torch

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.format import dtype_of
from spmd.checkpoint.metadata import (
    Chunk,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorEntry,
    TensorProperties,
)
from spmd.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from spmd.checkpoint.storage import (
    BoxWrite,
    FileSystemReader,
    FileSystemWriter,
    WrittenBox,
    WrittenBoxes,
    box_tensor,
    host_contiguous,
    sync_directory,
)

__all__ = ["HuggingFaceStorageReader", "HuggingFaceStorageWriter"]

INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"     # torch's key, in a sharded file's __metadata__: each tensor's offsets
_SAVED_OFFSETS = "saved_offsets"
_FILE_METADATA = {"format": "pt"}           # what transformers checks a safetensors file's metadata for
_MODEL_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_SHARD_FILE = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")
_PARTIAL = re.compile(r"^\.model-\d{5}-of-\d{5}\.safetensors\.([0-9a-f]+)\.partial$")
# the tokens of this process's saves between their step 2 and step 5: another save's clean-up keeps their files
_IN_FLIGHT: set[str] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def model_file_name(index: int, count: int, shard: int | None = None) -> str:
    """Hugging Face's name of file `index` of `count` (and torch's for a rank's shard of it)."""
    name = f"model-{index:05d}-of-{count:05d}{SUFFIX}"
    return name if shard is None else f"shard-{shard:05d}-{name}"


class _Output(enum.Enum):
    """What a HuggingFaceStorageWriter leaves."""

    WHOLE = "whole"        # whole tensors in model-*.safetensors files, and the index
    SHARDED = "sharded"    # each rank's shards in files of its own, with their offsets (torch's save_distributed)


@dataclasses.dataclass(frozen=True, slots=True)
class _Placed:
    """Where one tensor's bytes lie in its output file."""

    file: str
    start: int                   # the byte of the file where the tensor's data starts
    shape: tuple[int, ...]


class HuggingFaceStorageWriter(FileSystemWriter):
    """Writes a checkpoint in Hugging Face's safetensors layout, tensors only. `fqn_to_index_mapping`: the file
    (1..N) of each key, as a model's index gives it (every key saved must be in it); None puts all in one file.
    By default whole tensors, however the state dict is sharded, written in place by every rank (Note: writing
    whole tensors from shards; `enable_consolidation` asks for the same, and `save_distributed` without it for
    torch's sharded files, which HuggingFaceStorageReader loads). `thread_count`: files a rank writes at once.
    `thread_count_consolidation` is accepted for torch's signature: spmd has no consolidation pass."""

    def __init__(self, path: str | os.PathLike[str], fqn_to_index_mapping: dict[str, int] | None = None,
                 thread_count: int = 1, save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1, sync_files: bool = True) -> None:
        super().__init__(path, sync_files=sync_files)
        if fqn_to_index_mapping is not None:
            bad = {key: index for key, index in fqn_to_index_mapping.items()
                   if not isinstance(index, int) or index < 1}
            if bad:
                raise ValueError(f"HuggingFaceStorageWriter: file indices count from 1; got {bad}")
        if thread_count < 1:
            raise ValueError(f"HuggingFaceStorageWriter: thread_count must be at least 1, got {thread_count}")
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.thread_count = thread_count
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation
        self.output = _Output.SHARDED if save_distributed and not enable_consolidation else _Output.WHOLE

    # -- step 2 ------------------------------------------------------------------------------------------------

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for plan in plans:
            for item in plan.items:
                if item.type is WriteItemType.BYTE_IO or item.tensor_data is None:
                    raise CheckpointError(f"HuggingFaceStorageWriter: {item.index.fqn!r} is not a tensor; a Hugging "
                                          f"Face checkpoint holds tensors only (save other state with save() to a "
                                          f"directory of its own)")
                tensors[item.index.fqn] = (item.tensor_data.properties.dtype, tuple(item.tensor_data.size))
        files = self._file_of(sorted(tensors))
        if self.output is _Output.SHARDED:
            count = max(self.fqn_to_index_mapping.values()) if self.fqn_to_index_mapping else 1
            return [dataclasses.replace(plan, storage_data={
                        "files": {item.index.fqn: files[item.index.fqn] for item in plan.items}, "count": count,
                        "shard": rank + 1, "empty": _empty_boxes(plan)})
                    for rank, plan in enumerate(plans)]
        token = secrets.token_hex(8)
        placed, laid_out = lay_out(tensors, self._file_names(files))
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(token)
        for name, (header, size) in laid_out.items():
            create_file(self._partial(name, token), header, size)
        sizes = {name: size for name, (_, size) in laid_out.items()}
        # what a rank needs of the layout: its tensors' places, every file's size, and the save's token (the
        # coordinator's finish reads them back from its own plan: the writer keeps no state between the steps)
        return [dataclasses.replace(plan, storage_data={
                    "token": token, "sizes": sizes,
                    "placed": {item.index.fqn: [placed[item.index.fqn].file, placed[item.index.fqn].start]
                               for item in plan.items}})
                for plan in plans]

    def _file_names(self, files: Mapping[str, int]) -> dict[str, str]:
        """Each key's output file name, from its file index."""
        count = max(self.fqn_to_index_mapping.values()) if self.fqn_to_index_mapping else 1
        return {key: model_file_name(index, count) for key, index in files.items()}

    def _file_of(self, keys: list[str]) -> dict[str, int]:
        """Each key's file index (1..N)."""
        if self.fqn_to_index_mapping is None:
            return dict.fromkeys(keys, 1)
        unmapped = [key for key in keys if key not in self.fqn_to_index_mapping]
        if unmapped:
            raise CheckpointError(f"HuggingFaceStorageWriter: fqn_to_index_mapping has no file for "
                                  f"{', '.join(map(repr, unmapped[:8]))}{' ...' if len(unmapped) > 8 else ''} "
                                  f"({len(unmapped)} keys of the state dict)")
        return {key: self.fqn_to_index_mapping[key] for key in keys}

    def _partial(self, name: str, token: str) -> str:
        return os.path.join(self.path, f".{name}.{token}.partial")

    # -- step 3 ------------------------------------------------------------------------------------------------

    def write_boxes(self, rank: int, save_id: str, boxes: Mapping[str, BoxWrite], storage_data: Any) -> WrittenBoxes:
        if self.output is _Output.SHARDED:
            return self._write_shards(boxes, storage_data)
        token, placed = storage_data["token"], storage_data["placed"]
        by_file: dict[str, list[BoxWrite]] = {}
        for box in boxes.values():
            by_file.setdefault(placed[box.item.index.fqn][0], []).append(box)

        def write(name: str) -> None:
            partial = self._partial(name, token)
            try:
                descriptor = os.open(partial, os.O_WRONLY)
            except FileNotFoundError:
                raise CheckpointError(f"HuggingFaceStorageWriter: rank {rank} can't see {partial}, which rank 0 "
                                      f"created: writing whole tensors needs a path every rank shares (or pass "
                                      f"save_distributed=True for files of each rank's own)") from None
            try:
                for box in by_file[name]:
                    written = box.item.tensor_data
                    assert written is not None
                    data = host_contiguous(box_tensor(box))
                    write_region(descriptor, placed[box.item.index.fqn][1],
                                 tensor_format.as_bytes(data), data.element_size(),
                                 tuple(written.size), tuple(written.chunk.offsets), tuple(written.chunk.sizes),
                                 partial)
                if self.sync_files:
                    os.fsync(descriptor)
            finally:
                os.close(descriptor)

        with concurrent.futures.ThreadPoolExecutor(min(self.thread_count, max(len(by_file), 1)),
                                                   thread_name_prefix="spmd-hf-write") as pool:
            for done in [pool.submit(write, name) for name in by_file]:
                done.result()
        written = [WrittenBox(placed[box.item.index.fqn][0], box.item.index.fqn, box.item.index.fqn,
                              tuple(box.item.tensor_data.chunk.offsets), tuple(box.item.tensor_data.chunk.sizes), None)
                   for box in boxes.values() if box.item.tensor_data is not None]
        return WrittenBoxes({name: storage_data["sizes"][name] for name in by_file}, written)

    def _write_shards(self, boxes: Mapping[str, BoxWrite], storage_data: Any) -> WrittenBoxes:
        """torch's sharded layout: one file per output file this rank has boxes of, each box under its key with
        its offsets in the file's metadata."""
        files: dict[str, dict[str, BoxWrite]] = {}
        for fqn, (dtype, shape, offsets) in storage_data["empty"].items():     # no data, but a key to load
            box = BoxWrite(WriteItem(MetadataIndex(fqn, offsets), WriteItemType.SHARD, tensor_data=TensorWriteData(
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape)), TensorProperties(dtype_of(dtype)),
                torch.Size(shape))), torch.empty(shape, dtype=dtype_of(dtype)))
            boxes = {**boxes, f"{fqn}@empty": box}
        for box in boxes.values():
            fqn = box.item.index.fqn
            name = model_file_name(storage_data["files"][fqn], storage_data["count"], storage_data["shard"])
            held = files.setdefault(name, {})
            if fqn in held:
                raise CheckpointError(f"HuggingFaceStorageWriter: this rank holds two boxes of {fqn!r}, which a "
                                      f"sharded Hugging Face file can't hold under one key")
            held[fqn] = box
        sizes, written = {}, []
        for name, held in files.items():
            datas = {fqn: host_contiguous(box_tensor(box)) for fqn, box in held.items()}
            info = {fqn: {_SAVED_OFFSETS: list(box.item.tensor_data.chunk.offsets)} for fqn, box in held.items()}
            entries = {fqn: (data.dtype, tuple(data.shape), data.numel() * data.element_size())
                       for fqn, data in datas.items()}
            header = tensor_format.header_bytes(entries, {**_FILE_METADATA, SHARDING_INFO_KEY: json.dumps(info),
                                                          "DCP_VERSION": "1.0"})
            sizes[name] = self.write_file(name, [memoryview(header),
                                                 *(tensor_format.as_bytes(data) for data in datas.values())])
            written.extend(WrittenBox(name, fqn, fqn, tuple(box.item.tensor_data.chunk.offsets),
                                      tuple(box.item.tensor_data.chunk.sizes), None) for fqn, box in held.items())
        return WrittenBoxes(sizes, written)

    # -- step 5 ------------------------------------------------------------------------------------------------

    def finish(self, metadata: Metadata, storage_data: Any) -> Metadata:
        if self.output is _Output.SHARDED:
            if self.sync_files:
                sync_directory(self.path)
            for entry in os.listdir(self.path):
                if _SHARD_FILE.match(entry) and entry not in metadata.files:
                    os.unlink(os.path.join(self.path, entry))
            return metadata
        token, sizes = storage_data["token"], storage_data["sizes"]
        for name in sorted(sizes):
            os.replace(self._partial(name, token), os.path.join(self.path, name))
        weight_map = self._file_names(self._file_of(sorted(metadata.tensors)))
        total = sum(math.prod(entry.shape) * tensor_format.dtype_of(entry.dtype).itemsize
                    for entry in metadata.tensors.values())
        self.write_file(INDEX_FILE, [memoryview(index_bytes(weight_map, total))])
        if self.sync_files:
            sync_directory(self.path)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(token)
            in_flight = set(_IN_FLIGHT)
        for entry in os.listdir(self.path):
            partial = _PARTIAL.match(entry)
            if (_MODEL_FILE.match(entry) and entry not in sizes) or (partial and partial[1] not in in_flight):
                os.unlink(os.path.join(self.path, entry))
        files = dict(sizes)
        tensors = {key: TensorEntry(entry.dtype, entry.shape,
                                    [Chunk(weight_map[key], key, (0,) * len(entry.shape), entry.shape, None)])
                   for key, entry in metadata.tensors.items()}
        return dataclasses.replace(metadata, tensors=tensors, files=files)


def _empty_boxes(plan: SavePlan) -> dict[str, list[Any]]:
    """The boxes of the plan with no elements (no rank writes data for them): key -> dtype, shape, offsets."""
    return {item.index.fqn: [tensor_format.dtype_name(item.tensor_data.properties.dtype),
                             list(item.tensor_data.chunk.sizes), list(item.tensor_data.chunk.offsets)]
            for item in plan.items if item.tensor_data is not None and math.prod(item.tensor_data.chunk.sizes) == 0}


def lay_out(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
            file_of: Mapping[str, str]) -> tuple[dict[str, _Placed], dict[str, tuple[bytes, int]]]:
    """Where each tensor's bytes go, and each output file's header and size: in each file the tensors widest dtype
    first, then by name, so every tensor starts aligned to its element size (the header pads to 8 bytes)."""
    by_file: dict[str, list[str]] = {}
    for key, name in file_of.items():
        by_file.setdefault(name, []).append(key)
    placed: dict[str, _Placed] = {}
    files: dict[str, tuple[bytes, int]] = {}
    for name, keys in sorted(by_file.items()):
        keys.sort(key=lambda key: (-tensors[key][0].itemsize, key))
        entries = {key: (tensors[key][0], tensors[key][1], math.prod(tensors[key][1]) * tensors[key][0].itemsize)
                   for key in keys}
        header = tensor_format.header_bytes(entries, _FILE_METADATA)
        start = len(header)
        for key in keys:
            placed[key] = _Placed(name, start, tensors[key][1])
            start += entries[key][2]
        files[name] = (header, start)
    return placed, files


def index_bytes(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """model.safetensors.index.json: each key's file, and the bytes of all tensors."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}, indent=2).encode()


def create_file(path: str, header: bytes, size: int) -> None:
    """An output file: its header, and room for its data (read as zeros until written)."""
    with open(path, "wb") as file:
        file.write(header)
        file.truncate(size)


def write_region(descriptor: int, start: int, data: memoryview, item_size: int, shape: tuple[int, ...],
                 offsets: tuple[int, ...], sizes: tuple[int, ...], where: str) -> None:
    """Write `data`, the contiguous bytes of the box (`offsets`, `sizes`) of a tensor of `shape` whose bytes
    start at `start` in the file: one run per position of the dims before the last one the box does not cover
    whole (Note: writing whole tensors from shards)."""
    partial = max((dim for dim in range(len(shape)) if sizes[dim] != shape[dim]), default=0)
    strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
    run = (sizes[partial] * strides[partial] if shape else 1) * item_size
    first = sum(offset * stride for offset, stride in zip(offsets, strides, strict=True)) * item_size
    starts = torch.zeros((), dtype=torch.int64)
    for dim in range(partial):
        starts = starts.unsqueeze(-1) + torch.arange(sizes[dim], dtype=torch.int64) * (strides[dim] * item_size)
    for index, at in enumerate(starts.reshape(-1).tolist()):
        piece, done = data[index * run:(index + 1) * run], 0
        while done < len(piece):
            count = os.pwrite(descriptor, piece[done:], start + first + at + done)
            if count <= 0:
                raise CheckpointError(f"writing {len(piece)} bytes to {where} at {start + first + at} failed")
            done += count


class HuggingFaceStorageReader(FileSystemReader):
    """Reads a directory of safetensors files as a checkpoint: a model as the Hub serves it (the files its
    `model.safetensors.index.json` names, else every `*.safetensors` there), whole tensors or the sharded files
    of torch's save_distributed. A load casts each tensor to the dtype of the state dict's (bfloat16 weights into
    float32 parameters) and reads, through the files' maps, only the byte ranges a rank's shards cover.
    `thread_count` is accepted for torch's signature: the reads are mapped, so there are no read calls to
    spread over threads."""

    def __init__(self, path: str | os.PathLike[str], thread_count: int = 1) -> None:
        super().__init__(path)
        self.thread_count = thread_count

    def read_metadata(self) -> Metadata:
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint {self.path}: no such directory")
        names = self._file_names()
        if not names:
            raise CheckpointError(f"{self.path} is not a Hugging Face checkpoint: it has no {SUFFIX} files")
        tensors: dict[str, TensorEntry] = {}
        held: dict[tuple[str, tuple[int, ...]], str] = {}
        files: dict[str, int] = {}
        for name in names:
            size = self.file_size(name)
            assert size is not None
            files[name] = size
            opened = tensor_format.TensorFile(name, lambda offset, length, name=name: self.read(name, offset, length),
                                              size)
            sharding = _sharding_info(opened)
            for key in opened:
                dtype, shape, _, _ = opened.entries[key]
                offsets = tuple(sharding[key][_SAVED_OFFSETS]) if key in sharding else (0,) * len(shape)
                if len(offsets) != len(shape):
                    raise CheckpointError(f"checkpoint {self.path}: {name} gives {key!r} offsets {list(offsets)} "
                                          f"for a tensor of shape {list(shape)}")
                if (key, offsets) in held:
                    raise CheckpointError(f"checkpoint {self.path}: {key!r} at {list(offsets)} is in both "
                                          f"{held[key, offsets]} and {name}; keep one (or an index naming one)")
                held[key, offsets] = name
                entry = tensors.setdefault(key, TensorEntry(tensor_format.dtype_name(dtype), tuple(shape)))
                if entry.dtype != tensor_format.dtype_name(dtype):
                    raise CheckpointError(f"checkpoint {self.path}: the shards of {key!r} disagree on its dtype "
                                          f"({entry.dtype} and {tensor_format.dtype_name(dtype)} in {name})")
                entry.shape = tuple(max(extent, offset + length)
                                    for extent, offset, length in zip(entry.shape, offsets, shape, strict=True))
                entry.chunks.append(Chunk(name, key, offsets, tuple(shape), None))
        return Metadata(save_id="", tensors=tensors, values={}, files=files, casts_on_load=True)

    def _file_names(self) -> list[str]:
        """The files of the index, where there is one, else every safetensors file of the directory."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index, "rb") as file:
                    weight_map = json.load(file)["weight_map"]
                return sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointError(f"checkpoint {self.path}: {INDEX_FILE} is not a weight index ({error!r})") \
                    from error
        return sorted(entry for entry in os.listdir(self.path) if entry.endswith(SUFFIX))


def _sharding_info(opened: tensor_format.TensorFile) -> dict[str, Any]:
    """A sharded file's offsets of each tensor (torch's DCP_SHARDING_INFO), or {} for a file of whole tensors."""
    text = opened.metadata.get(SHARDING_INFO_KEY)
    if text is None:
        return {}
    try:
        info = json.loads(text)
        return {key: {_SAVED_OFFSETS: [int(o) for o in value[_SAVED_OFFSETS]]} for key, value in info.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint file {opened.name}: its {SHARDING_INFO_KEY} is malformed ({error!r})") \
            from error

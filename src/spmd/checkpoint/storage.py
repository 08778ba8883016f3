"""Where checkpoints live: a small interface of whole files written and byte ranges read, and the local
filesystem's implementation (torch's names: FileSystemWriter, FileSystemReader).

Layer: checkpoint. No communication. Another storage (an object store, fsspec) implements StorageWriter and
StorageReader; save and load call them as their docstrings say. A writer that lays the boxes out in files of
another format (hf_storage.py) overrides the three steps of the save protocol a writer takes part in:
prepare_global_plan, write_boxes and finish; by default they write spmd's own format through write_file and
commit.

Note: torch's storage protocol
A storage written for torch's DCP ports too: a StorageWriter subclass that defines write_data(plan, planner)
(returning a Future of WriteResults) and finish(metadata, results), and a StorageReader subclass that defines
read_metadata() and read_data(plan, planner), are driven as torch drives them (reset, set_up_storage_writer /
set_up_storage_reader, prepare_local_plan, prepare_global_plan), around spmd's planning: write_data gets this
rank's tensor items and a planner whose resolve_data gives their data; the coordinator's finish gets every
rank's WriteResults (gathered from authenticated peers) and spmd's Metadata, which such a writer stores as it
likes (typically setting metadata.storage_data and pickling it); read_data gets the tensor items of this rank's
load plan and the load planner (resolve_tensor, commit_tensor). Values (non-tensor entries) travel inside the
Metadata, not through write_data and read_data. Each rank's load plan is its own (prepare_global_plan sees one
plan): spmd's load is not collective.

Note: never lose the last good checkpoint
A data file is written under a hidden temporary name, flushed to disk, then renamed to its final name, which
carries the save's id, so no file of an earlier checkpoint in the same directory is ever overwritten. The
metadata is written last the same way, by one rank, once every rank's files are final: the rename is the
moment the new checkpoint exists and replaces the old one. A save killed at any point before it leaves the
directory as it was (plus temporary or unreferenced files, which a reader ignores and the next save removes);
in a new directory, a reader finds no metadata and says the save did not finish.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import io
import mmap
import os
import pickle
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.metadata import (
    DCP_MARKER,
    DCP_MARKER_FILE,
    METADATA_FILE,
    Chunk,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from spmd.checkpoint.planner import LoadPlan, SavePlan, WriteItem
from spmd.comm.collectives import holds_fewer_bytes, is_wrapper_subclass

PARTIAL_SUFFIX = ".partial"
_WRITEBACK_BYTES = 16 << 20   # every this many bytes written, the disk is asked to start writing them out
_START_WRITEBACK = hasattr(os, "posix_fadvise")
DATA_FILE = re.compile(r"^__\d+_[0-9a-f]+\.safetensors$")
TORCH_DATA_FILE = re.compile(r"^__(\d+|values)_[0-9a-f]+\.distcp$")      # torch's DCP format's (and spmd's in it)


TORCH_SAVE = "torch.save"      # a box's encoding: the bytes of torch.save of the tensor (see Note: compressed tensors)

# Note: compressed tensors
# A box whose data is a tensor subclass holding fewer bytes than its values (a quantized optimizer state, torchao's
# 8-bit AdamW's; an NF4 weight) can't be stored as values and read back as they were: dequantized, then quantized
# again on load, it resumes close to, not at, where it was. Such a box is stored as torch.save of the tensor itself,
# as torch's DCP stores every box, under the encoding TORCH_SAVE (metadata.Chunk.encoding); a load reads it with
# torch.load(weights_only=True), so its class must be among torch's safe globals (torchao registers its own), then
# copies the region it needs into the state dict's tensor, whose copy_ takes its own kind. A subclass that holds all
# its values (a float8 training weight: its float32 tensor) is stored as values, readable without its class.


@dataclasses.dataclass(slots=True)
class BoxWrite:
    """One box a rank writes: its item and its data (the planner's resolve_data); with `encoding` TORCH_SAVE, the
    data is already torch.save's bytes of it (see Note: compressed tensors)."""

    item: WriteItem
    data: Tensor
    encoding: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WrittenBox:
    """One box as a writer stored it: the file and the key it sits under there, the item's key and box, the
    CRC-32 of its bytes (None where the format keeps none) and how they encode it (None: its values)."""

    file: str
    key: str
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    crc32: int | None
    encoding: str | None = None


def encoded(box: BoxWrite) -> BoxWrite:
    """`box` with a compressed tensor's data as torch.save's bytes of it (see Note: compressed tensors); any other
    box as it is."""
    if box.encoding is not None or not holds_fewer_bytes(box.data):
        return box
    stream = io.BytesIO()
    torch.save(box.data.detach(), stream)
    return BoxWrite(box.item, torch.frombuffer(bytearray(stream.getvalue()), dtype=torch.uint8), TORCH_SAVE)


def box_tensor(box: BoxWrite) -> Tensor:
    """The tensor `box` writes, decoded where it is already torch.save's bytes (a writer that stores values)."""
    return decoded(box.data, "save") if box.encoding == TORCH_SAVE else box.data


def decoded(data: Tensor | memoryview, where: str) -> Tensor:
    """The tensor a TORCH_SAVE box's bytes hold, read with torch.load(weights_only=True)."""
    raw = bytes(data.numpy().tobytes() if isinstance(data, Tensor) else data)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        what = f"of class {named[1]}, which" if named else "of a class"
        raise CheckpointError(f"{where}: a box stored as its tensor (a compressed subclass) is {what} "
                              f"torch.load(weights_only=True) may not read; import the library defining it (which "
                              f"registers it with torch.serialization.add_safe_globals), or register it") from error


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What a writer of torch's protocol reports for one item it wrote (torch's name): the item's index, how many
    bytes it took and where the writer put it (any picklable value; its finish and its reader interpret it)."""

    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


@dataclasses.dataclass(slots=True)
class WrittenBoxes:
    """What a rank's write_boxes stored: the files it wrote to, with their sizes, and where each box went."""

    files: dict[str, int]
    boxes: list[WrittenBox]


class StorageWriter:
    """Writes one checkpoint (see Note: never lose the last good checkpoint). A subclass implements write_file and
    commit (spmd's protocol), or write_data and finish(metadata, results) (torch's: see Note: torch's storage
    protocol)."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(each rank, before a save given a checkpoint_id) Start a new checkpoint at `checkpoint_id`; torch's."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(each rank, step 1) Get ready for this save (`rank`, `use_collectives` come as keywords); torch's."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """(each rank, step 1) This rank's plan, with whatever this storage adds; torch's. By default as it is."""
        return plan

    def storage_meta(self) -> StorageMeta | None:
        """What the save planner's set_up_planner is told about this storage (None: the checkpoint_id alone)."""
        return None

    def write_data(self, plan: SavePlan, planner: Any) -> torch.futures.Future[list[WriteResult]]:
        """(torch's protocol, each rank, step 3) Store the data `planner.resolve_data(item)` gives for each of
        `plan`'s items; a Future of one WriteResult per item."""
        raise _neither(self)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether this storage can hold a checkpoint at `checkpoint_id` (torch's hook for choosing storages)."""
        return True

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator, step 2 of the save protocol, after the planner's global plan) The plans, with whatever
        this storage tells each rank in their storage_data (JSON-able); torch's hook. By default as they are."""
        return plans

    def write_boxes(self, rank: int, save_id: str, boxes: Mapping[str, BoxWrite], storage_data: Any) -> WrittenBoxes:
        """(each rank with boxes to write, step 3) Store `boxes` (by a name unique on this rank), given the
        storage_data of this rank's final plan. By default one data file, __<rank>_<save_id>.safetensors, through
        write_file, each box's CRC-32 computed beside the writes; none for a rank with no boxes."""
        if not boxes:
            return WrittenBoxes({}, [])
        name = f"__{rank}_{save_id}.safetensors"
        boxes = {key: encoded(box) for key, box in boxes.items()}
        datas = {key: host_contiguous(box.data) for key, box in boxes.items()}
        header = tensor_format.header_bytes({key: (data.dtype, tuple(data.shape), data.numel() * data.element_size())
                                             for key, data in datas.items()})
        views = {key: tensor_format.as_bytes(data) for key, data in datas.items()}
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spmd-checkpoint-crc") as pool:
            # one task for all: a submit per box contends for the GIL with the thread computing the last one's
            checksums = pool.submit(lambda: {key: tensor_format.crc32(view) for key, view in views.items()})
            size = self.write_file(name, [memoryview(header), *views.values()])
            crcs = checksums.result()
        written = [WrittenBox(name, key, box.item.index.fqn, tuple(box.item.tensor_data.chunk.offsets),
                              tuple(box.item.tensor_data.chunk.sizes), crcs[key], box.encoding)
                   for key, box in boxes.items() if box.item.tensor_data is not None]
        return WrittenBoxes({name: size}, written)

    def finish(self, metadata: Metadata, storage_data: Any) -> Metadata:
        """(coordinator, step 5, once every rank's write_boxes returned) Make the checkpoint exist, and return its
        metadata as a load will see it; `storage_data` is the coordinator's own plan's. By default commit of the
        metadata's JSON."""
        self.commit(metadata.to_json(), list(metadata.files))
        return metadata

    def write_file(self, name: str, parts: Iterable[memoryview]) -> int:
        """(each writing rank) Store file `name` as the concatenation of `parts`, durably, invisible to readers
        until complete; returns its size in bytes."""
        raise _neither(self)

    def commit(self, metadata: bytes, files: Iterable[str]) -> None:
        """(coordinator, after every rank's write_file returned) Store the metadata, atomically, last; then drop
        what an earlier checkpoint at the same place left and `files` doesn't name."""
        raise _neither(self)


class StorageReader(abc.ABC):
    """Reads one checkpoint. A subclass implements read_metadata and read (spmd's protocol), or read_metadata and
    read_data (torch's: see Note: torch's storage protocol)."""

    @abc.abstractmethod
    def read_metadata(self) -> bytes | Metadata:
        """The metadata's bytes (or, for a format of another kind, the Metadata built from what it holds); raises
        CheckpointError if there is none (not a checkpoint, or a save that did not finish)."""

    def read(self, name: str, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length) of file `name` (a view valid until close)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither spmd's storage protocol (read) nor "
                                  f"torch's (read_data)")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(before a load given a checkpoint_id) Read the checkpoint at `checkpoint_id`; torch's."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(each load, once the metadata is read) Get ready to read the checkpoint `metadata` describes; torch's."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's load plan, with whatever this storage adds; torch's. By default as it is."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The load plans, as this storage wants them; torch's. By default as they are."""
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> torch.futures.Future[None]:
        """(torch's protocol) Read each of `plan`'s items into `planner.resolve_tensor(item)`, then
        `planner.commit_tensor(item, tensor)`; a Future done when all are."""
        raise NotImplementedError(f"{type(self).__name__} does not implement read_data (torch's storage protocol)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether this storage can read a checkpoint at `checkpoint_id` (torch's hook for choosing storages)."""
        return True

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes of file `name` from `offset` on (a storage that can read straight into
        memory overrides this; a load uses it for a saved box that is the whole of a tensor it fills)."""
        buffer[:] = self.read(name, offset, len(buffer))

    def read_region(self, chunk: Chunk, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Tensor | None:
        """The values of the region (`offsets`, `lengths` within the saved box `chunk`) where this reader keeps them
        in another form than the metadata's dtype and shape (quantized weights it dequantizes); None, by default:
        the load reads the stored bytes."""
        return None

    def file_size(self, name: str) -> int | None:
        """The size of file `name` where the storage can tell cheaply (load checks it against the metadata's, to
        catch a truncated file before reading it), else None."""
        return None

    def close(self) -> None:
        """Release what the reads hold (maps, handles)."""


def _neither(writer: StorageWriter) -> NotImplementedError:
    return NotImplementedError(f"{type(writer).__name__} implements neither spmd's storage protocol (write_file and "
                               f"commit) nor torch's (write_data and finish)")


def speaks_torch_protocol(storage: StorageWriter | StorageReader) -> bool:
    """Whether `storage` is written to torch's storage protocol (see Note: torch's storage protocol): it defines
    write_data or read_data itself."""
    if isinstance(storage, StorageWriter):
        return type(storage).write_data is not StorageWriter.write_data
    return type(storage).read_data is not StorageReader.read_data


class FileSystemWriter(StorageWriter):
    """A checkpoint as a directory of the local (or a shared) filesystem. `sync_files`: fsync each file before it
    counts as written (turn off only where losing a just-written checkpoint to a power cut is acceptable).
    `overwrite=False` refuses to replace a file of an earlier checkpoint in the directory. torch's layout and
    staging knobs are accepted for its signature (torchtune passes them): `single_file_per_rank` (spmd writes one
    data file per rank either way; the layout changes nothing a load sees), `thread_count` (one file per rank
    leaves nothing to write in parallel), `per_thread_copy_ahead` and `cache_staged_state_dict` (spmd's staging
    is its async_save's own)."""

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"FileSystemWriter: thread_count must be a positive int, got {thread_count!r}")
        self.path = os.fspath(path)
        self.sync_files = sync_files
        self.overwrite = overwrite
        os.makedirs(self.path, exist_ok=True)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A save given a checkpoint_id writes there, not at the path this writer was made with (torch's)."""
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            os.makedirs(self.path, exist_ok=True)

    def write_file(self, name: str, parts: Iterable[memoryview]) -> int:
        final = os.path.join(self.path, name)
        if not self.overwrite and os.path.exists(final):
            raise FileExistsError(f"FileSystemWriter: {final} exists, and the writer was made with overwrite=False; "
                                  f"save to another directory, or pass overwrite=True")
        partial = os.path.join(self.path, f".{name}{PARTIAL_SUFFIX}")
        size = flushed = 0
        with open(partial, "wb", buffering=0) as file:
            for part in parts:
                written = 0
                while written < len(part):      # a raw write may take less than it was given
                    written += file.write(part[written:])
                size += len(part)
                if self.sync_files and _START_WRITEBACK and size - flushed >= _WRITEBACK_BYTES:
                    # DONTNEED starts writing those dirty pages out without waiting for them (and lets the page
                    # cache drop them once clean): the disk works while the rest is written, the fsync waits less
                    os.posix_fadvise(file.fileno(), flushed, size - flushed, os.POSIX_FADV_DONTNEED)
                    flushed = size
            if self.sync_files:
                os.fsync(file.fileno())
        os.replace(partial, final)
        return size

    def commit(self, metadata: bytes, files: Iterable[str]) -> None:
        self.write_file(METADATA_FILE, [memoryview(metadata)])
        self.write_file(DCP_MARKER_FILE, [memoryview(DCP_MARKER)])
        if self.sync_files:
            sync_directory(self.path)
        keep = set(files) | {METADATA_FILE, DCP_MARKER_FILE}
        for entry in os.listdir(self.path):
            if entry not in keep and (DATA_FILE.match(entry) or TORCH_DATA_FILE.match(entry)
                                      or entry.endswith(PARTIAL_SUFFIX)):
                os.unlink(os.path.join(self.path, entry))


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory through memory maps: a read costs what the pages it touches cost."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._maps: dict[str, mmap.mmap] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A load given a checkpoint_id reads there, not at the path this reader was made with (torch's)."""
        if checkpoint_id:
            self.close()
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self) -> bytes:
        where = os.path.join(self.path, METADATA_FILE)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint {self.path}: no such directory")
        try:
            with open(where, "rb") as file:
                return file.read()
        except FileNotFoundError:
            partial = sorted(e for e in os.listdir(self.path) if e.endswith(PARTIAL_SUFFIX) or DATA_FILE.match(e))
            if partial:
                shown = ", ".join(partial[:4]) + (", ..." if len(partial) > 4 else "")
                raise CheckpointError(f"checkpoint {self.path} is incomplete: it has no {METADATA_FILE}, and "
                                      f"{len(partial)} data files ({shown}) of a save that did not finish") from None
            raise CheckpointError(f"{self.path} is not a checkpoint: it has no {METADATA_FILE}") from None

    def read(self, name: str, offset: int, length: int) -> memoryview:
        mapped = self._maps.get(name)
        if mapped is None:
            where = os.path.join(self.path, name)
            try:
                with open(where, "rb") as file:
                    size = os.fstat(file.fileno()).st_size
                    mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.path}: data file {name} is missing") from None
            if mapped is None:
                return memoryview(b"")[:0]
            self._maps[name] = mapped
        if offset + length > len(mapped):
            raise CheckpointError(f"checkpoint {self.path}: data file {name} has {len(mapped)} bytes, fewer than "
                                  f"the {offset + length} its metadata needs (truncated)")
        return memoryview(mapped)[offset:offset + length]

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Large reads straight into `buffer`: one copy, at the disk's sequential speed (no page faults)."""
        with open(os.path.join(self.path, name), "rb", buffering=0) as file:
            done = 0
            while done < len(buffer):
                count = os.preadv(file.fileno(), [buffer[done:]], offset + done)
                if count <= 0:
                    raise CheckpointError(f"checkpoint {self.path}: data file {name} ended at byte {offset + done}, "
                                          f"before the {offset + len(buffer)} its metadata needs (truncated)")
                done += count

    def file_size(self, name: str) -> int | None:
        try:
            return os.path.getsize(os.path.join(self.path, name))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.path}: data file {name} is missing") from None

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for mapped in maps.values():
            try:
                mapped.close()
            except BufferError:     # a view is still alive (a tensor of it): the map goes with the last one
                pass


def host_contiguous(data: Tensor) -> Tensor:
    """`data` as a contiguous plain CPU tensor (a copy only where it is not one already); a wrapper subclass (an
    all-gather extension's weight) as a plain copy of its value, made by its own copy_."""
    data = data.detach()
    if is_wrapper_subclass(data):
        return torch.empty(data.shape, dtype=data.dtype, device="cpu").copy_(data)
    if data.device.type != "cpu":
        data = data.to("cpu")
    return data.contiguous()


def sync_directory(path: str) -> None:
    """Make the renames in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

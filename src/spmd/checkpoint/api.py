"""save, load and async_save: torch's DCP calls, over spmd's groups and the safetensors + JSON format.

Layer: checkpoint. save and async_save are collective over the process group (default: the world, when one is
initialized; a single process needs none); load is not: each rank reads the byte ranges it needs by itself.

Note: the save protocol
  1. (all ranks)   flatten the state dict (Stateful values through their state_dict()), find the box of every
                   tensor this rank holds, and exchange what each rank has: keys, global shapes, dtypes (JSON
                   bytes through all_gather_bytes: nothing is unpickled).
  2. (all ranks)   decide who writes what (layout, Note: who writes what); rank 0's random id names this save.
  3. (each writer) write one data file, __<rank>_<id>.safetensors, streaming every box it writes straight from
                   the tensor's memory, a CRC-32 of each computed beside the writes; flush it (storage, Note:
                   never lose the last good checkpoint).
  4. (all ranks)   exchange what was written (file, size, boxes and CRCs, values) or the error that stopped it: a
                   rank that failed still takes part, so no rank waits for it forever.
  5. (coordinator) check every tensor is tiled by the boxes written, build the metadata and commit it: written
                   last, atomically, the moment the checkpoint exists.
  6. (all ranks)   learn the coordinator's outcome, so every rank returns, or raises the same error, together.
A rank killed during the save makes the others' exchange in step 4 or 6 fail (PeerLostError): no metadata is
written, and an earlier checkpoint in the same place stays what it was.

async_save runs steps 1-2 and a copy of what this rank writes into host memory on the caller's thread (that
copy is all it blocks for), then steps 3-6 on a thread of its own over a group of its own, created at the first
async_save, so its exchanges never interleave with the training's collectives. With background staging
(DefaultStager) all of it, steps 1-2 and the copy included, runs on that thread over that group.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import json
import os
import secrets
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.metadata import Chunk, Metadata, TensorEntry, decode_value, encode_value
from spmd.checkpoint.layout import Box, LocalTensor, Path, covered, flatten, is_stateful, local_tensor
from spmd.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager
from spmd.checkpoint.storage import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from spmd.comm.group import ProcessGroup
from spmd.comm.objects import all_gather_bytes
from spmd.comm.world import AnyGroup, is_initialized, new_group, resolve_group


@runtime_checkable
class Stateful(Protocol):
    """An object save and load go through: save stores `state_dict()`, load fills that structure and passes it to
    `load_state_dict` (torch's protocol, e.g. a training loop's progress, a data loader's position)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class DefaultSavePlanner:
    """How save plans (torch's name): every box once (layout, Note: who writes what). The format holds each box
    once, so `dedup_replicated_tensors=False` (torch: write every replica) is refused."""

    dedup_replicated_tensors: bool = True

    def __post_init__(self) -> None:
        if not self.dedup_replicated_tensors:
            raise ValueError("DefaultSavePlanner: spmd's checkpoints hold each box of a tensor once; "
                             "dedup_replicated_tensors=False is not supported")


@dataclasses.dataclass
class DefaultLoadPlanner:
    """How load plans (torch's name). `allow_partial_load`: keys of the state dict the checkpoint lacks are left
    as they are instead of raising."""

    allow_partial_load: bool = False


# -- save -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _SavePlan:
    """Steps 1-2 of the save protocol, for this rank."""

    group: ProcessGroup | None
    rank: int
    save_id: str
    writes: dict[str, LocalTensor]          # the tensors this rank writes, by key
    values: dict[str, Any]                  # the non-tensor values this rank writes
    paths: dict[str, Path]                  # where each key of this rank sat in its nested state dict
    shapes: dict[str, tuple[str, tuple[int, ...]]]   # every tensor key of any rank -> (dtype name, global shape)


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: StorageWriter | None = None, planner: DefaultSavePlanner | None = None,
         process_group: AnyGroup | None = None, no_dist: bool = False) -> Metadata:
    """Write `state_dict` (tensors, DTensors of any layout, Stateful objects, JSON-able values) as a checkpoint at
    `checkpoint_id` (a directory) or through `storage_writer`. Collective over `process_group` (see Note: the
    save protocol); `no_dist`: this process alone writes everything. Returns the checkpoint's metadata."""
    writer = _writer(checkpoint_id, storage_writer)
    plan = _plan(state_dict, _group(process_group, no_dist))
    return _write_and_commit(plan, writer, plan.group)


class AsyncCheckpointerType(enum.Enum):
    """Where async_save writes: on a thread (spmd's, and torch's default) or in a process (torch's; not served)."""

    THREAD = "thread"
    PROCESS = "process"


@dataclasses.dataclass
class AsyncSaveResponse:
    """What async_save returns when staging runs in the background: staging_completion is done when the copy of
    what this rank saves is made (the tensors may change again), upload_completion when the checkpoint is
    committed (its result the metadata)."""

    staging_completion: concurrent.futures.Future[None]
    upload_completion: concurrent.futures.Future[Metadata]


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               storage_writer: StorageWriter | None = None, planner: DefaultSavePlanner | None = None,
               process_group: AnyGroup | None = None,
               async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
               async_stager: AsyncStager | None = None,
               no_dist: bool = False) -> concurrent.futures.Future[Metadata] | AsyncSaveResponse:
    """save() that returns once what this rank writes is copied to host memory; the writing goes on in the
    background and the Future's result is the metadata (or its exception the save's error). Training may change
    the tensors meanwhile. Collective over `process_group`, like save (see Note: the save protocol). The host
    buffers are kept for the next async_save, which first waits for this one to finish writing from them.

    With a stager that stages in the background (DefaultStager(), or a stager of the user's whose stage returns
    a Future), it returns at once an AsyncSaveResponse: wait for its staging_completion before changing the
    tensors (the optimizer step), and for its upload_completion for the checkpoint.
    """
    if async_checkpointer_type is not AsyncCheckpointerType.THREAD:
        raise ValueError("async_save: AsyncCheckpointerType.PROCESS is not served: spmd writes on a thread (the "
                         "file writes release the GIL); leave async_checkpointer_type at THREAD")
    writer = _writer(checkpoint_id, storage_writer)
    group = _group(process_group, no_dist)
    saver = _AsyncSaver.of(group)
    pin_memory, staged_by_user = True, False
    if isinstance(async_stager, DefaultStager):
        pin_memory = async_stager.config.use_pinned_memory
        if async_stager.config.use_async_staging:
            return _save_staging_in_background(_resolved(state_dict), writer, saver, None, pin_memory)
    elif async_stager is not None and not isinstance(async_stager, BlockingAsyncStager):
        staged = async_stager.stage(_resolved(state_dict))
        if isinstance(staged, concurrent.futures.Future):
            return _save_staging_in_background(staged, writer, saver, async_stager, pin_memory)
        state_dict, staged_by_user = staged, True
    plan = _plan(state_dict, group)
    if saver.writing is not None:
        concurrent.futures.wait([saver.writing])       # it still reads the buffers
    if not staged_by_user:
        plan.writes = saver.stage(plan.writes, pin_memory)
    future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(_write_and_commit(plan, writer, saver.group))
        except BaseException as error:     # the caller sees it through the future
            future.set_exception(error)

    saver.writing = future
    threading.Thread(target=run, name=f"spmd-async-save-rank{plan.rank}", daemon=True).start()
    if async_stager is not None and async_stager.should_synchronize_after_execute:
        async_stager.synchronize_staging()
    return future


def _save_staging_in_background(state_dict: dict[str, Any] | concurrent.futures.Future[dict[str, Any]],
                                writer: StorageWriter, saver: _AsyncSaver, stager: AsyncStager | None,
                                pin_memory: bool) -> AsyncSaveResponse:
    """async_save with every step on the saver's thread and group: wait for the previous save, plan, stage
    (into the saver's buffers, unless `stager` staged `state_dict` itself), write and commit."""
    staging: concurrent.futures.Future[None] = concurrent.futures.Future()
    upload: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    previous, saver.writing = saver.writing, upload

    def run() -> None:
        try:
            if previous is not None:
                concurrent.futures.wait([previous])
            source = state_dict.result() if isinstance(state_dict, concurrent.futures.Future) else state_dict
            plan = _plan(source, saver.group)
            if stager is None:
                plan.writes = saver.stage(plan.writes, pin_memory)
            staging.set_result(None)
            upload.set_result(_write_and_commit(plan, writer, saver.group))
        except BaseException as error:     # the caller sees it through the futures
            if not staging.done():
                staging.set_exception(error)
            upload.set_exception(error)

    threading.Thread(target=run, name="spmd-async-save", daemon=True).start()
    return AsyncSaveResponse(staging, upload)


_SAVERS_LOCK = threading.Lock()


class _AsyncSaver:
    """What async saves of one rank keep: the group their background exchanges run on (made, collectively, at
    the first one, so they never interleave with the training's collectives), the host buffers they stage into,
    and the save still writing from those buffers."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.buffers: dict[str, Tensor] = {}
        self.writing: concurrent.futures.Future[Metadata] | None = None

    @classmethod
    def of(cls, group: ProcessGroup | None) -> _AsyncSaver:
        """The saver of `group`'s async saves; its first one makes the background group, with the members alone
        (they all call async_save, in the same order), so any group may save asynchronously."""
        if group is None:
            return _ALONE
        with _SAVERS_LOCK:
            saver = _SAVERS.get(group)
        if saver is None:
            background = new_group(list(group.ranks), use_local_synchronization=True)
            assert isinstance(background, ProcessGroup)
            saver = cls(background)
            with _SAVERS_LOCK:
                _SAVERS[group] = saver
        return saver

    def stage(self, writes: dict[str, LocalTensor], pin_memory: bool) -> dict[str, LocalTensor]:
        """`writes` with their data copied into this saver's host buffers (allocated at the first save, or when
        a tensor's shape or dtype changed; page-locked for accelerator tensors with `pin_memory`). The save
        that wrote from them must have finished."""
        kept, staged = {}, {}
        for key, item in writes.items():
            data = item.data.detach()
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
                buffer = torch.empty(data.shape, dtype=data.dtype,
                                     pin_memory=pin_memory and data.device.type == "cuda")
            buffer.copy_(data)
            kept[key] = buffer
            staged[key] = dataclasses.replace(item, data=buffer)
        self.buffers = kept
        return staged


_SAVERS: weakref.WeakKeyDictionary[ProcessGroup, _AsyncSaver] = weakref.WeakKeyDictionary()   # group -> its saver
_ALONE = _AsyncSaver(None)      # a process saving by itself

def _writer(checkpoint_id: str | os.PathLike[str] | None, storage_writer: StorageWriter | None) -> StorageWriter:
    if storage_writer is not None:
        return storage_writer
    if checkpoint_id is None:
        raise ValueError("save: pass checkpoint_id (a directory) or storage_writer")
    return FileSystemWriter(checkpoint_id)


def _group(process_group: AnyGroup | None, no_dist: bool) -> ProcessGroup | None:
    if no_dist or (process_group is None and not is_initialized()):
        return None
    return resolve_group(process_group, "checkpoint")


def _resolved(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each top-level Stateful replaced by its state_dict() (as torch's DCP does)."""
    return {key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()}


def _exchange(group: ProcessGroup | None, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `mine`, as JSON (a single process: its own)."""
    data = json.dumps(mine).encode()
    if group is None:
        return [json.loads(data)]
    return [json.loads(part) for part in all_gather_bytes(data, group=group)]


def _plan(state_dict: Mapping[str, Any], group: ProcessGroup | None) -> _SavePlan:
    """Steps 1-2 of the save protocol."""
    rank = 0 if group is None else group.group_rank
    tensors: dict[str, LocalTensor] = {}
    values: dict[str, Any] = {}
    flat = flatten(_resolved(state_dict))
    for key, (_, leaf) in flat.items():
        if isinstance(leaf, Tensor):
            tensors[key] = local_tensor(key, leaf)
        else:
            encode_value(leaf, key)          # raises now, on the rank that holds it, for what can't be saved
            values[key] = leaf
    described = _exchange(group, {
        "id": secrets.token_hex(8),
        "tensors": {key: [tensor_format.dtype_name(t.data.dtype), list(t.shape), t.distributed,
                          list(t.box.offsets), list(t.box.sizes), t.writes] for key, t in tensors.items()},
        "values": sorted(values)})
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    writer_of: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}   # (key, box) -> the rank writing it
    first_value: dict[str, int] = {}
    for other, report in enumerate(described):
        for key, (dtype, shape, distributed, offsets, sizes, may_write) in report["tensors"].items():
            known = shapes.setdefault(key, (dtype, tuple(shape)))
            if known != (dtype, tuple(shape)):
                raise CheckpointError(f"save: ranks disagree about {key!r}: {known[0]} of shape {list(known[1])} "
                                      f"on one, {dtype} of shape {shape} on rank {other}")
            if may_write or not distributed:       # ranks on other submeshes may hold the same box: one writes
                writer_of.setdefault((key, tuple(offsets), tuple(sizes)), other)
        for key in report["values"]:
            first_value.setdefault(key, other)
    writes = {key: t for key, t in tensors.items()
              if not t.box.empty and writer_of.get((key, t.box.offsets, t.box.sizes)) == rank}
    return _SavePlan(group, rank, described[0]["id"], writes,
                     {key: value for key, value in values.items() if first_value[key] == rank},
                     {key: path for key, (path, _) in flat.items()}, shapes)


def _write_and_commit(plan: _SavePlan, writer: StorageWriter, group: ProcessGroup | None) -> Metadata:
    """Steps 3-6 of the save protocol."""
    report: dict[str, Any] = {"error": None, "file": None, "size": 0, "chunks": {},
                              "values": {key: encode_value(value, key) for key, value in plan.values.items()},
                              "paths": {key: list(plan.paths[key]) for key in [*plan.writes, *plan.values]}}
    try:
        if plan.writes:
            report.update(_write_file(plan, writer))
    except Exception as error:                # reported in step 4, so no rank waits for this one
        report["error"] = f"rank {plan.rank} could not write its data file: {type(error).__name__}: {error}"
    reports = _exchange(group, report)
    outcome: dict[str, Any] = {"error": next((r["error"] for r in reports if r["error"]), None)}
    metadata = None
    if plan.rank == 0 and outcome["error"] is None:
        try:
            metadata = _metadata(plan, reports)
            writer.commit(metadata.to_json(), list(metadata.files))
        except Exception as error:
            outcome["error"] = f"rank 0 could not commit the checkpoint: {type(error).__name__}: {error}"
    final = _exchange(group, outcome)[0] if group is not None else outcome
    if final["error"] is not None:
        raise CheckpointError(f"save {plan.save_id} failed: {final['error']}; no checkpoint was written")
    return metadata if metadata is not None else _metadata(plan, reports)


def _write_file(plan: _SavePlan, writer: StorageWriter) -> dict[str, Any]:
    """Step 3: this rank's data file; returns its report."""
    name = f"__{plan.rank}_{plan.save_id}.safetensors"
    datas = {key: _host_contiguous(item.data) for key, item in plan.writes.items()}
    header = tensor_format.header_bytes({key: (data.dtype, tuple(data.shape), data.numel() * data.element_size())
                                         for key, data in datas.items()})
    views = {key: tensor_format.as_bytes(data) for key, data in datas.items()}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spmd-checkpoint-crc") as pool:
        crcs = {key: pool.submit(tensor_format.crc32, view) for key, view in views.items()}
        size = writer.write_file(name, [memoryview(header), *views.values()])
        chunks = {key: [list(item.box.offsets), list(item.box.sizes), crcs[key].result()]
                  for key, item in plan.writes.items()}
    return {"file": name, "size": size, "chunks": chunks}


def _host_contiguous(data: Tensor) -> Tensor:
    data = data.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    return data.contiguous()


def _metadata(plan: _SavePlan, reports: list[dict[str, Any]]) -> Metadata:
    """Step 5: the index of what every rank wrote, checked to tile every tensor."""
    tensors = {key: TensorEntry(dtype, shape) for key, (dtype, shape) in plan.shapes.items()}
    values: dict[str, Any] = {}
    files: dict[str, int] = {}
    paths: dict[str, list[str | int]] = {}
    for report in reports:
        for key, path in report["paths"].items():
            paths.setdefault(key, path)
        if report["file"] is not None:
            files[report["file"]] = report["size"]
        for key, (offsets, sizes, crc) in report["chunks"].items():
            tensors[key].chunks.append(Chunk(report["file"], key, tuple(offsets), tuple(sizes), crc))
        for key, value in report["values"].items():
            values.setdefault(key, decode_value(value))
    for key, entry in tensors.items():
        if not covered(entry.shape, [Box(c.offsets, c.sizes) for c in entry.chunks]):
            raise CheckpointError(f"save: the shards written of {key!r} don't cover its global shape "
                                  f"{list(entry.shape)} (boxes {[(c.offsets, c.sizes) for c in entry.chunks]})")
    return Metadata(plan.save_id, tensors, values, files, paths)


# -- load -----------------------------------------------------------------------------------------------------

def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: StorageReader | None = None, planner: DefaultLoadPlanner | None = None,
         process_group: AnyGroup | None = None, no_dist: bool = False) -> None:
    """Fill `state_dict` in place from the checkpoint at `checkpoint_id` (or `storage_reader`), whatever layout it
    was saved under: every tensor and DTensor shard gets the values of its box, read from the byte ranges that
    overlap it; values are replaced; each top-level Stateful gets load_state_dict of its filled state_dict().
    Not collective: each rank reads what it holds (process_group and no_dist are accepted for torch's
    signature). Raises CheckpointError naming the key, file or mismatch."""
    reader = storage_reader if storage_reader is not None else FileSystemReader(_path(checkpoint_id))
    where = os.fspath(checkpoint_id) if checkpoint_id is not None else type(reader).__name__
    try:
        metadata = Metadata.from_json(reader.read_metadata(), f"checkpoint {where}")
        resolved = _resolved(state_dict)
        _Loader(reader, metadata, where, planner or DefaultLoadPlanner()).fill(resolved)
    finally:
        reader.close()
    for key, value in state_dict.items():
        if is_stateful(value):
            value.load_state_dict(resolved[key])
        else:
            state_dict[key] = resolved[key]


def _path(checkpoint_id: str | os.PathLike[str] | None) -> str:
    if checkpoint_id is None:
        raise ValueError("load: pass checkpoint_id (a directory) or storage_reader")
    return os.fspath(checkpoint_id)


class _Loader:
    """One load: the metadata, the files opened so far, the boxes already checked."""

    def __init__(self, reader: StorageReader, metadata: Metadata, where: str, planner: DefaultLoadPlanner) -> None:
        self.reader, self.metadata, self.where, self.planner = reader, metadata, where, planner
        self._files: dict[str, tensor_format.TensorFile] = {}
        self._checked: set[tuple[str, str]] = set()

    def fill(self, state_dict: dict[str, Any]) -> None:
        missing = []
        for key, (path, leaf) in flatten(state_dict).items():
            if isinstance(leaf, Tensor):
                entry = self.metadata.tensors.get(key)
                if entry is None:
                    missing.append(key)
                    continue
                with torch.no_grad():
                    self._fill_tensor(key, leaf, entry)
            elif key in self.metadata.values:
                _assign(state_dict, path, self.metadata.values[key])
            elif key in self.metadata.tensors:
                raise CheckpointError(f"checkpoint {self.where}: {key!r} is a tensor in the checkpoint but a "
                                      f"{type(leaf).__name__} in the state dict loaded into")
            else:
                missing.append(key)
        if missing and not self.planner.allow_partial_load:
            raise CheckpointError(f"checkpoint {self.where} has no {', '.join(repr(k) for k in missing[:8])}"
                                  f"{' ...' if len(missing) > 8 else ''} ({len(missing)} keys of the state dict; "
                                  f"pass planner=DefaultLoadPlanner(allow_partial_load=True) to leave them be)")

    def _fill_tensor(self, key: str, leaf: Tensor, entry: TensorEntry) -> None:
        target = local_tensor(key, leaf)
        dtype = tensor_format.dtype_of(entry.dtype)
        if target.shape != entry.shape or target.data.dtype != dtype:
            raise CheckpointError(f"checkpoint {self.where}: {key!r} was saved as {dtype} of shape "
                                  f"{list(entry.shape)}, but the state dict holds {target.data.dtype} of shape "
                                  f"{list(target.shape)}")
        filled = 0
        for chunk in entry.chunks:
            saved = Box(chunk.offsets, chunk.sizes)
            region = target.box.overlap(saved)
            if region is None or region.empty:
                continue
            if region == target.box == saved and _readable_into(target.data):
                self._read_whole(chunk, target.data)
            else:
                source = self._chunk(chunk, dtype)
                target.box.view(target.data, region).copy_(saved.view(source, region))
            filled += region.volume
        if filled != target.box.volume:
            raise CheckpointError(f"checkpoint {self.where}: the saved boxes of {key!r} cover {filled} of the "
                                  f"{target.box.volume} elements this rank holds")

    def _read_whole(self, chunk: Chunk, data: Tensor) -> None:
        """Read a saved box straight into `data`, which is all of it (a load into the layout it was saved from),
        then check it against its CRC-32."""
        offset, nbytes = self._file(chunk).location(chunk.key)
        view = tensor_format.as_bytes(data)
        if nbytes != len(view):
            raise CheckpointError(f"checkpoint {self.where}: data file {chunk.file} holds {nbytes} bytes of "
                                  f"{chunk.key!r}, its metadata says {len(view)}")
        self.reader.read_into(chunk.file, offset, view)
        self._check(chunk, view)

    def _check(self, chunk: Chunk, data: memoryview) -> None:
        if (chunk.file, chunk.key) not in self._checked:
            if tensor_format.crc32(data) != chunk.crc32:
                raise CheckpointError(f"checkpoint {self.where}: data file {chunk.file} is corrupted: the bytes of "
                                      f"{chunk.key!r} don't match their checksum")
            self._checked.add((chunk.file, chunk.key))

    def _chunk(self, chunk: Chunk, dtype: torch.dtype) -> Tensor:
        """The saved box, checked against its CRC-32 the first time it is read."""
        file = self._file(chunk)
        raw = file.raw(chunk.key)
        self._check(chunk, raw)
        source = file.tensor(chunk.key, raw)
        if source.dtype != dtype or tuple(source.shape) != chunk.sizes:
            raise CheckpointError(f"checkpoint {self.where}: data file {chunk.file} holds {chunk.key!r} as "
                                  f"{source.dtype} {list(source.shape)}, its metadata says {dtype} "
                                  f"{list(chunk.sizes)}")
        return source

    def _file(self, chunk: Chunk) -> tensor_format.TensorFile:
        file = self._files.get(chunk.file)
        if file is None:
            size = self.metadata.files.get(chunk.file)
            if size is None:
                raise CheckpointError(f"checkpoint {self.where}: its metadata names data file {chunk.file} but "
                                      f"not its size; the metadata is corrupted")
            actual = self.reader.file_size(chunk.file)
            if actual is not None and actual != size:
                raise CheckpointError(f"checkpoint {self.where}: data file {chunk.file} has {actual} bytes, its "
                                      f"metadata says {size} ({'truncated' if actual < size else 'grown'} since "
                                      f"the save)")
            file = tensor_format.TensorFile(chunk.file, lambda offset, length, name=chunk.file:
                                            self.reader.read(name, offset, length), size)
            self._files[chunk.file] = file
        return file


def _readable_into(data: Tensor) -> bool:
    """Whether a storage can read bytes straight into `data`'s memory."""
    return data.device.type == "cpu" and data.is_contiguous() and data.numel() > 0


def _assign(state_dict: dict[str, Any], path: Path, value: Any) -> None:
    """Replace the leaf at `path` of the nested `state_dict` by `value`."""
    parent: Any = state_dict
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, tuple):
        raise CheckpointError(f"load: can't replace {'.'.join(map(str, path))!r} inside a tuple; use a list")
    parent[path[-1]] = value

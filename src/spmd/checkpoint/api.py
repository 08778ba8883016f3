"""save, load and async_save: torch's DCP calls, over spmd's groups and the safetensors + JSON format.

Layer: checkpoint. save and async_save are collective over the process group (default: the world, when one is
initialized; a single process needs none); load is not: each rank reads the byte ranges it needs by itself.

Note: the save protocol
  1. (all ranks)   the planner (Stateful values through their state_dict()) plans what this rank could write:
                   every box it holds and every value; the plans are exchanged as JSON (all_gather_bytes:
                   nothing is unpickled), with rank 0's random id, which names this save.
  2. (coordinator) the planner's global plan decides who writes what (default_planner, Note: who writes what),
                   sent back to every rank, whose planner finishes its plan and resolves each item's data.
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

A planner that raises on one rank in steps 1-2 still lets it take part in the exchange, so every rank raises
the same CheckpointError (planner, Note: a planner's calls).

Note: no collections while a save or load runs
A save or load makes thousands of small objects (plans, items, metadata entries) and frees them all, by
reference counting, before it returns. Python's cyclic collector counts them all the same and, in a training
process with a large heap, starts a full collection in the middle (150 ms on benchmarks/checkpoint.py's GPT, ten
times the planning's own time). So save, load and the blocking part of async_save pause the automatic
collection while they run and restore it after; the background part of async_save does not, since the training
goes on meanwhile.

async_save runs steps 1-2 and a copy of what this rank writes into host memory on the caller's thread (that
copy is all it blocks for), then steps 3-6 on a thread of its own over a group of its own, created at the first
async_save, so its exchanges never interleave with the training's collectives. With background staging
(DefaultStager) all of it, steps 1-2 and the copy included, runs on that thread over that group.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import enum
import gc
import io
import json
import math
import os
import secrets
import threading
import traceback
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from spmd._core.errors import CheckpointError
from spmd.checkpoint import format as tensor_format
from spmd.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner, EncodedValue
from spmd.checkpoint.fsspec_storage import FsspecReader, FsspecWriter, is_url
from spmd.checkpoint.layout import Box, covered, is_stateful
from spmd.checkpoint.metadata import (
    Chunk,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    decode_value,
    encode_value,
)
from spmd.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from spmd.checkpoint.save_process import CheckpointProcess
from spmd.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager
from spmd.checkpoint.storage import (
    TORCH_SAVE,
    BoxWrite,
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
    StorageWriter,
    WriteResult,
    WrittenBoxes,
    box_tensor,
    decoded,
    encoded,
    speaks_torch_protocol,
)
from spmd.checkpoint.torch_format import TorchCheckpointReader, is_torch_checkpoint
from spmd.comm.collectives import holds_fewer_bytes, is_wrapper_subclass
from spmd.comm.group import ProcessGroup
from spmd.comm.objects import all_gather_bytes, all_gather_object
from spmd.comm.world import AnyGroup, is_initialized, new_group, resolve_group
from spmd.tensor.api import DTensor


@runtime_checkable
class Stateful(Protocol):
    """An object save and load go through: save stores `state_dict()`, load fills that structure and passes it to
    `load_state_dict` (torch's protocol, e.g. a training loop's progress, a data loader's position)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# -- save -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _SavePlan:
    """Steps 1-2 of the save protocol, for this rank."""

    group: ProcessGroup | None
    rank: int
    save_id: str
    writes: dict[str, BoxWrite]             # the boxes this rank writes, by a name unique on this rank
    values: dict[str, Any]                  # key -> the JSON encoding of a value this rank writes
    blobs: dict[str, bytes]                 # key -> a custom planner's bytes for a value this rank writes
    metadata: Metadata | None               # the coordinator's, from the global plan; None on the others
    storage_data: Any                       # what the writer's prepare_global_plan told this rank
    error: str | None                       # why this rank could not resolve its data (reported in step 4)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's automatic garbage collection off while the block runs, as it was after (Note: no collections
    while a save or load runs)."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


@_collection_paused()
def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: AnyGroup | None = None, no_dist: bool = False) -> Metadata:
    """Write `state_dict` (tensors, DTensors of any layout, Stateful objects, JSON-able values) as a checkpoint at
    `checkpoint_id` (a directory) or through `storage_writer`, planned by `planner` (DefaultSavePlanner, or a
    subclass's). Collective over `process_group` (see Note: the save protocol); `no_dist`: this process alone
    writes everything. Returns the checkpoint's metadata."""
    writer = _writer(checkpoint_id, storage_writer)
    plan = _plan(state_dict, _group(process_group, no_dist), planner, writer, checkpoint_id)
    return _write_and_commit(plan, writer, plan.group)


class AsyncCheckpointerType(enum.Enum):
    """Where async_save writes: on a thread (the default) or in a daemon process of this rank's (see Note: the
    checkpoint process in save_process.py), out of the training process's way."""

    THREAD = "thread"
    PROCESS = "process"


@dataclasses.dataclass
class AsyncSaveResponse:
    """What async_save returns when staging runs in the background: staging_completion is done when the copy of
    what this rank saves is made (the tensors may change again), upload_completion when the checkpoint is
    committed (its result the metadata)."""

    staging_completion: concurrent.futures.Future[None]
    upload_completion: concurrent.futures.Future[Metadata]


@_collection_paused()
def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
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

    `async_checkpointer_type=AsyncCheckpointerType.PROCESS`: the writing runs in a daemon process of this rank's
    instead of a thread (see Note: the checkpoint process in save_process.py); the writer must be picklable.
    """
    writer = _writer(checkpoint_id, storage_writer)
    group = _group(process_group, no_dist)
    saver = _AsyncSaver.of(group)
    checkpointer = AsyncCheckpointerType(async_checkpointer_type)
    pin_memory, staged_by_user = True, False
    if isinstance(async_stager, DefaultStager):
        pin_memory = async_stager.config.use_pinned_memory
        if async_stager.config.use_async_staging:
            return _save_staging_in_background(_resolved(state_dict), writer, saver, None, pin_memory, planner,
                                               checkpoint_id, checkpointer)
    elif async_stager is not None and not isinstance(async_stager, BlockingAsyncStager):
        staged = async_stager.stage(_resolved(state_dict))
        if isinstance(staged, concurrent.futures.Future):
            return _save_staging_in_background(staged, writer, saver, async_stager, pin_memory, planner,
                                               checkpoint_id, checkpointer)
        state_dict, staged_by_user = staged, True
    plan = _plan(state_dict, group, planner, writer, checkpoint_id)
    if saver.writing is not None:
        concurrent.futures.wait([saver.writing])       # it still reads the buffers
    if not staged_by_user:
        plan.writes = saver.stage(plan.writes, pin_memory)
    future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(saver.write(plan, writer, checkpointer))
        except BaseException as error:     # the caller sees it through the future
            future.set_exception(error)

    saver.writing = future
    threading.Thread(target=run, name=f"spmd-async-save-rank{plan.rank}", daemon=True).start()
    if async_stager is not None and async_stager.should_synchronize_after_execute:
        async_stager.synchronize_staging()
    return future


def _save_staging_in_background(state_dict: dict[str, Any] | concurrent.futures.Future[dict[str, Any]],
                                writer: StorageWriter, saver: _AsyncSaver, stager: AsyncStager | None,
                                pin_memory: bool, planner: SavePlanner | None,
                                checkpoint_id: str | os.PathLike[str] | None,
                                checkpointer: AsyncCheckpointerType) -> AsyncSaveResponse:
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
            plan = _plan(source, saver.group, planner, writer, checkpoint_id)
            if stager is None:
                plan.writes = saver.stage(plan.writes, pin_memory)
            staging.set_result(None)
            upload.set_result(saver.write(plan, writer, checkpointer))
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
    the save still writing from those buffers, and the checkpoint process (started by the group's first save
    that writes there)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.buffers: dict[str, Tensor] = {}
        self.writing: concurrent.futures.Future[Metadata] | None = None
        self._process: CheckpointProcess | None = None
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None   # of `buffers`

    def write(self, plan: _SavePlan, writer: StorageWriter, checkpointer: AsyncCheckpointerType) -> Metadata:
        """Steps 3-6 of the save protocol for `plan`, on the calling (background) thread or in the checkpoint
        process, as that save's caller chose. Collective over the group; every rank of it chose the same way."""
        if checkpointer is AsyncCheckpointerType.THREAD:
            return _write_and_commit(plan, writer, self.group)
        if self._process is None:
            self._process = CheckpointProcess(self.group)
        return self._process.write(plan, writer)

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

    def stage(self, writes: dict[str, BoxWrite], pin_memory: bool) -> dict[str, BoxWrite]:
        """`writes` with their data copied into this saver's host buffers: views of one flat buffer per dtype
        (allocated at the first save, or when the boxes' keys, shapes or dtypes changed; page-locked for
        accelerator tensors with `pin_memory`), so the checkpoint process receives one shared storage per
        dtype, not one per tensor. The save that wrote from them must have finished."""
        staged = {key: encoded(item) for key, item in writes.items() if holds_fewer_bytes(item.data)}
        copied = {key: item for key, item in writes.items() if key not in staged}     # (Note: compressed tensors)
        layout = [(key, item.data.dtype, tuple(item.data.shape)) for key, item in copied.items()]
        if layout != self._layout:
            self.buffers = _flat_buffers(layout, pin_memory and any(
                item.data.device.type == "cuda" for item in copied.values()))
            self._layout = layout
        for key, item in copied.items():
            buffer = self.buffers[key]
            buffer.copy_(item.data.detach())
            staged[key] = dataclasses.replace(item, data=buffer)
        return {key: staged[key] for key in writes}


def _flat_buffers(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], pin_memory: bool) -> dict[str, Tensor]:
    """A host buffer shaped like each box of `layout`: views of one flat tensor per dtype."""
    sizes: dict[torch.dtype, int] = {}
    for _, dtype, shape in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    flat = {dtype: torch.empty(size, dtype=dtype, pin_memory=pin_memory) for dtype, size in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    buffers = {}
    for key, dtype, shape in layout:
        start = offsets[dtype]
        offsets[dtype] = start + math.prod(shape)
        buffers[key] = flat[dtype][start:offsets[dtype]].view(shape)
    return buffers


_SAVERS: weakref.WeakKeyDictionary[ProcessGroup, _AsyncSaver] = weakref.WeakKeyDictionary()   # group -> its saver
_ALONE = _AsyncSaver(None)      # a process saving by itself

def _writer(checkpoint_id: str | os.PathLike[str] | None, storage_writer: StorageWriter | None) -> StorageWriter:
    if storage_writer is not None:
        if checkpoint_id is not None:
            storage_writer.reset(checkpoint_id)
        return storage_writer
    if checkpoint_id is None:
        raise ValueError("save: pass checkpoint_id (a directory or an fsspec URL) or storage_writer")
    return FsspecWriter(checkpoint_id) if is_url(checkpoint_id) else FileSystemWriter(checkpoint_id)


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


CheckpointException = CheckpointError     # torch's name, in its checkpoint package's api module


def _failed(save_id: str, errors: dict[int, str]) -> CheckpointError:
    """The save's error, naming the first failing group rank's reason; `failures` holds every one's (torch's
    CheckpointException.failures)."""
    failures = {rank: (CheckpointError(error), traceback.StackSummary()) for rank, error in sorted(errors.items())}
    return CheckpointError(f"save {save_id} failed: {errors[min(errors)]}; no checkpoint was written", failures)


def _errors_by_rank(reports: list[dict[str, Any]]) -> dict[int, str]:
    return {rank: report["error"] for rank, report in enumerate(reports) if report["error"]}


def _plan(state_dict: Mapping[str, Any], group: ProcessGroup | None, planner: SavePlanner | None,
          writer: StorageWriter, checkpoint_id: str | os.PathLike[str] | None) -> _SavePlan:
    """Steps 1-2 of the save protocol. A plan travels as a JSON string inside the exchange's JSON, so a rank
    parses only the plans it needs (the coordinator every rank's, a rank its own), and a rank's final plan
    made of items it proposed comes back as their positions: planning allocates little (a large training
    process pays for every object made here in its next full garbage collection)."""
    planner = planner if planner is not None else DefaultSavePlanner()
    rank = 0 if group is None else group.group_rank
    proposed, local, error = None, None, None
    try:
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=group is not None)
        planner.set_up_planner(_resolved(state_dict), writer.storage_meta() or StorageMeta(checkpoint_id), rank == 0)
        proposed = writer.prepare_local_plan(planner.create_local_plan())
        local = json.dumps(_encode_save_plan(proposed))
    except Exception as failure:          # exchanged, so every rank raises it
        error = f"rank {rank}'s {type(planner).__name__} could not plan: {type(failure).__name__}: {failure}"
    described = _exchange(group, {"id": secrets.token_hex(8), "plan": local, "error": error})
    save_id = described[0]["id"]
    errors = _errors_by_rank(described)
    if errors:
        raise _failed(save_id, errors)
    assert proposed is not None
    decided: dict[str, Any] = {"plans": None, "error": None}
    metadata, final = None, None
    if rank == 0:
        maker = type(planner).__name__
        try:
            received = [proposed, *(_decode_save_plan(json.loads(r["plan"])) for r in described[1:])]
            plans, metadata = planner.create_global_plan(received)
            if len(plans) != len(described) or not isinstance(metadata, Metadata):
                raise CheckpointError(f"create_global_plan must return one plan per rank ({len(described)}) and "
                                      f"spmd's Metadata (DefaultSavePlanner.create_global_plan's)")
            maker = type(writer).__name__
            plans = writer.prepare_global_plan(plans)
            final = plans[0]
            decided["plans"] = [None, *(json.dumps(_encode_decided(plan, sent))
                                        for plan, sent in zip(plans[1:], received[1:], strict=True))]
        except Exception as failure:
            decided["error"] = f"rank 0's {maker} could not make the global plan: {type(failure).__name__}: {failure}"
    decided = _exchange(group, decided)[0] if group is not None else decided
    if decided["error"]:
        raise _failed(save_id, {0: decided["error"]})
    if final is None:
        final = _decode_decided(json.loads(decided["plans"][rank]), proposed)
    plan = _SavePlan(group, rank, save_id, {}, {}, {}, metadata, final.storage_data, None)
    try:
        _resolve(planner, planner.finish_plan(final), plan)
    except Exception as failure:          # reported in step 4
        plan.error = f"rank {rank}'s {type(planner).__name__} could not resolve its data: " \
                     f"{type(failure).__name__}: {failure}"
    return plan


def _encode_decided(plan: SavePlan, sent: SavePlan) -> dict[str, Any]:
    """A rank's global plan: the positions of its items in the plan it sent, where it is made of them (the
    default planners' dedup), else the whole plan."""
    position = {id(item): at for at, item in enumerate(sent.items)}
    kept = [position.get(id(item)) for item in plan.items]
    if None in kept or plan.storage_data is not sent.storage_data or plan.planner_data is not sent.planner_data \
            or plan.usable != sent.usable:
        return {"plan": _encode_save_plan(plan)}
    return {"kept": kept}


def _decode_decided(body: dict[str, Any], proposed: SavePlan) -> SavePlan:
    if "kept" in body:
        return dataclasses.replace(proposed, items=[proposed.items[at] for at in body["kept"]])
    return _decode_save_plan(body["plan"])


def _resolve(planner: SavePlanner, finished: SavePlan, plan: _SavePlan) -> None:
    """What this rank writes of each item of its finished plan, into `plan`."""
    for item in finished.items:
        fqn = item.index.fqn
        data = planner.resolve_data(item)
        if item.type is WriteItemType.BYTE_IO:
            if isinstance(data, EncodedValue):
                plan.values[fqn] = data.encoded
            elif isinstance(data, io.BytesIO):
                plan.blobs[fqn] = data.getvalue()
            else:
                raise CheckpointError(f"resolve_data gave a {type(data).__name__} for the value {fqn!r}; a value's "
                                      f"data is a BytesIO")
            continue
        written = item.tensor_data
        if not isinstance(data, Tensor) or isinstance(data, DTensor) or written is None:
            raise CheckpointError(f"resolve_data gave a {type(data).__name__} for the tensor item {fqn!r}; a box's "
                                  f"data is a plain tensor (a DTensor's local shard)")
        if tuple(data.shape) != tuple(written.chunk.sizes) or data.dtype != written.properties.dtype:
            raise CheckpointError(f"resolve_data gave {data.dtype} of shape {list(data.shape)} for {fqn!r}, whose "
                                  f"item plans {written.properties.dtype} of shape {list(written.chunk.sizes)}")
        if data.numel() == 0:
            continue
        name = fqn if fqn not in plan.writes else f"{fqn}@{','.join(map(str, written.chunk.offsets))}"
        plan.writes[name] = BoxWrite(item, data)


def _encode_save_plan(plan: SavePlan) -> dict[str, Any]:
    """A SavePlan as JSON (planner_data and storage_data must be JSON-able values: nothing is unpickled)."""
    items = []
    for item in plan.items:
        tensor = item.tensor_data
        items.append([item.index.fqn, None if item.index.offset is None else list(item.index.offset),
                      item.index.index, item.type.name,
                      None if tensor is None else [list(tensor.chunk.offsets), list(tensor.chunk.sizes),
                                                   tensor_format.dtype_name(tensor.properties.dtype),
                                                   list(tensor.size)]])
    return {"items": items, "storage_data": encode_value(plan.storage_data, "SavePlan.storage_data"),
            "planner_data": encode_value(plan.planner_data, "SavePlan.planner_data"), "usable": plan.usable}


def _decode_save_plan(body: dict[str, Any]) -> SavePlan:
    items = []
    for fqn, offset, position, kind, tensor in body["items"]:
        data = None
        if tensor is not None:
            offsets, sizes, dtype, size = tensor
            data = TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                   TensorProperties(tensor_format.dtype_of(dtype)), torch.Size(size))
        items.append(WriteItem(MetadataIndex(fqn, offset, position), WriteItemType[kind], tensor_data=data))
    return SavePlan(items, decode_value(body["storage_data"]), decode_value(body["planner_data"]), body["usable"])


def _write_and_commit(plan: _SavePlan, writer: StorageWriter, group: ProcessGroup | None) -> Metadata:
    """Steps 3-6 of the save protocol (a writer of torch's: see Note: torch's storage protocol in storage.py)."""
    torch_protocol = speaks_torch_protocol(writer)
    report: dict[str, Any] = {"error": plan.error, "files": {}, "boxes": [], "values": plan.values,
                              "blobs": {key: base64.b64encode(blob).decode() for key, blob in plan.blobs.items()}}
    results: list[WriteResult] = []
    try:
        if plan.error is None and torch_protocol:
            results = _write_data(writer, plan)
            report["boxes"] = [["", name, box.item.index.fqn, list(box.item.tensor_data.chunk.offsets),
                                list(box.item.tensor_data.chunk.sizes), None, None]
                               for name, box in plan.writes.items() if box.item.tensor_data is not None]
        elif plan.error is None:
            report.update(_encode_written(writer.write_boxes(plan.rank, plan.save_id, plan.writes,
                                                             plan.storage_data)))
    except Exception as error:                # reported in step 4, so no rank waits for this one
        report["error"] = f"rank {plan.rank} could not write its data file: {type(error).__name__}: {error}"
    reports = _exchange(group, report)
    every_result = _gather_results(group, results) if torch_protocol else []
    outcome: dict[str, Any] = {"errors": _errors_by_rank(reports), "metadata": None}
    metadata = None
    if plan.rank == 0 and not outcome["errors"]:
        try:
            assert plan.metadata is not None     # the coordinator's, from step 2
            metadata = _metadata(plan.metadata, plan.save_id, reports)
            if torch_protocol:
                writer.finish(metadata, every_result)
            else:
                metadata = writer.finish(metadata, plan.storage_data)
            outcome["metadata"] = metadata.to_json().decode()
        except Exception as error:
            outcome["errors"] = {0: f"rank 0 could not commit the checkpoint: {type(error).__name__}: {error}"}
    final = _exchange(group, outcome)[0] if group is not None else outcome
    if final["errors"]:          # JSON's keys are strings
        raise _failed(plan.save_id, {int(rank): error for rank, error in final["errors"].items()})
    return metadata if plan.rank == 0 else Metadata.from_json(final["metadata"].encode(), f"save {plan.save_id}")


class _ResolvedData:
    """The save planner torch's write_data is given: what this rank's plan resolved for each item."""

    def __init__(self, writes: Mapping[str, BoxWrite]) -> None:
        self._data = {id(box.item): box_tensor(box) for box in writes.values()}

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        return self._data[id(write_item)]


def _write_data(writer: StorageWriter, plan: _SavePlan) -> list[WriteResult]:
    """Step 3 for a writer of torch's protocol: its write_data on this rank's tensor items; their WriteResults."""
    items = [box.item for box in plan.writes.values()]
    results = list(writer.write_data(SavePlan(items, plan.storage_data), _ResolvedData(plan.writes)).wait())
    if len(results) != len(items) or not all(isinstance(result, WriteResult) for result in results):
        raise CheckpointError(f"{type(writer).__name__}.write_data gave {len(results)} results for {len(items)} "
                              f"items; it must give one WriteResult per item")
    return results


def _gather_results(group: ProcessGroup | None, results: list[WriteResult]) -> list[list[WriteResult]]:
    """Every rank's WriteResults, in rank order (pickled: a storage's storage_data may be any object; the peers
    are the group's authenticated members)."""
    if group is None:
        return [results]
    every: list[Any] = [None] * group.size()
    all_gather_object(every, results, group=group)
    return every


def _encode_written(written: WrittenBoxes) -> dict[str, Any]:
    """Step 3's result as the JSON of this rank's report."""
    return {"files": written.files,
            "boxes": [[box.file, box.key, box.fqn, list(box.offsets), list(box.sizes), box.crc32, box.encoding]
                      for box in written.boxes]}


def _metadata(planned: Metadata, save_id: str, reports: list[dict[str, Any]]) -> Metadata:
    """Step 5: the global plan's metadata with what every rank wrote, checked to tile every tensor."""
    metadata = dataclasses.replace(planned, save_id=save_id, files={}, values={}, blobs={},
                                   tensors={key: dataclasses.replace(entry, chunks=[])
                                            for key, entry in planned.tensors.items()})
    for report in reports:
        metadata.files.update(report["files"])
        for file, key, fqn, offsets, sizes, crc, encoding in report["boxes"]:
            metadata.tensors[fqn].chunks.append(Chunk(file, key, tuple(offsets), tuple(sizes), crc, encoding))
        for key, value in report["values"].items():
            metadata.values.setdefault(key, decode_value(value))
        for key, blob in report["blobs"].items():
            metadata.blobs.setdefault(key, base64.b64decode(blob))
    for key, entry in metadata.tensors.items():
        if not covered(entry.shape, [Box(c.offsets, c.sizes) for c in entry.chunks]):
            raise CheckpointError(f"save: the shards written of {key!r} don't cover its global shape "
                                  f"{list(entry.shape)} (boxes {[(c.offsets, c.sizes) for c in entry.chunks]})")
    return metadata


# -- load -----------------------------------------------------------------------------------------------------

@_collection_paused()
def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str] | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: AnyGroup | None = None, no_dist: bool = False) -> None:
    """Fill `state_dict` in place from the checkpoint at `checkpoint_id` (or `storage_reader`), whatever layout it
    was saved under: every tensor and DTensor shard gets the values of its box, read from the byte ranges that
    overlap it; values are replaced; each top-level Stateful gets load_state_dict of its filled state_dict().
    `planner`: DefaultLoadPlanner, or a subclass's (planner, Note: a planner's calls; keys its set_up_planner adds
    to the state dict are added to `state_dict`). Not collective: each rank
    reads what it holds (process_group and no_dist are accepted for torch's signature). Raises CheckpointError
    naming the key, file or mismatch."""
    planner = planner if planner is not None else DefaultLoadPlanner()
    reader = storage_reader if storage_reader is not None else _reader(checkpoint_id)
    if storage_reader is not None and checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    where = os.fspath(checkpoint_id) if checkpoint_id is not None else type(reader).__name__
    group = _group(process_group, no_dist)
    coordinator = group is None or group.group_rank == 0
    try:
        metadata = _read_metadata(reader, where)
        resolved = _resolved(state_dict)
        reader.set_up_storage_reader(metadata, coordinator, rank=0 if group is None else group.group_rank,
                                     use_collectives=False)
        planner.set_up_planner(resolved, metadata, coordinator)
        central = reader.prepare_global_plan(planner.create_global_plan([reader.prepare_local_plan(
            planner.create_local_plan())]))
        plan = planner.finish_plan(central[0])
        loader = _Loader(reader, metadata, where)
        if speaks_torch_protocol(reader):
            loader.run_through_read_data(plan, planner)
        else:
            loader.run(plan, planner)
    finally:
        reader.close()
    for key, value in resolved.items():
        if is_stateful(state_dict.get(key)):
            state_dict[key].load_state_dict(value)
        else:
            state_dict[key] = value


def save_state_dict(state_dict: dict[str, Any], storage_writer: StorageWriter, process_group: AnyGroup | None = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: SavePlanner | None = None) -> Metadata:
    """torch's older name of save, deprecated there too (older tutorials call it): the same save through
    `storage_writer`. `coordinator_rank` is accepted: spmd's coordinator is the group's rank 0, with the same
    result."""
    warnings.warn("save_state_dict is deprecated; use save", FutureWarning, stacklevel=2)
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: StorageReader, process_group: AnyGroup | None = None,
                    coordinator_rank: int = 0, no_dist: bool = False, planner: LoadPlanner | None = None) -> None:
    """torch's older name of load, deprecated there too: the same load through `storage_reader`."""
    warnings.warn("load_state_dict is deprecated; use load", FutureWarning, stacklevel=2)
    load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group, no_dist=no_dist)


def _read_metadata(reader: StorageReader, where: str) -> Metadata:
    """The reader's metadata: its JSON (spmd's format), or the Metadata a reader of another format builds."""
    found = reader.read_metadata()
    if isinstance(found, Metadata):
        found.where = f"checkpoint {where}"
        return found
    return Metadata.from_json(found, f"checkpoint {where}")


def _reader(checkpoint_id: str | os.PathLike[str] | None) -> StorageReader:
    if checkpoint_id is None:
        raise ValueError("load: pass checkpoint_id (a directory or an fsspec URL) or storage_reader")
    if is_url(checkpoint_id):
        return FsspecReader(checkpoint_id)
    if is_torch_checkpoint(checkpoint_id):
        return TorchCheckpointReader(checkpoint_id)
    return FileSystemReader(os.fspath(checkpoint_id))


class _Loader:
    """One load: the metadata, the files opened so far, the boxes already checked."""

    def __init__(self, reader: StorageReader, metadata: Metadata, where: str) -> None:
        self.reader, self.metadata, self.where = reader, metadata, where
        self._files: dict[str, tensor_format.TensorFile] = {}
        self._tensors: dict[tuple[str, str], Tensor] = {}      # boxes stored as their tensors, read so far
        self._checked: set[tuple[str, str]] = set()
        self._saved = {(key, chunk.offsets): chunk for key, entry in metadata.tensors.items() for chunk in entry.chunks}

    def run(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Every item of the plan: a region of a saved box copied into resolve_tensor's tensor, then committed;
        a value's bytes handed to load_bytes."""
        for item in plan.items:
            if item.type is LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value(item.storage_index.fqn))
                continue
            with torch.no_grad():
                target = planner.resolve_tensor(item)
                self._fill(item, target)
            planner.commit_tensor(item, target)

    def run_through_read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """A reader of torch's protocol: values from the metadata, the tensor items through its read_data."""
        tensors = []
        for item in plan.items:
            if item.type is LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value(item.storage_index.fqn))
            else:
                tensors.append(item)
        if tensors:
            self.reader.read_data(LoadPlan(tensors, plan.storage_data, plan.planner_data), planner).wait()

    def _value(self, key: str) -> io.BytesIO:
        if key in self.metadata.values:
            return EncodedValue(self.metadata.values[key], key)
        if key in self.metadata.blobs:
            return io.BytesIO(self.metadata.blobs[key])
        raise CheckpointError(f"checkpoint {self.where} has no value {key!r} (the load plan reads one)")

    def _fill(self, item: ReadItem, target: Tensor) -> None:
        key = item.storage_index.fqn
        chunk = self._saved.get((key, tuple(item.storage_index.offset or ())))
        if chunk is None:
            raise CheckpointError(f"checkpoint {self.where} has no box of {key!r} at "
                                  f"{list(item.storage_index.offset or ())} (the load plan reads one)")
        if tuple(target.shape) != tuple(item.lengths):
            raise CheckpointError(f"load: resolve_tensor gave a tensor of shape {list(target.shape)} for a region "
                                  f"of {key!r} of shape {list(item.lengths)}")
        converted = self.reader.read_region(chunk, tuple(item.storage_offsets), tuple(item.lengths))
        if converted is None and chunk.encoding == TORCH_SAVE:
            converted = Box((0,) * len(chunk.sizes), chunk.sizes).view(
                self._stored_tensor(chunk), Box(tuple(item.storage_offsets), tuple(item.lengths)))
        if converted is not None:
            target.copy_(converted)
            return
        dtype = tensor_format.dtype_of(self.metadata.tensors[key].dtype)
        whole = tuple(item.lengths) == chunk.sizes and not any(item.storage_offsets)
        if whole and target.dtype == dtype and _readable_into(target):
            self._read_whole(chunk, target)
            return
        saved = Box((0,) * len(chunk.sizes), chunk.sizes)
        target.copy_(saved.view(self._chunk(chunk, dtype), Box(tuple(item.storage_offsets), tuple(item.lengths))))

    def _stored_tensor(self, chunk: Chunk) -> Tensor:
        """A box stored as its tensor (see Note: compressed tensors in storage.py), read once and kept for the other
        regions of this load that read it."""
        stored = self._tensors.get((chunk.file, chunk.key))
        if stored is None:
            file = self._file(chunk)
            raw = file.raw(chunk.key)
            self._check(chunk, raw)
            stored = decoded(raw, f"checkpoint {self.where}")
            if not isinstance(stored, Tensor) or tuple(stored.shape) != chunk.sizes:
                raise CheckpointError(f"checkpoint {self.where}: data file {chunk.file} holds {chunk.key!r} as "
                                      f"{type(stored).__name__} {list(getattr(stored, 'shape', []))}, its metadata "
                                      f"says a tensor of shape {list(chunk.sizes)}")
            self._tensors[(chunk.file, chunk.key)] = stored
        return stored

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
        if chunk.crc32 is not None and (chunk.file, chunk.key) not in self._checked:
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
    """Whether a storage can read bytes straight into `data`'s memory (not a wrapper subclass's: its copy_ takes
    the values)."""
    return data.device.type == "cpu" and data.is_contiguous() and data.numel() > 0 and not is_wrapper_subclass(data)

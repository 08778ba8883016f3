"""spmd.checkpoint save / load / async_save: a checkpoint saved under one layout loads bit-exact under another
(FSDP2 on 4 ranks into TP on 2, FSDP x TP on 4, DDP on 2 and one plain process, AdamW state included), a
replicated tensor is written once, loads read only the byte ranges they need, the files are safetensors, and
corrupted, truncated, incomplete or mismatching checkpoints raise naming what is wrong. Thread ranks; the kill
test in real processes is in test_crash.py."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from typing import Any

import pytest
import safetensors.torch
import torch

import spmd.checkpoint as dcp
import spmd.checkpoint.api as dcp_api
from spmd._core.errors import CheckpointError
from spmd.checkpoint.metadata import DCP_MARKER, DCP_MARKER_FILE, FORMAT_VERSION, METADATA_FILE
from spmd.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from spmd.checkpoint.storage import FileSystemReader
from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor
from spmd.testing import run_ranks
from tests.checkpoint.test_state_dict import WORLD, adamw, build, parallelize, train

TIMEOUT = 60.0
FULL = StateDictOptions(full_state_dict=True)


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FULL)
    return {"model": {k: v.clone() for k, v in model_sd.items()},
            "optim": {fqn: {k: v.clone() for k, v in state.items()} for fqn, state in optim_sd["state"].items()}}


def _save_trained(layout: str, path: str) -> dict[str, Any]:
    """Train `layout` two steps, save it at `path`; the full state it saved."""
    def body(rank: int, world_size: int) -> dict[str, Any]:
        model, dp_rank, dp = parallelize(layout, build())
        optimizer = adamw(model)
        train(model, optimizer, range(2), dp_rank, dp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "progress": {"step": 2, "tag": ("run", 1)}},
                 checkpoint_id=path)
        return _full_state(model, optimizer)

    return run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT)[0]


def _load_into(layout: str, path: str) -> dict[str, Any]:
    """A fresh `layout` model (other initial values) loaded from `path`; its full state and the progress."""
    def body(rank: int, world_size: int) -> dict[str, Any]:
        model, _, _ = parallelize(layout, build(seed=1))
        optimizer = adamw(model)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "progress": {"step": 0, "tag": None}}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return {**_full_state(model, optimizer), "progress": state["progress"]}

    if layout == "plain":        # one process, no process group at all
        return body(0, 1)
    return run_ranks(body, world_size=WORLD[layout], timeout=TIMEOUT)[0]


def _assert_identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["model"].keys() == want["model"].keys() and got["optim"].keys() == want["optim"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    for fqn, state in want["optim"].items():
        for name, value in state.items():
            assert torch.equal(got["optim"][fqn][name], value), (fqn, name)


@pytest.mark.parametrize("target", ["tp", "fsdp_tp", "ddp", "plain", "fsdp"])
def test_fsdp_on_4_ranks_loads_bit_exact_into_every_layout(tmp_path, target: str) -> None:
    saved = _save_trained("fsdp", str(tmp_path / "ckpt"))
    loaded = _load_into(target, str(tmp_path / "ckpt"))
    _assert_identical(loaded, saved)
    assert loaded["progress"] == {"step": 2, "tag": ("run", 1)}


def test_tensor_parallel_and_fsdp_x_tp_checkpoints_load_into_fsdp_and_one_process(tmp_path) -> None:
    for layout in ("tp", "fsdp_tp"):
        saved = _save_trained(layout, str(tmp_path / layout))
        _assert_identical(_load_into("fsdp", str(tmp_path / layout)), saved)
        _assert_identical(_load_into("plain", str(tmp_path / layout)), saved)


@pytest.mark.parametrize("to_lowest_rank, plain_writer", [(False, 2), (True, 0)])
def test_a_replicated_tensor_is_written_once_and_shards_once_each(tmp_path, to_lowest_rank: bool,
                                                                  plain_writer: int) -> None:
    path = str(tmp_path / "ckpt")
    full = torch.arange(24.0).reshape(4, 6)

    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        dcp.save({"replicated": distribute_tensor(full, mesh, [Replicate(), Replicate()]),
                  "rows": distribute_tensor(full, mesh, [Shard(0), Replicate()]),
                  "grid": distribute_tensor(full, mesh, [Shard(0), Shard(1)]),
                  "plain": full * 2, "count": 3}, checkpoint_id=path,
                 planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=to_lowest_rank))

    run_ranks(body, world_size=4, timeout=TIMEOUT)
    metadata = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    chunks = {key: [(c["file"], c["offsets"]) for c in entry["chunks"]] for key, entry in metadata["tensors"].items()}
    file_of = {rank: f"__{rank}_{metadata['save_id']}.safetensors" for rank in range(4)}
    assert chunks["replicated"] == [(file_of[0], [0, 0])]
    assert sorted(offsets for _, offsets in chunks["rows"]) == [[0, 0], [2, 0]]
    assert len(chunks["grid"]) == 4 and metadata["values"] == {"count": 3}
    # balanced (torch's default and torch's choice), item by item in rank 0's order: the 96-byte replicated tensor
    # goes to rank 0, the first 48-byte rows block to rank 1, rank 0's grid piece to it (120 bytes now), the
    # 96-byte plain one to rank 2 (the first with none)
    assert chunks["plain"] == [(file_of[plain_writer], [0, 0])]
    files = sorted(os.listdir(path))    # every rank holds a grid piece; no temporary names
    assert files == sorted([METADATA_FILE, DCP_MARKER_FILE, *file_of.values()])
    # torch's index name holds a note, so tools that find DCP checkpoints by it (TorchTitan's resume) find this one
    assert (tmp_path / "ckpt" / ".metadata").read_bytes() == DCP_MARKER
    assert torch.equal(safetensors.torch.load_file(os.path.join(path, file_of[0]))["replicated"], full)
    assert torch.equal(safetensors.torch.load_file(os.path.join(path, file_of[plain_writer]))["plain"], full * 2)


class _CountingReader(FileSystemReader):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.read_bytes = 0

    def read(self, name: str, offset: int, length: int) -> memoryview:
        self.read_bytes += length
        return super().read(name, offset, length)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        self.read_bytes += len(buffer)
        super().read_into(name, offset, buffer)


def test_a_load_reads_only_the_byte_ranges_of_the_shards_it_holds(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    full = torch.arange(64 * 1024.0).reshape(64, 1024)       # 256 KiB, saved in 4 row blocks

    run_ranks(lambda rank, size: dcp.save({"w": distribute_tensor(full, init_device_mesh("cpu", (4,)), [Shard(0)])},
                                          checkpoint_id=path), world_size=4, timeout=TIMEOUT)

    def body(rank: int, world_size: int) -> int:
        target = distribute_tensor(torch.zeros(64, 1024), init_device_mesh("cpu", (4,)), [Shard(0)])
        reader = _CountingReader(path)
        dcp.load({"w": target}, storage_reader=reader)
        assert torch.equal(target.to_local(), full.chunk(4)[rank])
        return reader.read_bytes

    read = run_ranks(body, world_size=4, timeout=TIMEOUT)
    assert all(64 * 1024 <= n < 64 * 1024 + 4096 for n in read), read     # one quarter, plus a header


def test_stateful_objects_and_values_round_trip(tmp_path) -> None:
    class Progress:
        def __init__(self) -> None:
            self.step, self.rng = 0, torch.zeros(4)

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "rng": self.rng, "history": [1.5, float("inf")]}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step, self.rng, self.history = state["step"], state["rng"], state["history"]

    before, after = Progress(), Progress()
    before.step, before.rng = 7, torch.arange(4.0)
    dcp.save({"progress": before}, checkpoint_id=str(tmp_path))
    dcp.load({"progress": after}, checkpoint_id=str(tmp_path))
    assert after.step == 7 and torch.equal(after.rng, before.rng) and after.history == [1.5, float("inf")]


def test_a_value_that_needs_pickle_is_refused_naming_its_key(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"'extra.fn' holds a builtin_function_or_method, which can't be saved"):
        dcp.save({"extra": {"fn": len}}, checkpoint_id=str(tmp_path))


# -- bad input and damage -----------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64), "step": 4}, checkpoint_id=path)
    return path


def _data_file(path: str) -> str:
    return next(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors"))


def test_missing_keys_raise_unless_partial_loads_are_allowed(saved: str) -> None:
    state = {"w": torch.zeros(1000), "extra": torch.zeros(2), "step": 0}
    with pytest.raises(CheckpointError, match=r"has no 'extra'"):
        dcp.load(state, checkpoint_id=saved)
    dcp.load(state, checkpoint_id=saved, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(state["w"], torch.arange(1000.0)) and state["step"] == 4 and not state["extra"].any()


@pytest.mark.parametrize("tensor, says", [
    (torch.zeros(999), r"'w' was saved as torch.float32 of shape \[1000\], but the state dict holds torch.float32 "
                       r"of shape \[999\]"),
    (torch.zeros(1000, dtype=torch.float64), r"'w' was saved as torch.float32 .* holds torch.float64"),
])
def test_shape_and_dtype_mismatches_are_named(saved: str, tensor: torch.Tensor, says: str) -> None:
    with pytest.raises(CheckpointError, match=says):
        dcp.load({"w": tensor}, checkpoint_id=saved)


def test_a_corrupted_byte_is_caught_naming_the_file_and_tensor(saved: str) -> None:
    name = _data_file(saved)
    with open(name, "r+b") as file:
        file.seek(-100, os.SEEK_END)
        byte = file.read(1)
        file.seek(-100, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CheckpointError, match=rf"data file {os.path.basename(name)} is corrupted: the bytes of 'w'"):
        dcp.load({"w": torch.zeros(1000)}, checkpoint_id=saved)


def test_a_truncated_file_is_caught(saved: str) -> None:
    name = _data_file(saved)
    os.truncate(name, os.path.getsize(name) - 10)
    with pytest.raises(CheckpointError, match=r"truncated"):
        dcp.load({"w": torch.zeros(1000)}, checkpoint_id=saved)


def test_not_a_checkpoint_an_incomplete_one_and_a_newer_format(tmp_path, saved: str) -> None:
    with pytest.raises(CheckpointError, match=r"no such directory"):
        dcp.load({}, checkpoint_id=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"is not a checkpoint: it has no metadata.json"):
        dcp.load({}, checkpoint_id=str(tmp_path / "empty"))
    metadata = json.loads(open(os.path.join(saved, METADATA_FILE)).read())
    metadata["version"] = FORMAT_VERSION + 1
    with open(os.path.join(saved, METADATA_FILE), "w") as file:
        json.dump(metadata, file)
    with pytest.raises(CheckpointError, match=rf"format version {FORMAT_VERSION + 1}, newer than this spmd reads"):
        dcp.load({}, checkpoint_id=saved)
    os.unlink(os.path.join(saved, METADATA_FILE))
    with pytest.raises(CheckpointError, match=r"is incomplete: it has no metadata.json, and 1 data files"):
        dcp.load({}, checkpoint_id=saved)


class _FailingWriter(dcp.FileSystemWriter):
    """Fails rank 1's data file, after writing part of it."""

    def write_file(self, name: str, parts: Any) -> int:
        if name.startswith("__1_"):
            raise OSError(28, "No space left on device")
        return super().write_file(name, parts)


def test_a_rank_failing_mid_save_fails_every_rank_and_leaves_the_last_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    mesh_shape = (2,)

    def body(rank: int, world_size: int) -> tuple[str, dict]:
        mesh = init_device_mesh("cpu", mesh_shape)
        dcp.save({"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}, checkpoint_id=path)
        with pytest.raises(dcp.CheckpointException) as raised:     # torch's name for it
            dcp.save({"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])},
                     storage_writer=_FailingWriter(path))
        target = distribute_tensor(torch.full((8,), -1.0), mesh, [Shard(0)])
        dcp.load({"w": target}, checkpoint_id=path)
        assert torch.equal(target.full_tensor(), torch.arange(8.0))      # the first save, whole
        return str(raised.value), raised.value.failures

    for message, failures in run_ranks(body, world_size=2, timeout=TIMEOUT):
        assert "rank 1 could not write its data file: OSError: [Errno 28] No space left on device" in message
        assert "no checkpoint was written" in message
        assert list(failures) == [1]                                    # by group rank, as torch's failures
        error, trace = failures[1]
        assert "No space left on device" in str(error) and isinstance(trace, traceback.StackSummary)


def test_saving_over_a_checkpoint_replaces_it_and_removes_its_files(saved: str) -> None:
    old = _data_file(saved)
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=saved)
    assert not os.path.exists(old) and len(os.listdir(saved)) == 3       # index, torch's index name, data
    state = {"w": torch.zeros(1000)}
    dcp.load(state, checkpoint_id=saved)
    assert torch.equal(state["w"], torch.ones(1000))


def test_async_save_returns_after_staging_and_writes_what_was_there_then(tmp_path) -> None:
    path = str(tmp_path / "ckpt")

    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        weight = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)])
        future = dcp.async_save({"w": weight, "step": 3}, checkpoint_id=path)
        weight.to_local().add_(100)                           # training goes on meanwhile
        metadata = future.result(timeout=TIMEOUT)
        assert set(metadata.tensors) == {"w"} and metadata.values == {"step": 3}
        target = distribute_tensor(torch.zeros(10), mesh, [Shard(0)])
        state = {"w": target, "step": 0}
        dcp.load(state, checkpoint_id=path)
        assert torch.equal(target.full_tensor(), torch.arange(10.0)) and state["step"] == 3
        second = dcp.async_save({"w": weight}, checkpoint_id=str(tmp_path / "second"))   # the group is reused
        second.result(timeout=TIMEOUT)

    run_ranks(body, world_size=2, timeout=TIMEOUT)


def test_async_save_on_a_subgroup_saves_what_its_members_hold(tmp_path) -> None:
    """Two pipeline-stage-like halves of 4 ranks each save their own shards asynchronously over their own group
    (the background group is made by its members alone); the world's other groups are unaffected."""
    import spmd

    def body(rank: int, world_size: int) -> list[float]:
        halves = [spmd.new_group([0, 1]), spmd.new_group([2, 3])]
        half = halves[rank // 2]
        path = str(tmp_path / f"half{rank // 2}")
        local = torch.arange(5.0) + 10 * rank
        future = dcp.async_save({"w": local.clone(), "stage": rank // 2}, checkpoint_id=path, process_group=half)
        local.add_(100)
        future.result(timeout=TIMEOUT)
        dcp.async_save({"w": local.clone()}, checkpoint_id=path + "-again", process_group=half).result(
            timeout=TIMEOUT)                                # the half's background group is reused
        spmd.all_reduce(total := torch.ones(1))            # the default group still serves every rank
        state = {"w": torch.zeros(5), "stage": -1}
        dcp.load(state, checkpoint_id=path, process_group=half)
        assert state["stage"] == rank // 2 and total.item() == 4
        return state["w"].tolist()

    results = run_ranks(body, world_size=4, timeout=TIMEOUT)
    # a plain tensor is taken as replicated over the group: the half's first rank's values are the checkpoint's
    assert results == [[0.0, 1.0, 2.0, 3.0, 4.0]] * 2 + [[20.0, 21.0, 22.0, 23.0, 24.0]] * 2


def test_a_dtensor_with_a_partial_placement_is_refused(tmp_path) -> None:
    from spmd.tensor import Partial

    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        with pytest.raises(CheckpointError, match=r"'p' is a DTensor with a Partial placement"):
            dcp.save({"p": partial}, checkpoint_id=str(tmp_path))

    run_ranks(body, world_size=2, timeout=TIMEOUT)



def test_async_save_in_one_process_keeps_its_host_buffers_for_the_next(tmp_path) -> None:
    from spmd.checkpoint import api

    weight = torch.arange(6.0)
    dcp.async_save({"w": weight}, checkpoint_id=str(tmp_path / "a")).result(timeout=TIMEOUT)
    buffer = api._ALONE.buffers["w"]
    weight.mul_(2)
    second = dcp.async_save({"w": weight}, checkpoint_id=str(tmp_path / "b"))
    weight.add_(1)                                                   # after the call: not in the checkpoint
    second.result(timeout=TIMEOUT)
    assert api._ALONE.buffers["w"] is buffer
    state = {"w": torch.zeros(6)}
    dcp.load(state, checkpoint_id=str(tmp_path / "b"))
    assert torch.equal(state["w"], torch.arange(6.0) * 2)


def test_save_and_load_run_no_garbage_collection_and_restore_the_collectors_state(tmp_path) -> None:
    state = {"model": {f"layer{i}.w": torch.full((4,), float(i)) for i in range(2000)}, "step": 1}
    collections: list[int] = []
    inside: list[str] = []          # collections started within a save's or a load's work

    def record(phase: str, info: dict[str, int]) -> None:
        if phase != "start":
            return
        collections.append(info["generation"])
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == dcp_api.__file__ and frame.f_code.co_name in ("_plan", "_write_and_commit",
                                                                                          "run"):
                inside.append(frame.f_code.co_name)
            frame = frame.f_back

    gc.callbacks.append(record)
    try:
        dcp.save(state, checkpoint_id=str(tmp_path / "a"))
        dcp.load(state, checkpoint_id=str(tmp_path / "a"))
        during = list(inside)
        assert gc.isenabled()
        dcp.async_save(state, checkpoint_id=str(tmp_path / "b")).result()     # its writing thread may collect
        assert gc.isenabled()
        gc.disable()
        dcp.save(state, checkpoint_id=str(tmp_path / "c"))
        assert not gc.isenabled()         # the user's choice stays
    finally:
        gc.enable()
        gc.callbacks.remove(record)
    assert during == []
    assert collections, "the control: the test's own work between the calls collects"


def test_the_writer_takes_torchs_arguments_and_overwrite_false_keeps_a_checkpoint(tmp_path) -> None:
    """torchtune builds torch's FileSystemWriter(path, single_file_per_rank=False, thread_count=16)."""
    state = {"w": torch.arange(6.0), "step": 3}
    writer = dcp.FileSystemWriter(tmp_path, False, False, thread_count=16)     # torch's positional order
    assert writer.sync_files is False
    dcp.save(state, storage_writer=writer, no_dist=True)
    loaded = {"w": torch.zeros(6), "step": 0}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    with pytest.raises(CheckpointError, match="overwrite=False"):
        dcp.save({"w": torch.ones(6), "step": 4}, storage_writer=dcp.FileSystemWriter(tmp_path, overwrite=False),
                 no_dist=True)
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)          # the first checkpoint is still there
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    with pytest.raises(ValueError, match="thread_count must be a positive int"):
        dcp.FileSystemWriter(tmp_path, thread_count=0)


@pytest.mark.parametrize("storage", ["filesystem", "torch format", "hugging face", "fsspec"])
def test_a_storage_given_a_checkpoint_id_reads_and_writes_there_as_torchs_does(tmp_path, storage: str) -> None:
    """torch's save and load reset a storage object to their checkpoint_id: one writer (or reader) made once and
    used for every step's checkpoint must not put (or read) them all at the path it was made with."""
    from spmd.checkpoint.fsspec_storage import FsspecReader, FsspecWriter
    from spmd.checkpoint.torch_format import TorchCheckpointReader

    root = f"memory://spmd-tests/{tmp_path.name}" if storage == "fsspec" else str(tmp_path)
    writer = {"filesystem": dcp.FileSystemWriter, "torch format": dcp.TorchFormatWriter,
              "hugging face": dcp.HuggingFaceStorageWriter, "fsspec": FsspecWriter}[storage](f"{root}/made")
    reader = {"filesystem": FileSystemReader, "torch format": TorchCheckpointReader,
              "hugging face": dcp.HuggingFaceStorageReader, "fsspec": FsspecReader}[storage](f"{root}/made")
    for step in (1, 2):
        dcp.save({"w": torch.full((3, 2), float(step))}, checkpoint_id=f"{root}/step{step}", storage_writer=writer,
                 no_dist=True)
    if storage != "fsspec":
        assert not os.listdir(tmp_path / "made") and len(os.listdir(tmp_path / "step1")) >= 1
    for step in (2, 1):
        got = {"w": torch.zeros(3, 2)}
        dcp.load(got, checkpoint_id=f"{root}/step{step}", storage_reader=reader, no_dist=True)
        assert torch.equal(got["w"], torch.full((3, 2), float(step))), (storage, step)

"""spmd.checkpoint in real rank processes on the shm transport: FSDP2 on 2 processes saves and one plain process
loads it bit-exact (spmd's format, and Hugging Face's whole-tensor files both processes write into); a rank
SIGKILLed in the middle of writing its data file fails the save on the other rank (naming the lost peer) and
leaves the previous checkpoint loadable, and a killed save into a new directory is reported as incomplete."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import safetensors.torch
import torch

import spmd
import spmd.checkpoint as dcp
from spmd.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from tests.checkpoint.test_state_dict import adamw, build, train
from tests.comm.test_shm import _reap, _spawn


class _KilledMidWrite(dcp.FileSystemWriter):
    """Rank 1 writes part of its data file, then dies as kill -9 would kill it."""

    def write_file(self, name: str, parts: Any) -> int:
        if not name.startswith("__1_"):
            return super().write_file(name, parts)

        def first_then_die() -> Any:
            for index, part in enumerate(parts):
                if index == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield part

        return super().write_file(name, first_then_die())


def _worker(rank: int, world_size: int, results: Any, store: str, good: str, target: str) -> None:
    """Save `good`, train a step, then save to `target` while rank 1 gets killed."""
    torch.set_num_threads(1)
    spmd.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=30)
    try:
        model = _fsdp(world_size)
        optimizer = adamw(model)
        train(model, optimizer, range(2), rank, world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=good)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        dcp.save(model_sd, storage_writer=dcp.HuggingFaceStorageWriter(
            os.path.join(os.path.dirname(store), "hf"), {k: 1 + k.startswith("blocks.1.") for k in model_sd}))
        if rank == 0:
            results.send(("full", {k: v.clone() for k, v in full.items()}))
        train(model, optimizer, range(2, 3), rank, world_size)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_KilledMidWrite(target))
        except Exception as error:     # rank 0: the peer is gone
            results.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        if rank == 0:
            spmd.destroy_process_group()


def _fsdp(world_size: int) -> torch.nn.Module:
    from spmd.device_mesh import init_device_mesh
    from spmd.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["over the last checkpoint", "into a new directory"])
def test_kill_9_during_save_keeps_the_last_checkpoint_and_marks_the_new_one_incomplete(tmp_path, where: str) -> None:
    good = str(tmp_path / "good")
    target = good if where == "over the last checkpoint" else str(tmp_path / "new")
    processes, inbox = _spawn(_worker, 2, str(tmp_path / "store"), good, target)
    try:
        reports = dict(inbox.get(timeout=90) for _ in range(2))
    finally:
        _reap(processes)
    assert processes[1].exitcode == -signal.SIGKILL
    assert "PeerLostError" in reports["error"] and "rank 1" in reports["error"], reports["error"]
    plain = build(seed=5)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=good, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    hf = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        hf.update(safetensors.torch.load_file(str(tmp_path / "hf" / name)))
    assert hf.keys() == reports["full"].keys()
    for key, value in reports["full"].items():                 # the first save, whole, into one process
        assert torch.equal(state["model"][key], value) and torch.equal(hf[key], value), key
    if target != good:
        with pytest.raises(dcp.CheckpointError, match=r"is incomplete: it has no metadata.json, and \d+ data files"):
            dcp.load({"model": plain.state_dict()}, checkpoint_id=target)

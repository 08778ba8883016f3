"""A torch.save file loaded straight into a sharded model (format_utils.BroadcastingTorchSaveReader with
DynamicMetaLoadPlanner, see Note: loading a torch.save file): FSDP x TP on a 2 x 2 mesh of thread ranks gets the
file's values bit-exact, a bfloat16 file is cast to the model's dtype, a file that can't fill the state dict
fails on every rank with the same error (no rank left waiting in a broadcast); and in real processes FSDP2 gets
what torch's reader and planner give a plain model over gloo (torch's own, given FSDP2's DTensors, left its ranks
waiting: a torchrun of 2 ranks timed out after 60 s)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spmd
import spmd.checkpoint as dcp
from spmd.checkpoint.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
from spmd.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.testing import run_ranks
from tests.procpool import ProcPool, free_port
from tests.tensor.parallel.test_parity import fresh, fsdp_over_tp

TIMEOUT = 60.0


def _saved(path: pathlib.Path, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """A GPT's state dict, moved off its initial values, torch.save'd to `path`."""
    model = fresh("gpt")
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.add_(index / 10)
    state = {key: value.to(dtype) for key, value in model.state_dict().items()}
    torch.save(state, path)
    return state


def _full(state: dict[str, Any]) -> dict[str, Tensor]:
    return {key: value.full_tensor() if hasattr(value, "full_tensor") else value for key, value in state.items()}


def _load(model: nn.Module, path: pathlib.Path) -> dict[str, Tensor]:
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(),
             checkpoint_id=str(path))
    set_model_state_dict(model, state)
    return _full(get_model_state_dict(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_torch_save_file_loads_into_fsdp_over_tp(tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    path = tmp_path / "model.pt"
    saved = _saved(path, dtype)
    for loaded in run_ranks(lambda rank, size: _load(fsdp_over_tp(), path), 4, timeout=TIMEOUT):
        assert loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(loaded[key], value.float()), key


def test_a_file_that_cannot_fill_the_state_dict_fails_on_every_rank(tmp_path: pathlib.Path) -> None:
    saved = _saved(tmp_path / "model.pt")
    del saved["blocks.0.attn.q.weight"]
    torch.save(saved, tmp_path / "short.pt")
    saved["blocks.0.attn.q.weight"] = torch.zeros(3, 3)
    torch.save(saved, tmp_path / "reshaped.pt")
    torch.save([1, 2], tmp_path / "list.pt")

    def body(rank: int, size: int) -> list[str]:
        model, errors = fsdp_over_tp(), []
        for name in ("short.pt", "reshaped.pt", "list.pt", "missing.pt"):
            with pytest.raises(dcp.CheckpointError) as raised:
                _load(model, tmp_path / name)
            errors.append(str(raised.value))
        with pytest.raises(dcp.CheckpointError, match="DynamicMetaLoadPlanner loads tensors only; 'step' is a int"):
            dcp.load({"step": 3}, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(),
                     checkpoint_id=str(tmp_path / "model.pt"))
        with pytest.raises(dcp.CheckpointError, match=r"model\.pt has no 'embed\.weight'"):    # no index to plan
            dcp.load(get_model_state_dict(model), storage_reader=BroadcastingTorchSaveReader(),
                     checkpoint_id=str(tmp_path / "model.pt"))
        return errors

    per_rank = run_ranks(body, 4, timeout=TIMEOUT)
    assert all(errors == per_rank[0] for errors in per_rank)          # the coordinator's verdict, everywhere
    short, reshaped, listed, missing = per_rank[0]
    assert "short.pt has no tensor 'blocks.0.attn.q.weight'" in short
    assert "'blocks.0.attn.q.weight' [3, 3] (expected [32, 32])" in reshaped
    assert "holds no dict of tensors" in listed
    assert "missing.pt can't be read as a torch.save file: FileNotFoundError" in missing


def _both_libraries(rank: int, world_size: int, gloo_port: int, path: str) -> dict[str, dict[str, Tensor]]:
    import torch.distributed as tdist
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint import format_utils as torch_format_utils
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    spmd.init_process_group("shm", timeout=60, torch_default_group=False)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size)
    try:
        ours = fresh("gpt")
        mesh = init_device_mesh("cpu", (world_size,))
        for block in ours.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(ours, mesh=mesh)
        theirs = fresh("gpt")              # plain: torch's reader waits forever on FSDP2's DTensors
        state = torch_state_dict.get_model_state_dict(theirs)
        torch_dcp.load(state, storage_reader=torch_format_utils.BroadcastingTorchSaveReader(),
                       planner=torch_format_utils.DynamicMetaLoadPlanner(), checkpoint_id=path)
        torch_state_dict.set_model_state_dict(theirs, state)
        return {"spmd": _load(ours, pathlib.Path(path)),
                "torch": _full(torch_state_dict.get_model_state_dict(theirs))}
    finally:
        tdist.destroy_process_group()
        spmd.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_gets_what_torchs_reader_gives_a_plain_model(procpool: ProcPool, tmp_path: pathlib.Path) -> None:
    saved = _saved(tmp_path / "model.pt")
    for result in procpool.run(_both_libraries, 2, timeout=90, args=(free_port(), str(tmp_path / "model.pt"))):
        assert result["spmd"].keys() == result["torch"].keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(result["spmd"][key], value) and torch.equal(result["torch"][key], value), key

"""python -m spmd.checkpoint.convert: a checkpoint (saved under FSDP2 on 4 thread ranks) to one .safetensors or
torch.save file and back, bit-exact; the converted file loads into a plain torch model (and by the `safetensors`
library); bad paths are refused."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import safetensors.torch
import torch

import spmd.checkpoint as dcp
from spmd.checkpoint import convert
from spmd.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from spmd.testing import run_ranks
from tests.checkpoint.test_state_dict import WORLD, adamw, batch, build, parallelize, train


def save_trained(path: str, **save_options: Any) -> dict[str, torch.Tensor]:
    """A model and AdamW trained 2 steps under FSDP2 on 4 ranks, saved at `path` (with dcp.save's other
    `save_options`, a storage_writer say); returns the model's full state dict."""
    def save(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model, dp_rank, dp = parallelize("fsdp", build())
        optimizer = adamw(model)
        train(model, optimizer, range(2), dp_rank, dp)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": 2},
                 **(save_options or {"checkpoint_id": path}))
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    return run_ranks(save, world_size=WORLD["fsdp"], timeout=60)[0]


@pytest.fixture
def sharded(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """A checkpoint of a model and AdamW trained under FSDP2 on 4 ranks, and the model's full state dict."""
    path = str(tmp_path / "ckpt")
    return path, save_trained(path)


def test_a_checkpoint_becomes_a_file_a_plain_torch_model_loads(tmp_path, sharded) -> None:
    path, full = sharded
    target = str(tmp_path / "model.safetensors")
    subprocess.run([sys.executable, "-m", "spmd.checkpoint.convert", path, target, "--only", "model"], check=True,
                   timeout=120)
    plain = build(seed=3)
    plain.load_state_dict(safetensors.torch.load_file(target))     # strict: every key, nothing more
    for key, value in plain.state_dict().items():
        assert torch.equal(value, full[key]), key
    x, _ = batch(0)
    assert torch.isfinite(plain(x)).all()


def test_round_trips_through_safetensors_and_torch_save(tmp_path, sharded) -> None:
    path, _ = sharded
    original, _ = convert.load_full(path)
    for name in ("all.safetensors", "all.pt"):
        convert.dcp_to_file(path, tmp_path / name)
        convert.file_to_dcp(tmp_path / name, tmp_path / f"back-{name}")
        again, _ = convert.load_full(tmp_path / f"back-{name}")
        assert again.keys() == original.keys()
        for key, value in original.items():
            assert torch.equal(again[key], value) if isinstance(value, torch.Tensor) else again[key] == value, key
    nested = torch.load(tmp_path / "all.pt", weights_only=True)
    assert nested["step"] == 2 and set(nested["model"]) == set(build().state_dict())
    assert isinstance(nested["optim"]["param_groups"], list)


def test_bad_paths_are_refused(tmp_path, sharded) -> None:
    path, _ = sharded
    with pytest.raises(dcp.CheckpointError, match=r"name it .safetensors, .pt or .pth"):
        convert.dcp_to_file(path, tmp_path / "model.bin")
    with pytest.raises(dcp.CheckpointError, match=r"nothing in .* lies under 'weights'"):
        convert.load_full(path, only="weights")


def test_torchs_format_utils_names_convert_both_ways_into_a_checkpoint_that_reshards(tmp_path, sharded) -> None:
    from spmd.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    path, full = sharded
    saved = tmp_path / "state"                      # torch's functions take any file name
    dcp_to_torch_save(path, saved)
    state = torch.load(saved, weights_only=True)
    assert state["step"] == 2 and state["model"].keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(state["model"][key], value), key
    again = str(tmp_path / "again")
    torch_save_to_dcp(saved, again)

    def load(rank: int, world_size: int) -> dict[str, torch.Tensor]:       # resharded: tensor parallel on 2
        model, _, _ = parallelize("tp", build())
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, checkpoint_id=again)
        model.load_state_dict(model_sd)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    for key, value in run_ranks(load, world_size=WORLD["tp"], timeout=60)[0].items():
        assert torch.equal(value, full[key]), key

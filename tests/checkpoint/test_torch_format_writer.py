"""spmd's save in torch's DCP format (TorchFormatWriter) and `python -m spmd.checkpoint.convert` between the two
formats: a model and AdamW saved under FSDP2 on 4 thread ranks load with torch's own DCP into one process (through
torch's state-dict API, as a torch job resumes) equal to spmd's load of the same directory; torch's format_utils
read it nested; the index is the pickle torch's own writer makes for the same state; a save replaces an earlier
checkpoint of either format in its directory; and conversions both ways are bit-exact."""

from __future__ import annotations

import os
import pickle
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict

import spmd.checkpoint as dcp
from spmd.checkpoint import convert
from spmd.checkpoint.state_dict import get_state_dict, set_state_dict
from tests.checkpoint.test_convert import save_trained
from tests.checkpoint.test_state_dict import adamw, batch, build
from tests.checkpoint.test_torch_format import _assert_equal, _state, _zeros


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch's DCP warns that no process group is initialised
        yield


@pytest.fixture
def sharded(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """A model and AdamW trained under FSDP2 on 4 ranks, saved in torch's format; the model's full state dict."""
    path = str(tmp_path / "ckpt")
    return path, save_trained(path, storage_writer=dcp.TorchFormatWriter(path))


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, (dict, list)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return {key: value for name, item in items for key, value in _flat(item, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): tree}


def test_torchs_load_resumes_a_torch_job_as_spmds_load_does(sharded) -> None:
    path, full = sharded
    files = sorted(re.sub(r"_[0-9a-f]+\.distcp$", "", name) for name in os.listdir(path))
    assert files == [".metadata", "__0", "__1", "__2", "__3", "__values"]       # a data file per rank
    loaded = {}
    for side in ("torch", "spmd"):
        model = build(seed=7)
        optimizer = adamw(model)
        model(batch(5)[0]).sum().backward()
        optimizer.step()                        # every parameter has optimizer state to be overwritten
        if side == "torch":
            model_sd, optim_sd = torch_get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": 0}
            torch_dcp.load(state, checkpoint_id=path, no_dist=True)
            torch_set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": 0}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["step"] == 2
        loaded[side] = (model.state_dict(), _flat(optimizer.state_dict()))
    for key, value in full.items():
        assert torch.equal(loaded["torch"][0][key], value) and torch.equal(loaded["spmd"][0][key], value), key
    torch_optim, spmd_optim = loaded["torch"][1], loaded["spmd"][1]
    assert torch_optim.keys() == spmd_optim.keys() and any(key.endswith("exp_avg_sq") for key in torch_optim)
    for key, value in spmd_optim.items():
        assert torch.equal(torch_optim[key], value) if isinstance(value, torch.Tensor) else torch_optim[key] == value


def test_torchs_format_utils_read_it_nested(sharded, tmp_path) -> None:
    path, full = sharded
    dcp_to_torch_save(path, tmp_path / "all.pt")
    state = torch.load(tmp_path / "all.pt", weights_only=True)
    assert state["step"] == 2 and isinstance(state["optim"]["param_groups"], list)
    for key, value in full.items():
        assert torch.equal(state["model"][key], value), key


def test_the_index_is_the_pickle_torchs_writer_makes(tmp_path) -> None:
    saved = _state()
    torch_dcp.save(saved, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    dcp.save(saved, storage_writer=dcp.TorchFormatWriter(tmp_path / "spmd"), no_dist=True)
    indexes = {}
    for side in ("torch", "spmd"):
        with open(tmp_path / side / ".metadata", "rb") as file:
            indexes[side] = pickle.load(file)       # torch's own classes
    theirs, ours = indexes["torch"], indexes["spmd"]
    assert type(ours) is type(theirs) and ours.version == theirs.version
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert set(ours.storage_data) == set(theirs.storage_data)
    assert ours.storage_meta.save_id and os.fspath(ours.storage_meta.checkpoint_id) == str(tmp_path / "spmd")
    got = _zeros(saved)
    torch_dcp.load(got, checkpoint_id=str(tmp_path / "spmd"), no_dist=True)
    _assert_equal(got, saved)


def test_a_save_replaces_an_earlier_checkpoint_of_either_format_in_its_directory(tmp_path) -> None:
    path = str(tmp_path)
    first = {"w": torch.zeros(3, 4), "step": 1}
    second = {"w": torch.ones(3, 4), "step": 2}
    dcp.save(first, checkpoint_id=path, no_dist=True)
    dcp.save(second, storage_writer=dcp.TorchFormatWriter(path), no_dist=True)
    assert not [name for name in os.listdir(path) if name.endswith((".json", ".safetensors", ".partial"))]
    for load in (dcp.load, torch_dcp.load):
        got = {"w": torch.empty(3, 4), "step": 0}
        load(got, checkpoint_id=path, no_dist=True)
        assert torch.equal(got["w"], second["w"]) and got["step"] == 2
    dcp.save(first, checkpoint_id=path, no_dist=True)
    assert not [name for name in os.listdir(path) if name.endswith(".distcp")]
    got = {"w": torch.empty(3, 4), "step": 0}
    dcp.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["w"], first["w"]) and got["step"] == 1


def test_convert_rewrites_either_format_in_the_other_bit_exactly(sharded, tmp_path) -> None:
    path, _ = sharded
    original, _ = convert.load_full(path)
    convert.main([path, str(tmp_path / "spmd")])
    assert os.path.exists(tmp_path / "spmd" / "metadata.json")
    convert.main([str(tmp_path / "spmd"), str(tmp_path / "torch")])
    assert not os.path.exists(tmp_path / "torch" / "metadata.json")
    for converted in ("spmd", "torch"):
        again, _ = convert.load_full(tmp_path / converted)
        assert again.keys() == original.keys()
        for key, value in original.items():
            assert torch.equal(again[key], value) if isinstance(value, torch.Tensor) else again[key] == value, key
    with pytest.raises(SystemExit):
        convert.main([path, str(tmp_path / "other"), "--only", "model"])


def test_the_pickle_writer_round_trips_every_kind_of_value_the_index_holds() -> None:
    from spmd.checkpoint.torch_format_writer import _Pickle

    values = [0, 1, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 + 5, -(2**70), 1.5, -0.0, "héllo", "", (), (1,),
              [], [1, [2, (3,)]], {}, {"a": {"b": [None, True, False]}}, torch.Size([3, 4]), torch.bfloat16,
              torch.float8_e4m3fn]
    for value in values:
        got = pickle.loads(_Pickle().dump(value))
        assert got == value and type(got) is type(value), value
    with pytest.raises(TypeError, match="no pickle form for a object"):
        _Pickle().dump(object())

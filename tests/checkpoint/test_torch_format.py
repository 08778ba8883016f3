"""Checkpoints torch's DCP wrote load with spmd.checkpoint.load (picked for a directory holding torch's
`.metadata`): nested tensors of several dtypes and values, into plain tensors and into DTensor shards on a 2 x 2
mesh, equal to what was saved; a `.metadata` naming any global beyond torch's metadata records is refused without
running it. The porting test loads torch's own FSDP1-sharded tutorial checkpoint (tests/test_porting.py). Thread
ranks."""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Shard, distribute_tensor
from spmd.testing import run_ranks


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"embed": torch.randn(11, 6, generator=gen), "norm": torch.randn(6, generator=gen).bfloat16(),
                      "layers": [{"w": torch.randn(5, 7, generator=gen)}, {"w": torch.randn(5, 7, generator=gen)}]},
            "step": 12, "schedule": {"lr": 3e-4, "betas": (0.9, 0.95), "name": "cosine"}}


def _save_with_torch(path: str) -> dict[str, Any]:
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # torch warns that no process group is initialised
        torch_dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def _zeros(state: Any) -> Any:
    if isinstance(state, dict):
        return {key: _zeros(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_zeros(value) for value in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def _assert_equal(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_equal(got[key], want[key])
    elif isinstance(want, list):
        for item, expected in zip(got, want, strict=True):
            _assert_equal(item, expected)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert got == want


def test_a_torch_checkpoint_loads_into_plain_tensors(tmp_path) -> None:
    saved = _save_with_torch(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    state = _zeros(saved)
    dcp.load(state, checkpoint_id=str(tmp_path))
    _assert_equal(state, saved)


def test_a_torch_checkpoint_loads_into_shards_on_a_mesh(tmp_path) -> None:
    saved = _save_with_torch(str(tmp_path))

    def body(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        state = {"model": {"embed": distribute_tensor(torch.zeros(11, 6), mesh, [Shard(0), Shard(1)]),
                           "norm": distribute_tensor(torch.zeros(6, dtype=torch.bfloat16), mesh, [Shard(0), Shard(0)]),
                           "layers": [{"w": distribute_tensor(torch.zeros(5, 7), mesh, [Shard(1), Shard(0)])}
                                      for _ in range(2)]},
                 "step": 0, "schedule": {"lr": 0.0, "betas": None, "name": None}}
        dcp.load(state, checkpoint_id=str(tmp_path))
        model = state["model"]
        return {"embed": model["embed"].full_tensor(), "norm": model["norm"].full_tensor(),
                "w1": model["layers"][1]["w"].full_tensor(), "step": state["step"], "betas": state["schedule"]["betas"],
                "sharded": isinstance(model["embed"], DTensor)}

    for got in run_ranks(body, world_size=4, timeout=60):
        assert got["sharded"] and got["step"] == 12 and got["betas"] == (0.9, 0.95)
        for key, want in (("embed", saved["model"]["embed"]), ("norm", saved["model"]["norm"]),
                          ("w1", saved["model"]["layers"][1]["w"])):
            assert torch.equal(got[key], want), key


def _warmup(steps: int, step: int) -> float:
    return min(1.0, (step + 1) / steps)


def test_a_torch_checkpoint_of_an_lr_scheduler_with_empty_containers_loads(tmp_path) -> None:
    """LambdaLR's state holds `lr_lambdas: [{}]`, for which torch's DCP saves no key (TorchTitan's checkpoints)."""
    def scheduler() -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, 4))   # as TorchTitan

    saved = scheduler()
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save({"lr_scheduler": saved.state_dict(), "nothing": {"here": {}}}, checkpoint_id=str(tmp_path),
                       no_dist=True)
    loaded = scheduler()
    state = {"lr_scheduler": loaded.state_dict(), "nothing": {"here": {}}}
    assert state["lr_scheduler"]["lr_lambdas"] == [{}]
    dcp.load(state, checkpoint_id=str(tmp_path))
    loaded.load_state_dict(state["lr_scheduler"])
    assert loaded.last_epoch == saved.last_epoch == 3 and loaded.get_last_lr() == saved.get_last_lr()
    with pytest.raises(CheckpointError, match="has no 'missing'"):         # a real value still has to be there
        dcp.load({"missing": [{"lr": 1.0}]}, checkpoint_id=str(tmp_path))


class _Payload:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_metadata_file_with_foreign_globals_is_refused_without_running_them(tmp_path, monkeypatch) -> None:
    _save_with_torch(str(tmp_path))
    buffer = io.BytesIO()
    pickle.dump({"state_dict_metadata": _Payload()}, buffer)
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"\.metadata is not torch's checkpoint metadata \(posix.system is not "
                                              r"part of torch's checkpoint metadata\)"):
        dcp.load(_zeros(_state()), checkpoint_id=str(tmp_path))
    assert not (tmp_path / "pwned.txt").exists()

"""Compressed tensors in checkpoints (storage.py, Note: compressed tensors): a tensor subclass holding fewer bytes
than its values (tests/checkpoint/quantized_rows.py, shaped like torchao's 8-bit optimizer states) is stored as
itself, so a resume gets its codes and scales back bit for bit, where storing its values and quantizing them again
on load drifted; into another layout, another kind of tensor, through async saves and in torch's format; a
subclass holding all its values is stored as values; a class torch.load may not read is named."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Shard
from spmd.testing import run_ranks
from tests.checkpoint.quantized_rows import QuantizedRows
from tests.fsdp.gather_extensions import SplitPrecisionWeight

FULL = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3.0, 8)[:, None]


def _sharded(mesh, values: torch.Tensor) -> DTensor:
    local = QuantizedRows.quantize(values.chunk(mesh.size())[mesh.get_local_rank()])
    return DTensor.from_local(local, mesh, [Shard(0)])


def _empty_sharded(mesh) -> DTensor:
    rows = FULL.shape[0] // mesh.size()
    return DTensor.from_local(QuantizedRows(torch.zeros(rows, FULL.shape[1], dtype=torch.int8), torch.ones(rows, 1)),
                              mesh, [Shard(0)])


def test_a_sharded_compressed_state_resumes_bit_for_bit_and_reshards(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    whole = QuantizedRows.quantize(FULL)

    def save(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        dcp.save({"exp_avg": _sharded(mesh, FULL), "step": 3}, checkpoint_id=path)

    run_ranks(save, 2, timeout=60)
    index = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert {chunk.get("encoding") for chunk in index["tensors"]["exp_avg"]["chunks"]} == {"torch.save"}
    assert index["version"] == 2          # what an older spmd, which can't read such boxes, calls newer

    def load(rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (size,))
        state = {"exp_avg": _empty_sharded(mesh), "step": 0}
        dcp.load(state, checkpoint_id=path)
        local = state["exp_avg"]._local_tensor
        assert isinstance(local, QuantizedRows) and state["step"] == 3
        return local.codes, local.scales

    for size in (2, 4):             # the saved layout, and resharded: each rank's rows from one saved box
        for rank, (codes, scales) in enumerate(run_ranks(load, size, timeout=60)):
            assert torch.equal(codes, whole.codes.chunk(size)[rank])
            assert torch.equal(scales, whole.scales.chunk(size)[rank])
    plain = {"exp_avg": torch.zeros(8, 64), "step": 0}          # into a plain tensor: the values
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["exp_avg"], whole.dequantize())


def test_plain_compressed_tensors_through_async_saves_and_torchs_format(tmp_path) -> None:
    state = {"exp_avg_sq": QuantizedRows.quantize(FULL.abs())}

    def fresh() -> dict[str, torch.Tensor]:
        return {"exp_avg_sq": QuantizedRows(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1))}

    dcp.async_save(state, checkpoint_id=str(tmp_path / "async"), no_dist=True).result()
    dcp.save(state, storage_writer=dcp.TorchFormatWriter(tmp_path / "torch"), no_dist=True)
    for name, load in (("async", dcp.load), ("torch", dcp.load), ("torch", torch_dcp.load)):
        got = fresh()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # torch's load warns that no process group is initialised
            load(got, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert torch.equal(got["exp_avg_sq"].codes, state["exp_avg_sq"].codes), (name, load)
        assert torch.equal(got["exp_avg_sq"].scales, state["exp_avg_sq"].scales), (name, load)


def test_a_subclass_holding_all_its_values_is_stored_as_values(tmp_path) -> None:
    weight = SplitPrecisionWeight(FULL.clone())
    dcp.save({"weight": weight}, checkpoint_id=str(tmp_path), no_dist=True)
    index = json.loads((tmp_path / "metadata.json").read_text())
    assert "encoding" not in index["tensors"]["weight"]["chunks"][0] and index["version"] == 1
    got = {"weight": torch.zeros(8, 64)}
    dcp.load(got, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(got["weight"], FULL)


def test_a_stored_class_torch_load_may_not_read_is_named(tmp_path) -> None:
    dcp.save({"exp_avg": QuantizedRows.quantize(FULL)}, checkpoint_id=str(tmp_path), no_dist=True)
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(CheckpointError, match=r"of class tests\.checkpoint\.quantized_rows\.QuantizedRows, "
                                                  r"which torch\.load\(weights_only=True\) may not read"):
            dcp.load({"exp_avg": torch.zeros(8, 64)}, checkpoint_id=str(tmp_path), no_dist=True)
    finally:
        torch.serialization.add_safe_globals(allowed)

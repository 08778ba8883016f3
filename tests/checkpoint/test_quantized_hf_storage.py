"""QuantizedHuggingFaceStorageReader: a block-scaled float8 weight (DeepSeek V3's layout) and an MXFP4 one
(gpt-oss's) load dequantized into shards that cut across the scale blocks and groups, equal to what torch's own
QuantizedHuggingFaceStorageReader loads whole (for MXFP4 a reference dequantization, since torch's fills only an
eighth of that weight); plain tensors beside them load as usual; scales that don't cover the weight and a sharded
quantized weight are refused. Thread ranks."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as torch_dcp

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Shard, distribute_tensor
from spmd.testing import run_ranks

TIMEOUT = 60.0
BLOCK = 4


def _quantized(path: str) -> dict[str, torch.Tensor]:
    """A release of three tensors in two files with their index: a float8 weight [10, 13] in blocks of 4 (scales
    [3, 4]), MXFP4 blocks [2, 3, 5, 4] (40 values per row) with their exponents, and a plain norm weight."""
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "layers.0.proj.weight": (torch.randn(10, 13, generator=gen) * 3).to(torch.float8_e4m3fn),
        "layers.0.proj.weight_scale_inv": torch.rand(3, 4, generator=gen) + 0.5,
        "layers.0.experts.gate_up_proj_blocks": torch.randint(0, 256, (2, 3, 5, 4), generator=gen, dtype=torch.uint8),
        "layers.0.experts.gate_up_proj_scales": torch.randint(120, 135, (2, 3, 5), generator=gen, dtype=torch.uint8),
        "norm.weight": torch.randn(7, generator=gen).bfloat16(),
    }
    os.makedirs(path, exist_ok=True)
    first = ["layers.0.proj.weight", "layers.0.proj.weight_scale_inv", "norm.weight"]
    safetensors.torch.save_file({k: tensors[k] for k in first}, os.path.join(path, "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({k: v for k, v in tensors.items() if k not in first},
                                os.path.join(path, "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if k in first else 2}-of-00002.safetensors" for k in tensors}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as index:
        json.dump({"metadata": {}, "weight_map": weight_map}, index)
    return tensors


SHAPES = {"layers.0.proj.weight": (10, 13), "layers.0.experts.gate_up_proj_blocks": (2, 3, 40), "norm.weight": (7,)}


def _torchs(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """What torch's reader loads. Its MXFP4 path fills only the first 5 values of each row of 40 (torch 2.13: the
    saved box keeps the packed shape, so its planner reads a [2, 3, 5] region), so that weight's oracle is
    _mxfp4_reference, and torch's values are compared where it reads."""
    state = {key: torch.zeros(shape, dtype=dtype) for key, shape in SHAPES.items()}
    torch_dcp.load(state, storage_reader=torch_dcp.QuantizedHuggingFaceStorageReader(
        path, block_size=BLOCK, target_dtype=dtype), no_dist=True)
    return state


def _mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's definition: byte b of a group holds values 2b (low nibble) and 2b + 1 (high), e2m1 codes, the
    group's values times 2 ** (its scale - 127)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], -1).long()
    magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes & 7]
    values = torch.where(codes >= 8, -magnitude, magnitude).to(dtype)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.reshape(*blocks.shape[:-2], -1)


def _want(tensors: dict[str, torch.Tensor], path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    want = _torchs(path, dtype)
    mxfp4 = "layers.0.experts.gate_up_proj_blocks"
    whole = _mxfp4_reference(tensors[mxfp4], tensors["layers.0.experts.gate_up_proj_scales"], dtype)
    assert torch.equal(want[mxfp4][..., :5], whole[..., :5]) and not want[mxfp4][..., 5:].any()
    want[mxfp4] = whole
    return want


@pytest.mark.parametrize("dims", [(0, 1, 2), (1, 2, 0)])
def test_quantized_weights_load_dequantized_into_shards_as_torchs_reader_loads_them(tmp_path, dims) -> None:
    want = _want(_quantized(str(tmp_path)), str(tmp_path), torch.float32)

    def body(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (3,))
        state = {key: distribute_tensor(torch.zeros(shape), mesh, [Shard(min(dim, len(shape) - 1))])
                 for (key, shape), dim in zip(SHAPES.items(), dims, strict=True)}
        dcp.load(state, storage_reader=dcp.QuantizedHuggingFaceStorageReader(str(tmp_path), block_size=BLOCK))
        return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}

    for got in run_ranks(body, world_size=3, timeout=TIMEOUT):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_dequantizing_to_bfloat16_matches_torch(tmp_path) -> None:
    want = _want(_quantized(str(tmp_path)), str(tmp_path), torch.bfloat16)
    got = {key: torch.zeros(shape, dtype=torch.bfloat16) for key, shape in SHAPES.items()}
    dcp.load(got, storage_reader=dcp.QuantizedHuggingFaceStorageReader(str(tmp_path), block_size=BLOCK,
                                                                       target_dtype=torch.bfloat16))
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_scales_that_dont_cover_the_weight_and_sharded_quantized_files_are_refused(tmp_path) -> None:
    _quantized(str(tmp_path / "release"))
    state = {"layers.0.proj.weight": torch.zeros(10, 13)}
    with pytest.raises(CheckpointError, match=r"the scales \(\[3, 4\]\) don't cover a weight of \[10, 13\] in blocks "
                                              r"of 3; pass the block_size it was quantized with"):
        dcp.load(state, storage_reader=dcp.QuantizedHuggingFaceStorageReader(str(tmp_path / "release"), block_size=3))
    sharded = str(tmp_path / "sharded")
    run_ranks(lambda rank, world_size: dcp.save(
        {"w.weight": distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)]),
         "w.weight_scale_inv": torch.ones(1, 1)},
        storage_writer=dcp.HuggingFaceStorageWriter(sharded, save_distributed=True)), world_size=2, timeout=TIMEOUT)
    with pytest.raises(CheckpointError, match=r"the quantized 'w.weight' and its scales must each be whole in one "
                                              r"file"):
        dcp.load({"w.weight": torch.zeros(4, 4)}, storage_reader=dcp.QuantizedHuggingFaceStorageReader(sharded))

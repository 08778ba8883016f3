"""Hugging Face checkpoints: HuggingFaceStorageWriter writes a sharded state dict (any mesh, any placement, any
dtype) as whole-tensor model-*.safetensors files and their index, which safetensors and torch's own
HuggingFaceStorageReader load; HuggingFaceStorageReader loads the Hub's layouts (one file, an index over several,
torch's sharded files) and torch's writer's output into any layout, casting dtypes; a trained model's state dict
goes through HF files from FSDP to TP bit-exact; torch's sharded files consolidate into the same bytes the writer
writes whole. Bad input (values, unmapped keys, a path a rank can't see,
duplicate tensors) raises on every rank naming it, and leaves the last checkpoint. Thread ranks."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files as torch_consolidate,
)

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from spmd.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor
from spmd.testing import run_ranks
from tests.checkpoint.test_state_dict import WORLD, build, parallelize

TIMEOUT = 60.0
INDEX = "model.safetensors.index.json"
MAPPING = {"embed": 1, "w_cols": 1, "w_both": 2, "bias": 2, "steps": 2, "scalar": 2, "empty": 1}


def _full() -> dict[str, torch.Tensor]:
    """Whole tensors of several dtypes and shapes, uneven over 2 and 4 ranks."""
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(11, 6, generator=gen), "w_cols": torch.randn(5, 7, generator=gen).bfloat16(),
            "w_both": torch.randn(6, 9, 3, generator=gen).half(), "bias": torch.randn(5, generator=gen),
            "steps": torch.arange(13, dtype=torch.int64), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}


_PLACEMENTS = {"embed": [Shard(0), Replicate()], "w_cols": [Replicate(), Shard(1)],
               "w_both": [Shard(0), Shard(1)], "bias": [Shard(0), Shard(0)]}


def _sharded(full: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """`full` on a 2 x 2 mesh (plain tensors for the rest), cast to `dtype` if given."""
    mesh = init_device_mesh("cpu", (2, 2))
    return {key: distribute_tensor(value if dtype is None else value.to(dtype), mesh, _PLACEMENTS[key])
            if key in _PLACEMENTS else (value if dtype is None or not value.is_floating_point() else value.to(dtype))
            for key, value in full.items()}


def _gathered(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def _files(path: str) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            loaded.update(safetensors.torch.load_file(os.path.join(path, name)))
    return loaded


def test_a_sharded_state_dict_saves_whole_tensors_that_safetensors_loads(tmp_path) -> None:
    full = _full()

    def body(rank: int, world_size: int) -> None:
        dcp.save(_sharded(full), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), MAPPING))

    run_ranks(body, world_size=4, timeout=TIMEOUT)
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                            INDEX]
    loaded = _files(str(tmp_path))
    assert loaded.keys() == full.keys()
    for key, value in full.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["weight_map"] == {key: f"model-0000{i}-of-00002.safetensors" for key, i in MAPPING.items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    with safetensors.safe_open(str(tmp_path / "model-00001-of-00002.safetensors"), "pt") as opened:
        assert opened.metadata() == {"format": "pt"}


def test_torchs_reader_loads_spmds_files_and_spmds_reader_loads_torchs(tmp_path) -> None:
    full = _full()
    ours, theirs = str(tmp_path / "spmd"), str(tmp_path / "torch")
    run_ranks(lambda rank, world_size: dcp.save(_sharded(full), storage_writer=dcp.HuggingFaceStorageWriter(ours)),
              world_size=4, timeout=TIMEOUT)
    supported = {k: v for k, v in full.items() if k not in ("scalar", "empty")}   # torch's reader fails on these
    into = {key: torch.zeros_like(value) for key, value in supported.items()}
    torch_dcp.load(into, storage_reader=torch_dcp.HuggingFaceStorageReader(ours), no_dist=True)
    for key, value in supported.items():
        assert torch.equal(into[key], value), key

    torch_dcp.save(supported, storage_writer=torch_dcp.HuggingFaceStorageWriter(theirs, MAPPING), no_dist=True)

    def body(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in _sharded({k: torch.zeros_like(v) for k, v in full.items()}).items()
                 if k in supported}
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(theirs))
        return _gathered(state)

    for got in run_ranks(body, world_size=4, timeout=TIMEOUT):
        for key, value in supported.items():
            assert torch.equal(got[key], value), key


def test_the_hubs_layouts_load_into_shards_cast_to_the_state_dicts_dtypes(tmp_path) -> None:
    full = {k: v for k, v in _full().items() if v.is_floating_point()}
    single, indexed = tmp_path / "single", tmp_path / "indexed"
    single.mkdir()
    indexed.mkdir()
    safetensors.torch.save_file({k: v.bfloat16() for k, v in full.items()}, str(single / "model.safetensors"),
                                metadata={"format": "pt"})
    first = {k: full[k] for k in ("embed", "w_cols")}
    safetensors.torch.save_file(first, str(indexed / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({k: v for k, v in full.items() if k not in first},
                                str(indexed / "model-00002-of-00002.safetensors"))
    (indexed / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f"model-0000{1 if k in first else 2}-of-00002.safetensors" for k in full}}))
    # a file the index does not name (a consolidated copy beside the Hub's shards) is not read
    safetensors.torch.save_file({"embed": torch.ones(11, 6)}, str(indexed / "consolidated.safetensors"))

    def body(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        loaded = []
        for path in (single, indexed):
            state = _sharded({k: torch.zeros(v.shape) for k, v in full.items()}, torch.float32)
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
            loaded.append(_gathered(state))
        return loaded

    from_single, from_indexed = run_ranks(body, world_size=4, timeout=TIMEOUT)[0]
    for key, value in full.items():
        assert from_single[key].dtype == torch.float32 and torch.equal(from_single[key], value.bfloat16().float())
        assert torch.equal(from_indexed[key], value.float()), key


def test_save_distributed_writes_torchs_sharded_files_which_both_readers_load(tmp_path) -> None:
    full = _full()

    def save(rank: int, world_size: int) -> None:
        dcp.save(_sharded(full), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), MAPPING,
                                                                                save_distributed=True))

    run_ranks(save, world_size=4, timeout=TIMEOUT)
    names = sorted(os.listdir(tmp_path))
    assert INDEX not in names and all(n.startswith("shard-0000") for n in names)
    with safetensors.safe_open(str(tmp_path / "shard-00004-model-00002-of-00002.safetensors"), "pt") as opened:
        info = json.loads(opened.metadata()["DCP_SHARDING_INFO"])
    assert info["w_both"]["saved_offsets"] == [3, 5, 0]            # rank 3 holds the box at rows 3.., columns 5..
    supported = {k: v for k, v in full.items() if k not in ("scalar", "empty")}
    into = {key: torch.zeros_like(value) for key, value in supported.items()}
    torch_dcp.load(into, storage_reader=torch_dcp.HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    for key, value in supported.items():
        assert torch.equal(into[key], value), key

    def load(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2,))
        state = {key: distribute_tensor(torch.zeros_like(value), mesh, [Shard(value.dim() - 1)])
                 if value.dim() else torch.zeros_like(value) for key, value in full.items()}
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
        return _gathered(state)

    got = run_ranks(load, world_size=2, timeout=TIMEOUT)[1]
    for key, value in full.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("source, target", [("fsdp", "tp"), ("tp", "fsdp_tp")])
def test_a_trained_model_goes_through_hf_files_bit_exact_into_another_layout(tmp_path, source: str,
                                                                            target: str) -> None:
    full_options = StateDictOptions(full_state_dict=True)

    def save(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model, _, _ = parallelize(source, build())
        dcp.save(get_model_state_dict(model), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)))
        return {k: v.clone() for k, v in get_model_state_dict(model, options=full_options).items()}

    want = run_ranks(save, world_size=WORLD[source], timeout=TIMEOUT)[0]
    assert _files(str(tmp_path)).keys() == want.keys()

    def load(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model, _, _ = parallelize(target, build(seed=1))
        state = get_model_state_dict(model)
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
        set_model_state_dict(model, state)
        return get_model_state_dict(model, options=full_options)

    got = run_ranks(load, world_size=WORLD[target], timeout=TIMEOUT)[0]
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_a_smaller_save_replaces_the_files_of_a_larger_one(tmp_path) -> None:
    full = _full()
    dcp.save(full, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), MAPPING), no_dist=True)
    dcp.save({"bias": full["bias"]}, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00001.safetensors", INDEX]
    state = {"bias": torch.zeros(5)}
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    assert torch.equal(state["bias"], full["bias"])


@pytest.mark.parametrize("state, writer_args, says", [
    ({"w": torch.ones(2), "step": 3}, {}, r"'step' is not a tensor; a Hugging Face checkpoint holds tensors only"),
    ({"w": torch.ones(2), "v": torch.ones(2)}, {"fqn_to_index_mapping": {"w": 1}},
     r"fqn_to_index_mapping has no file for 'v'"),
])
def test_what_a_hf_checkpoint_cant_hold_raises_on_every_rank_and_leaves_the_last(tmp_path, state, writer_args,
                                                                                 says) -> None:
    dcp.save({"w": torch.full((2,), 7.0)}, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path)), no_dist=True)
    before = sorted(os.listdir(tmp_path))

    def body(rank: int, world_size: int) -> str:
        with pytest.raises(CheckpointError, match=says) as raised:
            dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), **writer_args))
        return str(raised.value)

    assert len(set(run_ranks(body, world_size=2, timeout=TIMEOUT))) == 1
    assert sorted(os.listdir(tmp_path)) == before
    assert torch.equal(_files(str(tmp_path))["w"], torch.full((2,), 7.0))


def test_a_rank_that_cant_see_the_coordinators_files_says_so(tmp_path) -> None:
    def body(rank: int, world_size: int) -> str:
        mesh = init_device_mesh("cpu", (2,))
        state = {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
        with pytest.raises(CheckpointError) as raised:
            dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / f"host{rank}")))
        return str(raised.value)

    message = run_ranks(body, world_size=2, timeout=TIMEOUT)[0]
    assert "rank 1 could not write its data file" in message and "rank 1 can't see" in message
    assert "needs a path every rank shares" in message
    assert not (tmp_path / "host0" / INDEX).exists()


def test_unreadable_hf_directories_raise_naming_the_problem(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"is not a Hugging Face checkpoint: it has no .safetensors files"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=dcp.HuggingFaceStorageReader(str(empty)))
    twice = tmp_path / "twice"
    twice.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        safetensors.torch.save_file({"w": torch.ones(2)}, str(twice / name))
    with pytest.raises(CheckpointError, match=r"'w' at \[0\] is in both a.safetensors and b.safetensors"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=dcp.HuggingFaceStorageReader(str(twice)))
    one = tmp_path / "one"
    one.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, str(one / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'w' was saved as torch.float32 of shape \[2\], but the state dict "
                                              r"holds torch.float32 of shape \[3\]"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=dcp.HuggingFaceStorageReader(str(one)))


def test_async_save_writes_the_same_files(tmp_path) -> None:
    full = _full()

    def body(rank: int, world_size: int) -> None:
        state = _sharded({key: value.clone() for key, value in full.items()})
        future = dcp.async_save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), MAPPING))
        for value in state.values():            # training goes on: the staged copy is what is written
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
        future.result()

    run_ranks(body, world_size=4, timeout=TIMEOUT)
    loaded = _files(str(tmp_path))
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key


def _save_sharded(path: str) -> None:
    run_ranks(lambda rank, world_size: dcp.save(_sharded(_full()), storage_writer=dcp.HuggingFaceStorageWriter(
        path, MAPPING, save_distributed=True)), world_size=4, timeout=TIMEOUT)


def test_consolidating_sharded_files_on_every_rank_gives_the_whole_files_byte_for_byte(tmp_path) -> None:
    sharded, out, direct = str(tmp_path / "sharded"), str(tmp_path / "out"), str(tmp_path / "direct")
    _save_sharded(sharded)
    run_ranks(lambda rank, world_size: dcp.save(_sharded(_full()), storage_writer=dcp.HuggingFaceStorageWriter(
        direct, MAPPING)), world_size=4, timeout=TIMEOUT)
    run_ranks(lambda rank, world_size: consolidate_safetensors_files_on_every_rank(sharded, out, MAPPING, 2),
              world_size=3, timeout=TIMEOUT)
    assert sorted(os.listdir(out)) == sorted(os.listdir(direct))
    for name in os.listdir(out):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name
    theirs = str(tmp_path / "torch")
    os.mkdir(theirs)
    # torch's consolidation fails on integer tensors (torch.finfo) and 0-d ones
    torch_consolidate(sharded, theirs, {k: v for k, v in MAPPING.items() if k not in ("scalar", "empty", "steps")})
    loaded, want = _files(theirs), _files(out)
    assert loaded.keys() == want.keys() - {"scalar", "empty", "steps"}
    for key, value in loaded.items():
        assert torch.equal(value, want[key]), key


def test_consolidating_without_a_ranks_shards_raises_on_every_rank(tmp_path) -> None:
    sharded = tmp_path / "sharded"
    _save_sharded(str(sharded))
    (sharded / "shard-00004-model-00002-of-00002.safetensors").unlink()
    consolidate_safetensors_files(str(sharded), str(tmp_path / "one"), {"embed": 1})      # not the lost rank's

    # the lost rank wrote a piece of w_both and, chosen as torch's dedup chooses, the replicated scalar
    wanted = {key: index for key, index in MAPPING.items() if key != "scalar"}

    def body(rank: int, world_size: int) -> str:
        with pytest.raises(CheckpointError, match=r"the shards of 'w_both' don't cover its shape \[6, 9, 3\]") as got:
            consolidate_safetensors_files_on_every_rank(str(sharded), str(tmp_path / "out"), wanted)
        return str(got.value)

    assert len(set(run_ranks(body, world_size=2, timeout=TIMEOUT))) == 1
    assert not (tmp_path / "out" / INDEX).exists()
    assert torch.equal(_files(str(tmp_path / "one"))["embed"], _full()["embed"])


_go = threading.Event()


class _HeldWriter(dcp.HuggingFaceStorageWriter):
    """Writes only once the next save has laid out its files."""

    def write_boxes(self, *args: Any) -> Any:
        _go.wait(TIMEOUT)
        return super().write_boxes(*args)


class _ReleasingWriter(dcp.HuggingFaceStorageWriter):
    def prepare_global_plan(self, plans: list) -> list:
        plans = super().prepare_global_plan(plans)
        _go.set()
        return plans


def test_a_save_finishing_while_the_next_one_is_laid_out_leaves_the_next_ones_files(tmp_path) -> None:
    _go.clear()
    first = dcp.async_save({"w": torch.zeros(3)}, storage_writer=_HeldWriter(str(tmp_path)), no_dist=True)
    second = dcp.async_save({"w": torch.ones(3)}, storage_writer=_ReleasingWriter(str(tmp_path)), no_dist=True)
    first.result()
    second.result()
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00001.safetensors", INDEX]
    assert torch.equal(_files(str(tmp_path))["w"], torch.ones(3))

"""Custom planners, as torch's DCP documents them: subclasses of DefaultSavePlanner / DefaultLoadPlanner that
rename keys, save in float16, add bytes of their own, rebalance the global plan, or build the state dict from
the metadata. The same planner code, subclassing torch's planner or spmd's, saves the same keys, dtypes and boxes
and loads the same values (one process). A planner that raises on one rank makes every rank raise, naming it,
and leaves the last checkpoint as it was. Thread ranks."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import spmd.checkpoint as dcp
from spmd._core.errors import CheckpointError
from spmd.checkpoint.default_planner import create_default_local_save_plan
from spmd.checkpoint.metadata import METADATA_FILE, MetadataIndex
from spmd.checkpoint.planner import LoadItemType, WriteItemType
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks

TIMEOUT = 60.0


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.linspace(-1, 1, 4)}, "step": 7}


def _fresh() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0}


# -- the planners of torch's documentation, written once over either library's planner classes -------------------

def _rename_planners(module: Any) -> tuple[type, type]:
    """torch's RenamePlanner examples: keys saved with a prefix, and loaded back through it."""

    class RenameSave(module.DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, storage_meta, is_coordinator)

    class RenameLoad(module.DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.unprefixed = state_dict
            super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, metadata, is_coordinator)

        def load_bytes(self, read_item, value):
            super().load_bytes(read_item, value)        # into the prefixed dict
            for key, loaded in self.original_state_dict.items():
                self.unprefixed[key[len("foo_"):]] = loaded

    return RenameSave, RenameLoad


def _fp16_planner(module: Any) -> type:
    """torch's FP16Planner example: every tensor saved as float16."""

    class FP16Planner(module.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            for position, item in enumerate(plan.items):
                if item.tensor_data is not None:
                    data = dataclasses.replace(item.tensor_data, properties=dataclasses.replace(
                        item.tensor_data.properties, dtype=torch.float16))
                    plan.items[position] = dataclasses.replace(item, tensor_data=data)
            return plan

        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            return data.to(torch.float16) if write_item.tensor_data is not None else data

    return FP16Planner


def test_the_same_planner_code_over_torchs_classes_and_spmds_saves_the_same_checkpoint(tmp_path) -> None:
    for name, planner_of in [("rename", lambda m: _rename_planners(m)[0]()), ("fp16", lambda m: _fp16_planner(m)())]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)         # torch: no process group, so no_dist
            torch_dcp.save(_state(), checkpoint_id=str(tmp_path / f"torch_{name}"), planner=planner_of(torch_dcp))
        ours = dcp.save(_state(), checkpoint_id=str(tmp_path / f"spmd_{name}"), planner=planner_of(dcp))
        theirs = torch_dcp.FileSystemReader(str(tmp_path / f"torch_{name}")).read_metadata().state_dict_metadata
        mine = ours.state_dict_metadata
        assert sorted(mine) == sorted(theirs)
        for key, storage in theirs.items():
            if isinstance(storage, torch_dcp.TensorStorageMetadata):
                assert mine[key].properties.dtype == storage.properties.dtype and mine[key].size == storage.size
                boxes = [(c.offsets, c.sizes) for c in storage.chunks]
                assert [(c.offsets, c.sizes) for c in mine[key].chunks] == boxes
            else:
                assert isinstance(mine[key], dcp.BytesStorageMetadata)


def test_a_renaming_planner_pair_round_trips_through_the_prefixed_keys(tmp_path) -> None:
    save_planner, load_planner = _rename_planners(dcp)
    metadata = dcp.save(_state(), checkpoint_id=str(tmp_path), planner=save_planner())
    assert set(metadata.tensors) == {"foo_model.w", "foo_model.b"} and metadata.values == {"foo_step": 7}
    assert metadata.planner_data["foo_model.w"] == ("foo_model", "w")
    state = _fresh()
    dcp.load(state, checkpoint_id=str(tmp_path), planner=load_planner())
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["step"] == 7
    with pytest.raises(CheckpointError, match=r"has no 'model.w', 'model.b', 'step'"):
        dcp.load(_fresh(), checkpoint_id=str(tmp_path))           # the default planner looks for the plain keys


class _CastingLoad(dcp.DefaultLoadPlanner):
    """Loads a float16 checkpoint into float32 tensors: each region lands in a float16 buffer (resolve_tensor)
    and is copied into the real tensor on commit_tensor."""

    def create_local_plan(self):
        held = self.state_dict
        self.state_dict = {k: v.to(torch.float16) if isinstance(v, torch.Tensor) else v for k, v in held.items()}
        try:
            return super().create_local_plan()
        finally:
            self.targets, self.state_dict = held, held

    def resolve_tensor(self, read_item):
        return torch.empty(read_item.lengths, dtype=torch.float16)

    def commit_tensor(self, read_item, tensor):
        self.transform_tensor(read_item, self.targets[read_item.dest_index.fqn]).copy_(tensor)


def test_a_float16_save_loads_into_float16_and_through_resolve_and_commit_into_float32(tmp_path) -> None:
    values = {"w": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}
    metadata = dcp.save(values, checkpoint_id=str(tmp_path), planner=_fp16_planner(dcp)())
    assert metadata.tensors["w"].dtype == "F16"
    half = {"w": torch.zeros(4, 8, dtype=torch.float16)}
    dcp.load(half, checkpoint_id=str(tmp_path))
    assert torch.equal(half["w"], values["w"].half())
    with pytest.raises(CheckpointError, match=r"'w' was saved as torch.float16 of shape \[4, 8\], but the state dict "
                                              r"holds torch.float32"):
        dcp.load({"w": torch.zeros(4, 8)}, checkpoint_id=str(tmp_path))
    full = {"w": torch.zeros(4, 8)}
    dcp.load(full, checkpoint_id=str(tmp_path), planner=_CastingLoad())
    assert torch.equal(full["w"], values["w"].half().float())


class _ExtraBytesSave(dcp.DefaultSavePlanner):
    """torch's SaveExtraDataPlanner example: the coordinator adds an item of raw bytes of its own."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        if self.is_coordinator:
            plan = dataclasses.replace(plan, items=[*plan.items, dcp.WriteItem(MetadataIndex("extra"),
                                                                               WriteItemType.BYTE_IO)])
        return plan

    def resolve_data(self, write_item):
        if write_item.index.fqn == "extra":
            return io.BytesIO(b"\x00raw\xffbytes")
        return super().resolve_data(write_item)


class _ExtraBytesLoad(dcp.DefaultLoadPlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        index = MetadataIndex("extra")
        plan.items.append(dcp.ReadItem(LoadItemType.BYTE_IO, index, torch.Size(), index, torch.Size(), torch.Size()))
        return plan

    def load_bytes(self, read_item, value):
        if read_item.dest_index.fqn == "extra":
            self.extra = value.getvalue()
        else:
            super().load_bytes(read_item, value)


def test_a_planners_own_bytes_are_kept_as_they_are_for_its_load_planner(tmp_path) -> None:
    mesh_path = str(tmp_path / "ckpt")

    def body(rank: int, world_size: int) -> bytes:
        mesh = init_device_mesh("cpu", (2,))
        dcp.save({"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]), "step": 3}, checkpoint_id=mesh_path,
                 planner=_ExtraBytesSave())
        loader, state = _ExtraBytesLoad(), {"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)]), "step": 0}
        dcp.load(state, checkpoint_id=mesh_path, planner=loader)
        assert torch.equal(state["w"].full_tensor(), torch.arange(8.0)) and state["step"] == 3
        return loader.extra

    assert run_ranks(body, world_size=2, timeout=TIMEOUT) == [b"\x00raw\xffbytes"] * 2
    assert "extra" in json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())["blobs"]
    with pytest.raises(CheckpointError, match=r"'extra' was saved as bytes of a custom save planner's own"):
        dcp.load({"extra": None}, checkpoint_id=mesh_path)


class _LastRankWritesAll(dcp.DefaultSavePlanner):
    """A global plan of the coordinator's own: every item (all ranks hold all keys) goes to the last rank."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        everything = [item for plan in plans for item in plan.items]
        last = dataclasses.replace(plans[-1], items=everything)
        return [dataclasses.replace(p, items=[]) for p in plans[:-1]] + [last], metadata


def test_the_coordinators_global_plan_decides_who_writes(tmp_path) -> None:
    path = str(tmp_path / "ckpt")

    def body(rank: int, world_size: int) -> None:
        dcp.save({"w": torch.full((4,), float(rank)), "plain": torch.full((4,), 5.0), "n": 1}, checkpoint_id=path,
                 planner=_LastRankWritesAll())

    run_ranks(body, world_size=3, timeout=TIMEOUT)
    metadata = json.loads((tmp_path / "ckpt" / METADATA_FILE).read_text())
    assert {c["file"] for entry in metadata["tensors"].values() for c in entry["chunks"]} == \
        {f"__2_{metadata['save_id']}.safetensors"}
    state = {"w": torch.zeros(4), "plain": torch.zeros(4), "n": 0}
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(state["w"], torch.full((4,), 2.0)) and state["n"] == 1


class _EmptyStateDictLoad(dcp.DefaultLoadPlanner):
    """torch's _EmptyStateDictLoadPlanner idea: the state dict built from the metadata, no model needed."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        for key, storage in metadata.state_dict_metadata.items():
            if isinstance(storage, dcp.TensorStorageMetadata):
                state_dict[key] = torch.empty(storage.size, dtype=storage.properties.dtype)
            else:
                state_dict[key] = None
        super().set_up_planner(state_dict, metadata, is_coordinator)


def test_a_load_planner_can_build_the_state_dict_from_the_metadata(tmp_path) -> None:
    path = str(tmp_path / "ckpt")

    def body(rank: int, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (2,))
        dcp.save({"w": distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)]), "tag": "run"},
                 checkpoint_id=path)

    run_ranks(body, world_size=2, timeout=TIMEOUT)
    state: dict[str, Any] = {}
    dcp.load(state, checkpoint_id=path, planner=_EmptyStateDictLoad(flatten_state_dict=False))
    assert torch.equal(state["w"], torch.arange(12.0).reshape(6, 2)) and state["tag"] == "run"


class _FailingPlanner(dcp.DefaultSavePlanner):
    def __init__(self, step: str, rank: int) -> None:
        super().__init__()
        self.step, self.rank = step, rank

    def create_local_plan(self):
        if self.step == "local" and self.rank == 1:
            raise RuntimeError("no plan today")
        return super().create_local_plan()

    def create_global_plan(self, all_plans):
        if self.step == "global":
            raise RuntimeError("no global plan today")
        return super().create_global_plan(all_plans)

    def resolve_data(self, write_item):
        if self.step == "resolve" and self.rank == 1:
            return torch.zeros(1)
        return super().resolve_data(write_item)


@pytest.mark.parametrize("step, says", [
    ("local", r"rank 1's _FailingPlanner could not plan: RuntimeError: no plan today"),
    ("global", r"rank 0's _FailingPlanner could not make the global plan: RuntimeError: no global plan today"),
    ("resolve", r"rank 1's _FailingPlanner could not resolve its data: CheckpointError: resolve_data gave "
                r"torch.float32 of shape \[1\] for 'w', whose item plans torch.float32 of shape \[4\]"),
])
def test_a_planner_failing_on_one_rank_fails_every_rank_and_keeps_the_last_checkpoint(tmp_path, step: str,
                                                                                     says: str) -> None:
    path = str(tmp_path / "ckpt")

    def body(rank: int, world_size: int) -> str:
        mesh = init_device_mesh("cpu", (2,))
        dcp.save({"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}, checkpoint_id=path)
        with pytest.raises(CheckpointError) as raised:
            dcp.save({"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}, checkpoint_id=path,
                     planner=_FailingPlanner(step, rank))
        state = {"w": distribute_tensor(torch.full((8,), -1.0), mesh, [Shard(0)])}
        dcp.load(state, checkpoint_id=path)
        assert torch.equal(state["w"].full_tensor(), torch.arange(8.0))
        return str(raised.value)

    for message in run_ranks(body, world_size=2, timeout=TIMEOUT):
        assert "no checkpoint was written" in message
        assert re.search(says, message), message


def test_plans_travel_as_json_and_bad_plans_or_arguments_are_refused(tmp_path) -> None:
    class OpaquePlannerData(dcp.DefaultSavePlanner):
        def create_local_plan(self):
            return dataclasses.replace(super().create_local_plan(), planner_data=object())

    with pytest.raises(CheckpointError, match=r"SavePlan.planner_data' holds a object, which can't be saved without "
                                              r"pickle"):
        dcp.save(_state(), checkpoint_id=str(tmp_path / "a"), planner=OpaquePlannerData())
    assert not os.path.exists(tmp_path / "a" / METADATA_FILE)
    with pytest.raises(ValueError, match=r"dedup_replicated_tensors=False is not supported"):
        dcp.DefaultSavePlanner(dedup_replicated_tensors=False)
    planner = dcp.DefaultSavePlanner(flatten_state_dict=True, flatten_sharded_tensors=True,
                                     dedup_replicated_tensors=True, dedup_save_to_lowest_rank=True,
                                     enable_plan_caching=True)
    assert isinstance(planner, dcp.SavePlanner) and isinstance(dcp.DefaultLoadPlanner(), dcp.LoadPlanner)
    with pytest.raises(CheckpointError, match=r"'fn' holds a builtin_function_or_method"):
        create_default_local_save_plan({"fn": print}, True)


def test_flatten_state_dict_false_saves_the_top_level_as_it_is(tmp_path) -> None:
    flat = {"w": torch.arange(4.0), "step": 2}
    metadata = dcp.save(flat, checkpoint_id=str(tmp_path), planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    assert set(metadata.tensors) == {"w"} and metadata.values == {"step": 2} and metadata.paths == {}
    state = {"w": torch.zeros(4), "step": 0}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
    assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 2


def test_replicated_items_go_where_torchs_dedup_sends_them() -> None:
    """The balanced choice of writer, item by item, is torch's: replicas that differ (TorchTitan's router weights
    under tensor and expert parallelism) are saved from the rank torch's would save them from."""
    from torch.distributed.checkpoint import metadata as torch_metadata
    from torch.distributed.checkpoint import planner as torch_planner
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    from spmd.checkpoint import metadata as spmd_metadata
    from spmd.checkpoint import planner as spmd_planner
    from spmd.checkpoint.default_planner import _dedup

    generator = torch.Generator().manual_seed(0)
    items = []                # (fqn, rows, dtype, holding ranks): boxes of random sizes held by random rank sets
    for k in range(40):
        holders = sorted(torch.randperm(4, generator=generator)[:int(torch.randint(1, 5, (1,), generator=generator))]
                         .tolist())
        items.append((f"t{k}", int(torch.randint(1, 50, (1,), generator=generator)),
                      [torch.float32, torch.bfloat16][k % 2], holders))
    items.append(("value", None, None, [0, 1, 2, 3]))

    def plans(lib: Any, meta: Any) -> list:
        out = []
        for rank in range(4):
            mine = []
            for fqn, rows, dtype, holders in items:
                if rank not in holders:
                    continue
                if rows is None:
                    mine.append(lib.WriteItem(index=meta.MetadataIndex(fqn), type=lib.WriteItemType.BYTE_IO))
                    continue
                chunk = meta.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([rows]))
                data = lib.TensorWriteData(chunk=chunk, properties=meta.TensorProperties(dtype=dtype),
                                           size=torch.Size([rows]))
                mine.append(lib.WriteItem(index=meta.MetadataIndex(fqn, torch.Size([0])), type=lib.WriteItemType.SHARD,
                                          tensor_data=data))
            out.append(lib.SavePlan(mine))
        return out

    for to_lowest_rank in (False, True):
        ours = _dedup(plans(spmd_planner, spmd_metadata), to_lowest_rank)
        theirs = dedup_save_plans(plans(torch_planner, torch_metadata), to_lowest_rank)
        assert [[item.index.fqn for item in plan.items] for plan in ours] == \
            [[item.index.fqn for item in plan.items] for plan in theirs]

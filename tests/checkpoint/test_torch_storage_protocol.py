"""A storage written for torch's DCP ports: the same StorageWriter/StorageReader source (write_data, finish,
read_metadata, read_data over an in-memory store, as a user's object-store storage is written), run by torch's
DCP as it is and by spmd after the textual swap of `torch.distributed` for `spmd`, saves and loads; under spmd a
sharded state dict saved by 2 ranks loads into whole tensors, values included (see Note: torch's storage protocol
in src/spmd/checkpoint/storage.py)."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import nn

from spmd.fsdp import fully_shard
from spmd.testing import run_ranks, seeded
from tests.test_porting import port

STORAGE = '''
import io
import pickle

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


def _done(value):
    future = Future()
    future.set_result(value)
    return future


class MemoryWriter(StorageWriter):
    def __init__(self, store):
        super().__init__()
        self.store = store
        self.calls = []

    def reset(self, checkpoint_id=None):
        self.calls.append("reset")

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.calls.append("set_up")

    def prepare_local_plan(self, plan):
        self.calls.append("local")
        return plan

    def prepare_global_plan(self, plans):
        self.calls.append("global")
        return plans

    def write_data(self, plan, planner):
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            buffer = io.BytesIO()
            if item.type == WriteItemType.BYTE_IO:
                buffer.write(data.getvalue())
            else:
                torch.save(data.detach().clone(), buffer)
            key = f"{item.index.fqn}@{list(item.index.offset) if item.index.offset is not None else ''}"
            self.store[key] = buffer.getvalue()
            results.append(WriteResult(index=item.index, size_in_bytes=len(self.store[key]), storage_data=key))
        return _done(results)

    def finish(self, metadata, results):
        metadata.storage_data = {result.index: result.storage_data for per_rank in results for result in per_rank}
        self.store[".metadata"] = pickle.dumps(metadata)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True

    def storage_meta(self):
        return None


class MemoryReader(StorageReader):
    def __init__(self, store):
        super().__init__()
        self.store = store

    def reset(self, checkpoint_id=None):
        pass

    def read_metadata(self):
        return pickle.loads(self.store[".metadata"])

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        for item in plan.items:
            raw = self.store[self.metadata.storage_data[item.storage_index]]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            saved = torch.load(io.BytesIO(raw), weights_only=True)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                saved = saved.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(saved)
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True
'''


def storage_module(source: str) -> types.ModuleType:
    module = types.ModuleType("memory_storage")
    exec(compile(source, "memory_storage.py", "exec"), module.__dict__)
    return module


def model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_the_storage_is_a_working_torch_storage() -> None:
    """The oracle: torch's DCP, in this one process, saves and loads through the storage as written."""
    import torch.distributed.checkpoint as dcp

    memory = storage_module(STORAGE)
    store: dict[str, bytes] = {}
    dcp.save({"model": model().state_dict(), "step": 3}, storage_writer=memory.MemoryWriter(store), no_dist=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in model().state_dict().items()}, "step": 0}
    dcp.load(target, storage_reader=memory.MemoryReader(store), no_dist=True)
    torch.testing.assert_close(target["model"], model().state_dict(), rtol=0, atol=0)
    assert target["step"] == 3


def test_spmd_saves_a_sharded_state_dict_through_it_and_loads_it_into_whole_tensors() -> None:
    memory = storage_module(port(STORAGE))
    stores: dict[str, dict[str, bytes]] = {"save": {}, "async_save": {}}

    def body(rank: int, size: int) -> dict[str, Any]:
        import spmd.checkpoint as dcp

        writer = memory.MemoryWriter(stores["save"])
        sharded = fully_shard(copy.deepcopy(model()))
        dcp.save({"model": sharded.state_dict(), "step": 3}, storage_writer=writer, checkpoint_id="memory")
        dcp.async_save({"model": sharded.state_dict(), "step": 4},
                       storage_writer=memory.MemoryWriter(stores["async_save"])).result()
        loaded = {}
        for how, store in stores.items():
            target = {"model": {k: torch.zeros_like(v) for k, v in model().state_dict().items()}, "step": 0}
            dcp.load(target, storage_reader=memory.MemoryReader(store))
            loaded[how] = target
        return {"loaded": loaded, "calls": writer.calls}

    for rank, result in enumerate(run_ranks(body, 2, timeout=60.0)):
        for how, step in (("save", 3), ("async_save", 4)):
            torch.testing.assert_close(result["loaded"][how]["model"], model().state_dict(), rtol=0, atol=0)
            assert result["loaded"][how]["step"] == step
        assert result["calls"] == ["reset", "set_up", "local"] + (["global"] if rank == 0 else [])


def test_a_storage_of_neither_protocol_is_named() -> None:
    import spmd.checkpoint as dcp

    class Nothing(dcp.StorageWriter):
        pass

    with pytest.raises(dcp.CheckpointError, match="Nothing implements neither spmd's storage protocol"):
        dcp.save({"x": torch.ones(2)}, storage_writer=Nothing(), no_dist=True)

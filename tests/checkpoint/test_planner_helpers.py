"""torch's planner helpers at their paths (checkpoint.planner_helpers, checkpoint.utils, checkpoint.resharding):
the read items for a rank's boxes against torch's own, and the lookup of a plan item's object."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spmd.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from spmd.checkpoint.planner_helpers import create_read_items_for_chunk_list
from spmd.checkpoint.resharding import ChunkStorageMetadata as ReshardingChunk
from spmd.checkpoint.utils import find_state_dict_object, find_tensor_shard
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Shard, distribute_tensor
from spmd.testing import run_ranks

# (global shape, saved boxes, local boxes) as (offsets, sizes) pairs
CASES = [
    ((8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6))], [((0, 0), (8, 6))]),                   # 2 rows -> whole
    ((8, 6), [((0, 0), (8, 6))], [((2, 0), (2, 6)), ((6, 0), (2, 6))]),                   # whole -> 2 boxes
    ((8, 6), [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (2, 6))], [((2, 3), (5, 3))]),  # uneven rows -> block
    ((8, 6), [((0, 0), (8, 3)), ((0, 3), (8, 3))], [((0, 0), (4, 6)), ((4, 0), (4, 6))]),  # columns -> rows
    ((5,), [((0,), (3,)), ((3,), (2,))], [((3,), (0,)), ((1,), (4,))]),                   # an empty local box
]


def _fields(item: Any) -> tuple:
    return (item.type.name, item.dest_index.fqn, tuple(item.dest_index.offset), item.dest_index.index,
            tuple(item.dest_offsets), item.storage_index.fqn, tuple(item.storage_index.offset),
            item.storage_index.index, tuple(item.storage_offsets), tuple(item.lengths))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_read_items_for_a_ranks_boxes_are_torchs(case: int) -> None:
    from torch.distributed.checkpoint import metadata as torch_metadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list as torchs

    shape, saved, local = CASES[case]

    def chunks(kind: Any, boxes: list) -> list:
        return [kind(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in boxes]

    ours = create_read_items_for_chunk_list(
        "w", TensorStorageMetadata(TensorProperties(), torch.Size(shape), chunks(ChunkStorageMetadata, saved)),
        chunks(ReshardingChunk, local))
    theirs = torchs("w", torch_metadata.TensorStorageMetadata(torch_metadata.TensorProperties(), torch.Size(shape),
                                                              chunks(torch_metadata.ChunkStorageMetadata, saved)),
                    chunks(torch_metadata.ChunkStorageMetadata, local))
    assert ours and [_fields(item) for item in ours] == [_fields(item) for item in theirs]


def test_a_plan_items_object_is_the_boxes_local_tensor_or_the_value() -> None:
    def body(rank: int, world_size: int) -> list[Any]:
        mesh = init_device_mesh("cpu", (world_size,))
        weight = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
        state = {"weight": weight, "bias": torch.ones(3), "step": 7}
        found = find_state_dict_object(state, MetadataIndex("weight", torch.Size([2 * rank, 0])))
        assert found is weight._local_tensor
        assert find_state_dict_object(state, MetadataIndex("bias", torch.Size([0]))) is state["bias"]
        assert find_tensor_shard(state["bias"], MetadataIndex("bias")) is state["bias"]
        with pytest.raises(ValueError, match=r"'weight' is a DTensor whose box on this rank starts at \[\d, 0\]"):
            find_state_dict_object(state, MetadataIndex("weight", torch.Size([1, 0])))
        with pytest.raises(ValueError, match="'bias' is a plain tensor, which starts at \\[0\\], not at \\[1\\]"):
            find_tensor_shard(state["bias"], MetadataIndex("bias", torch.Size([1])))
        with pytest.raises(ValueError, match="'step' is a int, not a tensor"):
            find_state_dict_object(state, MetadataIndex("step", torch.Size([0])))
        with pytest.raises(ValueError, match="has no 'missing'"):
            find_state_dict_object(state, MetadataIndex("missing"))
        return [found.tolist(), find_state_dict_object(state, MetadataIndex("step"))]

    assert run_ranks(body, world_size=3, timeout=30) == [[[[0.0, 1.0], [2.0, 3.0]], 7],
                                                        [[[4.0, 5.0], [6.0, 7.0]], 7],
                                                        [[[8.0, 9.0], [10.0, 11.0]], 7]]

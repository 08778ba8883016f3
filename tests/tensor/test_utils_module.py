"""`spmd.tensor._utils` at torch's path: a DTensor's local shape and global offset from its layout alone equal
torch's own computation for the same mesh coordinate (torch's pure function, fed the coordinate), on uneven
shapes, several shards of one dim and replicated dims; sizes normalise as torch's."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from spmd.device_mesh import init_device_mesh
from spmd.tensor import Replicate, Shard
from spmd.tensor._utils import compute_local_shape_and_global_offset, normalize_to_torch_size
from spmd.testing import run_ranks

LAYOUTS = [(Shard(1), Shard(1)), (Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()),
           (Shard(0), Shard(0)), (Replicate(), Replicate())]
SHAPES = [(2, 5), (7, 3), (1, 9), (5, 2)]


def _torch_placement(placement: object) -> object:
    return TorchShard(placement.dim) if isinstance(placement, Shard) else TorchReplicate()


def test_local_shape_and_offset_equal_torchs_on_every_rank_of_a_2d_mesh() -> None:
    def body(rank: int, size: int) -> list[tuple]:
        mesh = init_device_mesh("cpu", (2, 2))
        coordinate = mesh.get_coordinate()
        got = []
        for shape, layout in itertools.product(SHAPES, LAYOUTS):
            ours = compute_local_shape_and_global_offset(shape, mesh, layout)
            theirs = _compute_local_shape_and_global_offset(shape, (2, 2), coordinate,
                                                            [_torch_placement(p) for p in layout])
            got.append((shape, layout, ours, tuple(map(tuple, theirs))))
        assert compute_local_shape_and_global_offset((2, 5), mesh, LAYOUTS[0], skip_offset=True)[1] == ()
        return got

    for results in run_ranks(body, 4, timeout=60.0):
        for shape, layout, ours, theirs in results:
            assert ours == theirs, (shape, layout)


def test_torchs_worked_example() -> None:
    """torch's docstring table: (2, 5) on a (2, 2) mesh, (Shard(1), Shard(1))."""
    expected = [((2, 2), (0, 0)), ((2, 1), (0, 2)), ((2, 1), (0, 3)), ((2, 1), (0, 4))]
    results = run_ranks(lambda rank, size: compute_local_shape_and_global_offset(
        (2, 5), init_device_mesh("cpu", (2, 2)), [Shard(1), Shard(1)]), 4, timeout=60.0)
    assert results == expected


@pytest.mark.parametrize("size", [3, [3, 4], (3, 4), ((3, 4),), torch.Size([3, 4])])
def test_normalize_to_torch_size(size: object) -> None:
    from torch.distributed.tensor._utils import normalize_to_torch_size as torchs

    assert normalize_to_torch_size(size) == torchs(size)

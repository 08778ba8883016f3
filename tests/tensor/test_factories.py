"""DTensor factories (zeros, ones, empty, full, rand, randn): the global shape on every mesh and placement, each
rank holding its piece, random ones equal to the one-process draw, and torch's DTensor factories as the oracle
for the layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist
import torch.distributed.tensor as torch_tensor

import spmd
import spmd.tensor
from spmd.device_mesh import init_device_mesh
from spmd.tensor import Replicate, Shard
from spmd.tensor.random import manual_seed
from tests.tensor.conftest import placement_combos, run_on_mesh

SHAPE = (7, 6)


def test_every_factory_on_every_layout_matches_the_one_process_tensor(mesh_shape: tuple[int, ...]) -> None:
    def body(mesh) -> None:
        for index, placements in enumerate(placement_combos(2, mesh.ndim, partial=False)):
            made = {
                "zeros": (spmd.tensor.zeros(*SHAPE, device_mesh=mesh, placements=placements), torch.zeros(SHAPE)),
                "ones": (spmd.tensor.ones(SHAPE, dtype=torch.float64, device_mesh=mesh, placements=placements),
                         torch.ones(SHAPE, dtype=torch.float64)),
                "full": (spmd.tensor.full(list(SHAPE), 7, device_mesh=mesh, placements=placements),
                         torch.full(SHAPE, 7)),
                "empty": (spmd.tensor.empty(*SHAPE, device_mesh=mesh, placements=placements), None),
            }
            manual_seed(index)
            one_process = torch.Generator().manual_seed(index)       # the same draws, in the same order
            made["rand"] = (spmd.tensor.rand(*SHAPE, device_mesh=mesh, placements=placements),
                            torch.rand(SHAPE, generator=one_process))
            made["randn"] = (spmd.tensor.randn(*SHAPE, device_mesh=mesh, placements=placements, requires_grad=True),
                             torch.randn(SHAPE, generator=one_process))
            for name, (dtensor, reference) in made.items():
                assert dtensor.shape == SHAPE and dtensor.placements == placements, name
                assert dtensor.to_local().shape == dtensor._spec.local_shape(), name
                if reference is not None:
                    assert torch.equal(dtensor.full_tensor().detach(), reference), name
            assert made["full"][0].dtype == torch.int64 and made["randn"][0].requires_grad

    run_on_mesh(mesh_shape, body, timeout=60)


def test_consecutive_random_factories_stay_in_step_with_one_process() -> None:
    def body(mesh) -> list[torch.Tensor]:
        manual_seed(3)
        a = spmd.tensor.randn(5, 4, device_mesh=mesh, placements=[Shard(1)])
        b = spmd.tensor.rand(3, device_mesh=mesh, placements=[Replicate()])
        return [a.full_tensor(), b.full_tensor()]

    generator = torch.Generator().manual_seed(3)
    want = [torch.randn(5, 4, generator=generator), torch.rand(3, generator=generator)]
    for got in run_on_mesh((2,), body):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_local_pieces_and_strides_match_torchs_factories() -> None:
    torch_dist.init_process_group("fake", rank=1, world_size=4)     # rank 1 of 4, both sides simulated
    spmd.init_process_group("fake", rank=1, world_size=4, torch_default_group=False)
    try:
        torch_mesh = torch_dist.device_mesh.init_device_mesh("cpu", (4,))
        mesh = init_device_mesh("cpu", (4,))
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            theirs = torch_tensor.ones(7, 6, device_mesh=torch_mesh,
                                       placements=[torch_tensor.Shard(p.dim) if isinstance(p, Shard)
                                                   else torch_tensor.Replicate() for p in placements])
            ours = spmd.tensor.ones(7, 6, device_mesh=mesh, placements=placements)
            assert ours.to_local().shape == theirs.to_local().shape and ours.stride() == theirs.stride()
    finally:
        spmd.destroy_process_group()
        torch_dist.destroy_process_group()


@pytest.mark.parametrize("call, error", [
    (lambda mesh: spmd.tensor.zeros(2, 3), "pass device_mesh="),
    (lambda mesh: spmd.tensor.zeros(2, 3, device_mesh=mesh, layout=torch.sparse_coo), "layout"),
    (lambda mesh: spmd.tensor.ones(2, -1, device_mesh=mesh), "negative dimension"),
    (lambda mesh: spmd.tensor.ones("ab", device_mesh=mesh), "size must be ints"),
    (lambda mesh: spmd.tensor.ones(2, 3, device_mesh=mesh, placements=[Shard(2)]), "Shard"),
])
def test_bad_arguments_are_refused(call, error: str) -> None:
    def body(mesh) -> None:
        with pytest.raises((ValueError, TypeError), match=error):
            call(mesh)

    run_on_mesh((2,), body)

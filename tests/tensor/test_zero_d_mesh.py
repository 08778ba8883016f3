"""The 0-d DeviceMesh: `init_device_mesh(device, [], mesh_dim_names=[])`, what torch gives (and TorchTitan builds)
when a one-rank run enables no parallelism. It is one rank with no mesh dims; DTensors on it have no placements,
hold the whole tensor, and train exactly as plain tensors, with no fallback and no communication."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from spmd.device_mesh import init_device_mesh
from spmd.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from spmd.tensor.rules import record_fallbacks
from spmd.testing import run_ranks

TIMEOUT = 60.0


def _mesh():
    return init_device_mesh("cpu", [], mesh_dim_names=[])


def test_queries_match_torchs_0d_mesh() -> None:
    store = torch_dist.HashStore()
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        theirs = torch_init_device_mesh("cpu", [], mesh_dim_names=[])
        expected = (theirs.ndim, tuple(theirs.shape), theirs.size(), theirs.get_coordinate(),
                    len(theirs.get_all_groups()))
    finally:
        torch_dist.destroy_process_group()

    def body(rank: int, world_size: int) -> tuple:
        mesh = _mesh()
        assert mesh == _mesh() and mesh.get_rank() == 0
        with pytest.raises(ValueError, match="no dims to flatten"):
            mesh._flatten("all")
        with pytest.raises(ValueError, match="has 0 dims"):
            mesh.get_group()
        return mesh.ndim, tuple(mesh.shape), mesh.size(), mesh.get_coordinate(), len(mesh.get_all_groups())

    assert run_ranks(body, 1, timeout=TIMEOUT) == [expected]


def test_a_0d_mesh_needs_a_world_of_one() -> None:
    def body(rank: int, world_size: int) -> None:
        with pytest.raises(ValueError, match=r"mesh_shape \(\) holds 1 ranks but the world has 2"):
            _mesh()

    run_ranks(body, 2, timeout=TIMEOUT)


def test_training_on_a_0d_mesh_equals_plain_training() -> None:
    def train(model: torch.nn.Module, steps: int = 3) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(8, 6, generator=generator)
            out = model(x)
            loss = (out.full_tensor() if isinstance(out, DTensor) else out).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                   torch.nn.Linear(16, 3))

    def body(rank: int, world_size: int) -> None:
        mesh = _mesh()
        model = distribute_module(make(), mesh,
                                  input_fn=lambda _, inputs, mesh: tuple(DTensor.from_local(x, mesh, [])
                                                                         for x in inputs))
        assert all(isinstance(p, DTensor) and p.placements == () for p in model.parameters())
        with record_fallbacks() as fallbacks:
            losses = train(model)
        assert fallbacks == []
        plain = make()          # on this thread too: the same intra-op threads, so the same summation order
        assert losses == train(plain)
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name].full_tensor(), value), name

    run_ranks(body, 1, timeout=TIMEOUT)


def test_dtensors_on_a_0d_mesh_convert_and_save() -> None:
    def body(rank: int, world_size: int) -> None:
        mesh = _mesh()
        full = torch.arange(6.0).reshape(2, 3)
        dtensor = distribute_tensor(full, mesh)
        assert dtensor.placements == () and torch.equal(dtensor.to_local(), full)
        assert dtensor.redistribute(mesh, []).placements == ()
        with pytest.raises(ValueError):
            distribute_tensor(full, mesh, [Replicate()])
        buffer = io.BytesIO()
        torch.save(dtensor, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert loaded.device_mesh == mesh and torch.equal(loaded.full_tensor(), full)

    run_ranks(body, 1, timeout=TIMEOUT)

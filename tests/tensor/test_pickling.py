"""DTensors through torch.save / torch.load (a rank's sharded state dict and optimizer state saved as a file of
its own, as quick FSDP2 scripts do): the local shard, placements (Partial and _StridedShard included) and
parameter flag come back, with weights_only=True too; the mesh is rebuilt from the groups the loading rank's
world already has, so loading is not collective; a mesh whose groups the world lacks, or no world at all, is a
clear error."""

from __future__ import annotations

import pathlib

import pytest
import torch

from spmd.device_mesh import _unpickled_mesh, init_device_mesh
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from spmd.tensor.placement import _StridedShard
from spmd.testing import run_ranks
from tests.tensor.parallel.test_parity import batch, fsdp_over_tp, step_loss

TIMEOUT = 60.0


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    optimizer.zero_grad()
    loss = step_loss(model, *batch(step), use_loss_parallel=False).item()
    optimizer.step()
    return loss


def test_a_ranks_state_dicts_saved_with_torch_save_resume_training_bit_exact(tmp_path: pathlib.Path) -> None:
    def body(rank: int, size: int) -> tuple[float, float]:
        model = fsdp_over_tp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, optimizer, 0)
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp_path / f"rank{rank}.pt")
        expected = _step(model, optimizer, 1)

        resumed = fsdp_over_tp()
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        weight = saved["model"]["blocks.0.attn.q.weight"]
        assert isinstance(weight, DTensor) and weight.placements == resumed.blocks[0].attn.q.weight.placements
        resumed.load_state_dict(saved["model"])
        resumed_optimizer.load_state_dict(saved["optim"])
        return expected, _step(resumed, resumed_optimizer, 1)

    for expected, resumed in run_ranks(body, 4, timeout=TIMEOUT):
        assert resumed == expected


def test_placements_and_the_parameter_flag_survive_pickling(tmp_path: pathlib.Path) -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        values = torch.arange(16.0).reshape(4, 4)
        tensors = {
            "strided": distribute_tensor(values, mesh, [_StridedShard(0, split_factor=2), Shard(0)]),
            "partial": DTensor.from_local(torch.full((2,), float(rank)), mesh["tp"], [Partial()]),
            "param": torch.nn.Parameter(distribute_tensor(values, mesh["dp"], [Replicate()])),
        }
        torch.save(tensors, tmp_path / f"rank{rank}.pt")
        loaded = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, tensor in tensors.items():
            assert loaded[name]._spec == tensor._spec, name
            assert torch.equal(loaded[name]._local_tensor, tensor._local_tensor), name
        assert loaded["param"].requires_grad and isinstance(loaded["param"], torch.nn.Parameter)
        assert torch.equal(loaded["strided"].full_tensor(), values)      # the loaded one communicates
        tp_sum = 4 * (rank // 2) + 1                   # the ranks' values summed over their tp row
        assert torch.equal(loaded["partial"].full_tensor(), torch.full((2,), float(tp_sum)))

    run_ranks(body, 4, timeout=TIMEOUT)


def test_a_mesh_the_world_lacks_or_no_world_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    def body(rank: int, size: int) -> None:
        mesh = init_device_mesh("cpu", (size,))
        torch.save({"w": distribute_tensor(torch.ones(4), mesh, [Shard(0)])}, tmp_path / f"rank{rank}.pt")
        with pytest.raises(RuntimeError, match=r"has no process group for ranks \[\d, \d\] in this world; build "
                                               r"the mesh \(init_device_mesh\) before loading"):
            _unpickled_mesh("cpu", [[0, 3], [1, 2]], None, (None, None))

    run_ranks(body, 4, timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match=r"needs this rank's spmd world: call spmd.init_process_group\(\)"):
        torch.load(tmp_path / "rank0.pt", weights_only=True)

"""spmd._state_dict_utils at torch's path: gather a sharded state dict into full tensors, offload it, allocate
CPU buffers of its structure and copy into them (TorchTitan's async staging), compare structures, and lay full
tensors out as a sharded state dict's DTensors. Plain state dicts give torch's own helpers' results."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed import _state_dict_utils as torchs

from spmd import _state_dict_utils as ours
from spmd.device_mesh import init_device_mesh
from spmd.fsdp import fully_shard
from spmd.tensor import DTensor, Shard, distribute_tensor
from spmd.testing import run_ranks, seeded

TIMEOUT = 60.0


def model() -> nn.Module:
    with seeded(0):
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def nested() -> dict:
    with seeded(1):
        return {"w": torch.randn(3, 4), "opt": {"step": 3, "moments": [torch.randn(2), (torch.randn(1, 2), None)]},
                "scalar": torch.tensor(2.5), "name": "adam", "empty": torch.empty(0, 3)}


def test_gather_offload_copy_and_allocate_a_sharded_state_dict() -> None:
    def body(rank: int, size: int) -> dict:
        sharded = fully_shard(model())
        state = {"model": sharded.state_dict(), "epoch": 2}
        full = ours._gather_state_dict(state, cpu_offload=True)
        only_first = ours._gather_state_dict(state, ranks_only=(0,))
        buffers = ours._create_cpu_state_dict(state)
        staged = ours._copy_state_dict(state, buffers)
        offloaded = ours._offload_state_dict_to_cpu(state)
        return {"full": full, "only_first": only_first, "staged": staged, "buffers": buffers, "state": state,
                "offloaded": offloaded, "similar": ours._check_state_dict_similarity(state, buffers)}

    want = model().state_dict()
    for rank, result in enumerate(run_ranks(body, 2, timeout=TIMEOUT)):
        assert result["full"]["epoch"] == 2
        for key, value in want.items():
            torch.testing.assert_close(result["full"]["model"][key], value, rtol=0, atol=0)
            staged, source = result["staged"]["model"][key], result["state"]["model"][key]
            assert isinstance(staged, DTensor) and staged.placements == source.placements
            assert staged is result["buffers"]["model"][key]            # the copies live in the buffers given
            torch.testing.assert_close(staged.to_local(), source.to_local(), rtol=0, atol=0)
            assert result["offloaded"]["model"][key].to_local().device.type == "cpu"
        assert (result["only_first"] == {}) == (rank == 1)
        assert result["similar"]


def same(a: object, b: object) -> bool:
    """Equal structures, tensors equal in dtype, shape and values, other values equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_plain_state_dicts_give_torchs_results() -> None:
    state = nested()
    buffers, theirs_buffers = ours._create_cpu_state_dict(state), torchs._create_cpu_state_dict(state)
    copied, theirs = ours._copy_state_dict(state, buffers), torchs._copy_state_dict(state, theirs_buffers)
    assert ours._check_state_dict_similarity(copied, theirs) and torchs._check_state_dict_similarity(copied, theirs)
    assert same(copied, theirs) and same(copied, state)
    assert same(ours._offload_state_dict_to_cpu(state), torchs._offload_state_dict_to_cpu(state))
    changed = nested()
    changed["w"] = torch.randn(4, 3)
    assert not ours._check_state_dict_similarity(state, changed)
    assert not torchs._check_state_dict_similarity(state, changed)
    with pytest.raises(ours.CompanionMismatch, match="keys differ"):
        ours._copy_state_dict(state, {"w": torch.empty(3, 4)})
    with pytest.raises(ValueError, match="unexpected value type object"):
        ours._gather_state_dict({"x": object()})


def test_full_tensors_are_laid_out_as_the_sharded_state_dicts_dtensors() -> None:
    def body(rank: int, size: int) -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (size,))
        full = torch.arange(21.0).reshape(7, 3)
        on_meta = DTensor.from_local(torch.empty(4 if rank == 0 else 3, 3, device="meta"), mesh, [Shard(0)],
                                     shape=(7, 3), stride=(3, 1))
        in_place = distribute_tensor(torch.zeros(7, 3), mesh, [Shard(0)])
        local = {"a": (on_meta, full), "b": (in_place, full * 2), "c": torch.ones(1)}
        ours._distribute_tensors(local, ["a", "b", "c"], torch.device("cpu"))
        assert local["b"] is in_place
        laid = {"d": distribute_tensor(torch.zeros(7, 3), mesh, [Shard(1)]), "e": torch.zeros(2), "f": 0}
        ours._distribute_state_dict({"d": full, "e": torch.ones(2), "f": 5, "g": torch.ones(1)}, laid,
                                    torch.device("cpu"))
        assert laid["f"] == 5 and "g" not in laid and laid["d"].placements == (Shard(1),)
        return [local["a"].full_tensor(), local["b"].full_tensor(), laid["d"].full_tensor(), laid["e"]]

    full = torch.arange(21.0).reshape(7, 3)
    for a, b, d, e in run_ranks(body, 2, timeout=TIMEOUT):
        torch.testing.assert_close(a, full)
        torch.testing.assert_close(b, full * 2)
        torch.testing.assert_close(d, full)
        torch.testing.assert_close(e, torch.ones(2))

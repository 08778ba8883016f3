"""torch's private c10d helpers at spmd.distributed_c10d (`_rank_not_in_group`, `_resolve_process_group`, ...), as
libraries call them: the same answers for spmd's groups as torch's give for its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import spmd
from spmd import distributed_c10d as c10d
from spmd.testing import run_ranks


def test_group_helpers_answer_for_spmds_groups() -> None:
    def body(rank: int, world_size: int) -> dict[str, Any]:
        pair = spmd.new_group([0, 1])
        out: dict[str, Any] = {"not in pair": c10d._rank_not_in_group(pair),
                               "not in world": c10d._rank_not_in_group(None),
                               "sizes": (c10d._get_group_size(None), None if rank == 2 else c10d._get_group_size(pair)),
                               "device": c10d._get_pg_default_device()}
        if rank != 2:
            name = c10d._get_process_group_name(pair)
            out["resolved"] = (c10d._resolve_process_group(name) is pair,
                               c10d._resolve_process_group(f"spmd/{name}") is pair)   # torch's view's name
        with pytest.raises(ValueError, match="no group of this rank is named 'nope'"):
            c10d._resolve_process_group("nope")
        store = c10d._get_default_store()
        store.set(f"hello/{rank}", str(rank))
        store.wait([f"hello/{r}" for r in range(world_size)])
        return out

    results = run_ranks(body, world_size=3, timeout=30)
    assert [out["not in pair"] for out in results] == [False, False, True]
    assert all(out["not in world"] is False and out["device"] == torch.device("cpu") for out in results)
    assert [out["sizes"] for out in results] == [(3, 2), (3, 2), (3, None)]
    assert [out.get("resolved") for out in results] == [(True, True), (True, True), None]


def test_object_tensors_round_trip_with_torchs_own() -> None:
    from torch.distributed import distributed_c10d as torch_c10d

    obj = {"step": 7, "names": ["a", "b"], "scale": 0.5}
    data, size = c10d._object_to_tensor(obj, "cpu", None)
    assert data.dtype == torch.uint8 and size.dtype == torch.int64 and size.tolist() == [data.numel()]
    assert torch_c10d._tensor_to_object(data, size.item(), None) == obj
    theirs, their_size = torch_c10d._object_to_tensor(obj, torch.device("cpu"), None)
    padded = torch.cat([theirs, torch.zeros(5, dtype=torch.uint8)])     # as a gathered, padded buffer holds it
    assert c10d._tensor_to_object(padded, their_size, None) == obj


def test_argument_checks_raise_torchs_type_errors() -> None:
    c10d._check_single_tensor(torch.ones(1), "tensor")
    c10d._check_tensor_list([torch.ones(1)], "tensor_list")
    with pytest.raises(TypeError, match=r"`tensor` of type torch\.Tensor"):
        c10d._check_single_tensor([torch.ones(1)], "tensor")
    with pytest.raises(TypeError, match=r"`tensor_list` of type List\[torch.Tensor\]"):
        c10d._check_tensor_list([torch.ones(1), 2], "tensor_list")

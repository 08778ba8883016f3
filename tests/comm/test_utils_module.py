"""spmd.utils at torch's path (`distributed.utils`): the pure helpers give torch's results on nested inputs
(dataclasses, named tuples, ordered dicts, sets), storage is freed and re-grown in place, and the collective
ones make every rank's module state rank 0's (ignored names left) or name the rank whose parameters differ."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed.utils as torchs
from torch import nn

from spmd import utils as ours
from spmd.testing import run_ranks, seeded


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def nested() -> tuple:
    return (torch.ones(2), [torch.zeros(1, dtype=torch.float64), 3], {"k": Pair(torch.arange(3), 4)},
            collections.OrderedDict(z=torch.ones(1, dtype=torch.int64)), Batch(torch.ones(2), "b"), {torch.ones(1)})


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, set):
        return type(a) is type(b) and len(a) == len(b)
    return a == b


def test_pure_helpers_give_torchs_results() -> None:
    double = lambda t: t * 2  # noqa: E731
    assert same(ours._apply_to_tensors(double, nested()), torchs._apply_to_tensors(double, nested()))
    assert same(ours._cast_forward_inputs(torch.float16, *nested(), scale=torch.ones(1)),
                torchs._cast_forward_inputs(torch.float16, *nested(), scale=torch.ones(1)))
    assert ours._pack_kwargs(1, 2, a=3, b=4) == torchs._pack_kwargs(1, 2, a=3, b=4)
    assert ours._unpack_kwargs((1, 2, 3, 4), ("a", "b")) == torchs._unpack_kwargs((1, 2, 3, 4), ("a", "b"))
    cpu = torch.device("cpu")
    for inputs, kwargs in [((torch.ones(1), Pair(torch.ones(1), 2)), {"m": torch.ones(1)}), ((torch.ones(1),), None),
                           ((), {"m": [torch.ones(1)]})]:
        assert same(ours._to_kwargs(inputs, kwargs, cpu, False), torchs._to_kwargs(inputs, kwargs, cpu, False))
    state = {"layer.a": 1, "layer.b": 2, "other": 3}
    theirs = dict(state)
    ours._replace_by_prefix(state, "layer.", "module.layer.")
    torchs._replace_by_prefix(theirs, "layer.", "module.layer.")
    assert state == theirs
    model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.Linear(1, 1)))
    assert ours._get_root_modules([model[1], model, model[0]]) == [model]
    with pytest.raises(AssertionError, match="broken"):
        ours._p_assert(False, "broken")


def test_storage_is_freed_and_regrown_in_place() -> None:
    tensor = torch.arange(6.0)
    view = tensor.view(2, 3)
    ours._free_storage(tensor)
    assert tensor.untyped_storage().nbytes() == 0 and not ours._data_ptr_allocated(tensor)
    ours._alloc_storage(tensor, torch.Size([6]))
    view.copy_(torch.ones(2, 3))          # the view sees the regrown memory
    assert torch.equal(tensor, torch.ones(6)) and ours._data_ptr_allocated(tensor)
    with pytest.raises(AssertionError, match="not the sole occupant"):
        ours._free_storage(tensor[1:])


def test_module_states_become_rank_0s_and_different_shapes_are_named() -> None:
    def body(rank: int, size: int) -> dict:
        with seeded(rank):
            model = nn.Sequential(nn.Linear(3, 40), nn.BatchNorm1d(40), nn.Linear(40, 2))
        model[1].running_mean.fill_(float(rank))
        kept = model[2].bias.detach().clone()
        ours._sync_module_states(model, None, broadcast_bucket_size=256, src=0,
                                 params_and_buffers_to_ignore={"2.bias"})
        ours._verify_param_shape_across_processes(None, list(model.parameters()))
        with pytest.raises(RuntimeError, match=r"parameter 0 is torch.float32 \[5\] on rank 1 and torch.float32 "
                                               r"\[4\] on rank 0"):
            ours._verify_param_shape_across_processes(None, [torch.empty(4 + rank)])
        return {"state": model.state_dict(), "kept": kept}

    with seeded(0):
        want = nn.Sequential(nn.Linear(3, 40), nn.BatchNorm1d(40), nn.Linear(40, 2)).state_dict()
    for result in run_ranks(body, 2, timeout=60.0):
        for key, value in want.items():
            if key == "2.bias":
                torch.testing.assert_close(result["state"][key], result["kept"], rtol=0, atol=0)
            elif key != "1.running_mean":
                torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0)
        torch.testing.assert_close(result["state"]["1.running_mean"], torch.zeros(40), rtol=0, atol=0)

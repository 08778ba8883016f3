"""Microbatches: split with default and custom chunk specs, nested arguments, merged back; sizes that don't
divide and specs that don't fit are refused naming the argument."""

from __future__ import annotations

import pytest
import torch

from spmd.pipelining.microbatch import TensorChunkSpec, _Replicate, merge_chunks, split_args_kwargs_into_chunks


def test_default_split_is_dim_0_for_tensors_and_whole_values_otherwise() -> None:
    x = torch.arange(12).reshape(6, 2)
    args, kwargs = split_args_kwargs_into_chunks((x, 3), {"pair": (x, "tag"), "d": {"m": x}}, 3)
    assert len(args) == len(kwargs) == 3
    for k in range(3):
        assert args[k][0].equal(x[2 * k:2 * k + 2]) and args[k][1] == 3
        assert kwargs[k]["pair"][0].equal(x[2 * k:2 * k + 2]) and kwargs[k]["pair"][1] == "tag"
        assert kwargs[k]["d"]["m"].equal(x[2 * k:2 * k + 2])


def test_custom_specs_split_other_dims_or_replicate() -> None:
    x = torch.arange(12).reshape(2, 6)
    args, kwargs = split_args_kwargs_into_chunks((x, x), {"mask": x}, 2, TensorChunkSpec.from_tuple((1, 0)),
                                                 {"mask": _Replicate()})
    assert args[1][0].equal(x[:, 3:]) and args[1][1].equal(x[1:]) and kwargs[1]["mask"] is x
    assert TensorChunkSpec.from_dict({"a": 1}) == {"a": TensorChunkSpec(1)}


def test_merge_inverts_split() -> None:
    x = torch.arange(24.0).reshape(4, 6)
    chunks = split_args_kwargs_into_chunks((x,), None, 2, (TensorChunkSpec(1),))[0]
    assert merge_chunks([c[0] for c in chunks], TensorChunkSpec(1)).equal(x)
    merged = merge_chunks([{"y": c[0], "n": 1} for c in split_args_kwargs_into_chunks((x,), None, 4)[0]])
    assert merged["y"].equal(x) and merged["n"] == 1
    with pytest.raises(ValueError, match="0-d tensor"):
        merge_chunks([torch.tensor(1.0), torch.tensor(2.0)])


@pytest.mark.parametrize("args, kwargs, args_spec, kwargs_spec, error, says", [
    ((torch.ones(6, 2),), None, None, None, ValueError, r"args\[0\]: dim 0 of size 6 doesn't divide into 4"),
    ((), {"m": torch.ones(4, 3)}, None, {"m": TensorChunkSpec(1)}, ValueError,
     r"kwargs\['m'\]: dim 1 of size 3 doesn't divide into 4"),
    ((torch.ones(4),), None, (TensorChunkSpec(0), TensorChunkSpec(0)), None, ValueError,
     r"chunk spec for args must be a tuple of 1 specs"),
    (("text",), None, (TensorChunkSpec(0),), None, TypeError, r"args\[0\] is TensorChunkSpec\(0\), but the value"),
    ((torch.ones(4),), None, (TensorChunkSpec(3),), None, ValueError, r"along dim 3"),
    ((), {"a": 1}, None, {"b": None}, ValueError, r"must be a dict with the keys \['a'\]"),
])
def test_bad_splits_name_the_argument(args: tuple, kwargs: dict | None, args_spec: object, kwargs_spec: object,
                                      error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        split_args_kwargs_into_chunks(args, kwargs, 4, args_spec, kwargs_spec)   # type: ignore[arg-type]

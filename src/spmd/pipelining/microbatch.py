"""Microbatches: split a step's inputs into equal microbatches, and merge the last stage's outputs back.

Layer: pipelining. Pure tensor slicing; nothing here communicates. Inputs are positional and keyword arguments,
nested in tuples, lists and dicts as the model takes them; a *chunk spec* mirrors that nesting and says, per
value, how to split it: `TensorChunkSpec(dim)` splits a tensor along `dim`, `_Replicate()` hands every
microbatch the whole value. Without a spec, tensors split along dim 0 and other values are replicated.

Note: equal microbatches
Every tensor must divide evenly into the microbatches. Each microbatch's loss is a mean over its own examples,
and the schedule scales each by 1 / n_microbatches (see schedules.py); that sum is the full batch's mean only
when the microbatches are the same size. torch's pipelining splits unevenly (torch.tensor_split) and its
gradients then differ from the full batch's; spmd refuses instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


class TensorChunkSpec:
    """Split a tensor along `split_dim` into the microbatches."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorChunkSpec) and other.split_dim == self.split_dim

    def __hash__(self) -> int:
        return hash(self.split_dim)

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> tuple[TensorChunkSpec, ...]:
        """One spec per positional argument: `TensorChunkSpec.from_tuple((0, 0, 1))`."""
        return tuple(TensorChunkSpec(dim) for dim in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: Mapping[str, int]) -> dict[str, TensorChunkSpec]:
        """One spec per keyword argument: `TensorChunkSpec.from_dict({"ids": 0, "mask": 1})`."""
        return {name: TensorChunkSpec(dim) for name, dim in chunk_dims.items()}


class _Replicate:
    """Give every microbatch the whole value (torch's spelling of the spec)."""

    def __repr__(self) -> str:
        return "_Replicate()"


def _split(value: Any, spec: Any, chunks: int, where: str) -> list[Any]:
    """`value` as `chunks` microbatches following `spec` (None: the default for its kind)."""
    if isinstance(spec, _Replicate) or spec is _Replicate:
        return [value] * chunks
    if isinstance(spec, TensorChunkSpec) or (spec is None and isinstance(value, Tensor)):
        return _split_tensor(value, spec or TensorChunkSpec(0), chunks, where)
    if isinstance(value, (tuple, list)):
        specs = _nested_specs(spec, len(value), where, type(value))
        parts = [_split(v, s, chunks, f"{where}[{i}]") for i, (v, s) in enumerate(zip(value, specs, strict=True))]
        return [type(value)(part[k] for part in parts) for k in range(chunks)]
    if isinstance(value, dict):
        if spec is not None and (not isinstance(spec, Mapping) or set(spec) != set(value)):
            raise ValueError(f"chunk spec for {where} must be a dict with the keys {sorted(value)}, got {spec!r}")
        parts = {k: _split(v, None if spec is None else spec[k], chunks, f"{where}[{k!r}]") for k, v in value.items()}
        return [{k: part[i] for k, part in parts.items()} for i in range(chunks)]
    if spec is None:
        return [value] * chunks
    raise TypeError(f"chunk spec for {where}: {spec!r} can't split a {type(value).__name__}; use "
                    f"TensorChunkSpec(dim) for tensors or _Replicate() for values every microbatch shares")


def _nested_specs(spec: Any, length: int, where: str, kind: type) -> Sequence[Any]:
    if spec is None:
        return [None] * length
    if not isinstance(spec, (tuple, list)) or len(spec) != length:
        raise ValueError(f"chunk spec for {where} must be a {kind.__name__} of {length} specs, got {spec!r}")
    return spec


def _split_tensor(tensor: Any, spec: TensorChunkSpec, chunks: int, where: str) -> list[Tensor]:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"chunk spec for {where} is {spec!r}, but the value is a {type(tensor).__name__}")
    if not -tensor.dim() <= spec.split_dim < max(tensor.dim(), 1):
        raise ValueError(f"{where}: can't split a tensor of shape {tuple(tensor.shape)} along dim {spec.split_dim}")
    size = tensor.size(spec.split_dim)
    if size % chunks:
        raise ValueError(f"{where}: dim {spec.split_dim} of size {size} doesn't divide into {chunks} microbatches; "
                         f"use a batch that is a multiple of {chunks} or another n_microbatches "
                         f"(see Note: equal microbatches)")
    return list(torch.chunk(tensor, chunks, dim=spec.split_dim))


def split_args_kwargs_into_chunks(args: tuple[Any, ...], kwargs: dict[str, Any] | None, chunks: int,
                                  args_chunk_spec: tuple[Any, ...] | None = None,
                                  kwargs_chunk_spec: dict[str, Any] | None = None,
                                  ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split positional and keyword arguments into `chunks` equal microbatches (see Note: equal microbatches).

    >>> args, kwargs = split_args_kwargs_into_chunks((torch.arange(4),), {"scale": 2}, 2)
    >>> args, kwargs
    ([(tensor([0, 1]),), (tensor([2, 3]),)], [{'scale': 2}, {'scale': 2}])
    """
    if chunks < 1:
        raise ValueError(f"n_microbatches must be at least 1, got {chunks}")
    return (_split(tuple(args), args_chunk_spec, chunks, "args"),
            _split(dict(kwargs or {}), kwargs_chunk_spec, chunks, "kwargs"))


def merge_chunks(chunks: list[Any], chunk_spec: Any = None) -> Any:
    """The inverse of splitting: concatenate the microbatches' tensors along their spec's dim (dim 0 without a
    spec); values that are not split (replicated, or non-tensors without a spec) come from the first chunk.

    >>> merge_chunks([(torch.ones(1, 2), "a"), (torch.zeros(1, 2), "a")])
    (tensor([[1., 1.],
            [0., 0.]]), 'a')
    """
    if not chunks:
        raise ValueError("merge_chunks: no chunks to merge")
    return _merge(chunks, chunk_spec, "output")


def _merge(chunks: list[Any], spec: Any, where: str) -> Any:
    first = chunks[0]
    if isinstance(spec, _Replicate) or spec is _Replicate:
        return first
    if isinstance(spec, TensorChunkSpec) or (spec is None and isinstance(first, Tensor)):
        if not all(isinstance(c, Tensor) for c in chunks):
            raise TypeError(f"merge: {where} is a tensor in some microbatches only")
        if first.dim() == 0:
            raise ValueError(f"merge: {where} is a 0-d tensor (one per microbatch); give it the spec _Replicate() "
                             f"or reduce it yourself")
        return torch.cat(chunks, dim=(spec or TensorChunkSpec(0)).split_dim)
    if isinstance(first, (tuple, list)):
        specs = _nested_specs(spec, len(first), where, type(first))
        return type(first)(_merge([c[i] for c in chunks], s, f"{where}[{i}]") for i, s in enumerate(specs))
    if isinstance(first, dict):
        return {k: _merge([c[k] for c in chunks], None if spec is None else spec[k], f"{where}[{k!r}]")
                for k in first}
    return first

"""Random ops on DTensors: in-place initialisers (uniform_, normal_, ...), *_like factories, bernoulli and
dropout, drawing the numbers of the one-process run (see spmd.tensor.random).

Layer: tensor. Handlers: each generates the GLOBAL values from the rank's generator and keeps this rank's piece.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, ops
from torch._ops import OpOverload

from spmd.tensor.dispatch import local_as
from spmd.tensor.placement import Partial, Replicate
from spmd.tensor.random import get_generator
from spmd.tensor.rules import register_handler

aten = ops.aten


def _full_args(values: tuple | dict, mesh_ndim: int) -> Any:
    """Arguments with every DTensor replaced by its full (replicated) local value."""
    def full(value: Any) -> Any:
        if hasattr(value, "_spec"):
            return local_as(value, (Replicate(),) * mesh_ndim)
        return value
    if isinstance(values, dict):
        return {k: full(v) for k, v in values.items()}
    return tuple(full(v) for v in values)


def _with_generator(kwargs: dict, device: torch.device) -> dict:
    """kwargs with this rank's generator for `device`, unless the caller passed one (or none is seeded)."""
    generator = get_generator(device)
    if kwargs.get("generator") is None and generator is not None:
        return {**kwargs, "generator": generator}
    return kwargs


@register_handler(aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
                  aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
                  aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default)
def _random_inplace(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """self.<dist>_(...): fill a full-size tensor, keep this rank's piece (Partial: the partitioned value)."""
    self = args[0]
    spec = self._spec
    full = torch.empty(spec.shape, dtype=spec.dtype, device=self._local_tensor.device)
    op(full, *_full_args(args[1:], spec.mesh.ndim), **_with_generator(_full_args(kwargs, spec.mesh.ndim), full.device))
    self._local_tensor.copy_(spec.local_from_full(full))
    return self


# The *_like factories have no generator argument; each is the in-place fill of a fresh tensor (as torch itself
# implements rand = empty().uniform_(), ...), which takes one and draws the same numbers.
_LIKE_FILLS = {
    aten.rand_like.default: lambda t, args, g: t.uniform_(0, 1, generator=g),
    aten.randn_like.default: lambda t, args, g: t.normal_(0, 1, generator=g),
    aten.randint_like.default: lambda t, args, g: t.random_(0, args[1], generator=g),
    aten.randint_like.low_dtype: lambda t, args, g: t.random_(args[1], args[2], generator=g),
}


@register_handler(*_LIKE_FILLS)
def _random_like(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """A fresh random tensor shaped like the input, laid out like it (Partial -> Replicate)."""
    like = args[0]
    spec = like._spec
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    full = torch.empty(spec.shape, dtype=kwargs.get("dtype") or spec.dtype, device=like._local_tensor.device)
    _LIKE_FILLS[op](full, args, get_generator(full.device))
    out_spec = type(spec)(spec.mesh, placements, full.shape, full.stride(), full.dtype)
    return type(like)._wrap_local(out_spec.local_from_full(full), out_spec)


@register_handler(aten.bernoulli.default, aten.bernoulli.p)
def _bernoulli(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """torch.bernoulli(probabilities): drawn for the global tensor, laid out like the input (Partial ->
    Replicate: the probabilities are reduced first)."""
    like = args[0]
    spec = like._spec
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    device = like._local_tensor.device
    full = op(*_full_args(args, spec.mesh.ndim), **_with_generator(_full_args(kwargs, spec.mesh.ndim), device))
    out_spec = type(spec)(spec.mesh, placements, full.shape, full.stride(), full.dtype)
    return type(like)._wrap_local(out_spec.local_from_full(full), out_spec)


@register_handler(aten.native_dropout.default)
def _dropout(op: OpOverload, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
    """(output, mask) = native_dropout(x, p, train): the mask is drawn for the global shape (as one process
    would), and is laid out like x (Partial -> Replicate); output = x * mask / (1 - p) stays in x's layout."""
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    spec = x._spec
    cls = type(x)
    mask_placements = tuple(Replicate() if isinstance(q, Partial) else q for q in spec.placements)
    mask_spec = type(spec)(spec.mesh, mask_placements, spec.shape, spec.stride, torch.bool)
    if train is False:
        return cls._wrap_local(x._local_tensor.clone(), spec), cls._wrap_local(
            torch.ones(x._local_tensor.shape, dtype=torch.bool, device=x._local_tensor.device), mask_spec)
    keep = 1.0 - p
    device = x._local_tensor.device
    mask_full = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    mask_full.bernoulli_(keep, generator=get_generator(device))
    mask_local = mask_spec.local_from_full(mask_full)
    scale = 0.0 if keep == 0 else 1.0 / keep
    out_local = x._local_tensor.mul(mask_local).mul_(scale)
    return cls._wrap_local(out_local, spec), cls._wrap_local(mask_local.bool(), mask_spec)


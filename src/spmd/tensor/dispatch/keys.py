"""Walking a call's arguments: the cache-key form of each, the rule's view (specs for DTensors), the meta view
(for output shapes) and the local view (local tensors for DTensors).

Layer: tensor. Pure; no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from spmd.tensor.spec import DTensorSpec


def key_of(value: Any, dtensor_type: type, dtensors: list, plain: list) -> Any:
    """The cache-key form of one argument; collects DTensors and plain tensors in order."""
    if isinstance(value, dtensor_type):
        dtensors.append(value)
        return value._spec
    if isinstance(value, (list, tuple)):
        return tuple(key_of(item, dtensor_type, dtensors, plain) for item in value)
    if isinstance(value, Tensor):
        plain.append(value)
        return (Tensor, value.shape, value.dtype, value.device)
    if isinstance(value, (bool, int, float, complex)):
        return (type(value), value)
    return value


def substitute(value: Any, dtensor_type: type, spec_type: type, locals_: Iterator[Tensor],
                plain: Iterator[Tensor]) -> Any:
    """`value` with each DTensor (or DTensorSpec) replaced by the next local tensor, and each plain tensor by the
    next plain tensor of this call."""
    if isinstance(value, (dtensor_type, spec_type)):
        return next(locals_)
    if isinstance(value, (list, tuple)):
        return type(value)(substitute(item, dtensor_type, spec_type, locals_, plain) for item in value)
    if isinstance(value, Tensor):
        return next(plain)
    return value


def schema_form(value: Any, dtensor_type: type) -> Any:
    """`value` with every DTensor (also inside lists/tuples) replaced by its spec: what rules see."""
    if isinstance(value, dtensor_type):
        return value._spec
    if isinstance(value, (list, tuple)):
        return type(value)(schema_form(item, dtensor_type) for item in value)
    return value


def meta_form(value: Any) -> Any:
    """`value` with specs and tensors replaced by meta tensors, to infer output shapes without computing."""
    if isinstance(value, DTensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(meta_form(item) for item in value)
    if isinstance(value, Tensor):
        return value.to("meta")
    return value

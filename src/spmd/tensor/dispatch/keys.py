"""Walking a call's arguments: the cache-key form of each, the rule's view (specs for DTensors), the meta view
(for output shapes) and the local view (local tensors for DTensors).

Layer: tensor. Pure; no communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._ops import OpOverload

from spmd.tensor.dispatch.signature import INT_LIST_ARGS, int_list_args
from spmd.tensor.rules import numbers_by_value
from spmd.tensor.spec import DTensorSpec

_NUMBERS = (bool, int, float)


def call_key(op: OpOverload, args: tuple, kwargs: dict, dtensor_type: type) -> tuple[tuple, list, list[Tensor]]:
    """The cache key of one call (see Note: the dispatch fast path), and its DTensors and plain tensors in order
    (positional args, then kwargs, entering lists). One pass; the flat forms most calls have are handled inline:
    DTensors, Python numbers, `int[]` arguments, lists of DTensors (foreach operands), None and dtypes."""
    dtensors: list = []
    plain: list[Tensor] = []
    key: list[Any] = [op._op]       # the op by its C callable: an OpOverload hashes in Python, per lookup
    by_value = int_lists = None
    for index, value in enumerate(args):
        kind = type(value)
        if kind is dtensor_type:
            dtensors.append(value)
            key.append(value._spec)
        elif kind in _NUMBERS:
            if by_value is None:
                by_value = numbers_by_value(op)
            key.append((kind, value) if by_value else kind)
        elif kind is list or kind is tuple:
            if int_lists is None:
                int_lists = INT_LIST_ARGS.get(op._op)
                if int_lists is None:
                    int_lists = int_list_args(op)
            if index in int_lists:
                key.append((list, *value))
            else:
                if by_value is None:
                    by_value = numbers_by_value(op)
                key.append(_list_key(value, dtensor_type, dtensors, plain, by_value))
        elif value is None or kind is _DTYPE:
            key.append(value)
        else:
            key.append(key_of(value, dtensor_type, dtensors, plain, numbers_by_value(op)))
    if kwargs:
        if by_value is None:
            by_value = numbers_by_value(op)
        for name, value in kwargs.items():
            key.append(name)
            kind = type(value)
            if kind in _NUMBERS:
                key.append((kind, value) if by_value else kind)
            elif value is None or kind is _DTYPE or kind is str:
                key.append(value)
            else:
                key.append(key_of(value, dtensor_type, dtensors, plain, by_value))
    return tuple(key), dtensors, plain


_DTYPE = torch.dtype


def _list_key(value: list | tuple, dtensor_type: type, dtensors: list, plain: list[Tensor], by_value: bool) -> Any:
    """key_of for a list that is not an `int[]` argument; a list of DTensors (a foreach operand) or of Python
    numbers (a Scalar[], an optimizer's per-parameter step sizes) in one pass, with key_of's key."""
    if value:
        first = type(value[0])
        if first is dtensor_type:
            specs = [item._spec for item in value if type(item) is dtensor_type]
            if len(specs) == len(value):
                dtensors.extend(value)
                return tuple(specs)
        elif first in _NUMBERS:
            kinds = [type(item) for item in value]
            if _NUMBER_TYPES.issuperset(kinds):
                return tuple(zip(kinds, value)) if by_value else tuple(kinds)
    return key_of(value, dtensor_type, dtensors, plain, by_value)


_NUMBER_TYPES = frozenset(_NUMBERS)


def key_of(value: Any, dtensor_type: type, dtensors: list, plain: list[Tensor], by_value: bool) -> Any:
    """The cache-key form of one argument; collects DTensors and plain tensors in order. Python numbers are
    keyed with their type (1 and 1.0 differ), by type alone when not `by_value`."""
    if isinstance(value, dtensor_type):
        dtensors.append(value)
        return value._spec if type(value) is dtensor_type else (type(value), value._spec)
    if isinstance(value, (list, tuple)):
        return tuple([key_of(item, dtensor_type, dtensors, plain, by_value) for item in value])
    if isinstance(value, Tensor):
        plain.append(value)
        return (Tensor, value.shape, value.dtype, value.device)
    if isinstance(value, (bool, int, float, complex)):
        return (type(value), value) if by_value else type(value)
    return value


def substitute(value: Any, dtensor_type: type, spec_type: type, locals_: Iterator[Tensor],
                plain: Iterator[Tensor]) -> Any:
    """`value` with each DTensor (or DTensorSpec) replaced by the next local tensor, and each plain tensor by the
    next plain tensor of this call."""
    if isinstance(value, (dtensor_type, spec_type)):
        return next(locals_)
    if isinstance(value, (list, tuple)):
        if value and type(value[0]) in (dtensor_type, spec_type):          # a foreach operand
            return type(value)([next(locals_) for _ in value])
        return type(value)([substitute(item, dtensor_type, spec_type, locals_, plain) for item in value])
    if isinstance(value, Tensor):
        return next(plain)
    return value


def schema_form(value: Any, dtensor_type: type) -> Any:
    """`value` with every DTensor (also inside lists/tuples, and the values of a kwargs dict) replaced by its
    spec: what rules see."""
    if isinstance(value, dtensor_type):
        return value._spec
    if isinstance(value, (list, tuple)):
        return type(value)(schema_form(item, dtensor_type) for item in value)
    if isinstance(value, dict):
        return {name: schema_form(item, dtensor_type) for name, item in value.items()}
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

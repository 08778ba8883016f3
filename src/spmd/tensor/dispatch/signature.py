"""What an aten op's schema tells dispatch: the arguments it writes, the outputs that alias them, its
functional overload (for out= variants) and its `int[]` arguments (for the cache key).

Layer: tensor. Read once per op and cached; no tensor data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._ops import OpOverload


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What the op's schema says about mutation: which arguments it writes and what its outputs alias."""

    mutated_args: frozenset[int]                 # positional indices written in place
    mutated_kwargs: frozenset[str]
    returns_mutated: tuple[int | str, ...] | None  # per output, the written argument it returns; None: fresh
    out_args: tuple[str, ...] = ()               # an out= variant's output arguments (keyword-only, returned)
    returns_view: bool = False                   # its outputs alias an input without writing it (a view op)


_OP_INFO: dict[OpOverload, OpInfo] = {}


def op_info(op: OpOverload) -> OpInfo:
    info = _OP_INFO.get(op)
    if info is None:
        schema = op._schema
        written: dict[str, int | str] = {}
        mutated_args, mutated_kwargs = set(), set()
        positional = 0
        for argument in schema.arguments:
            alias = argument.alias_info
            is_written = alias is not None and alias.is_write
            where: int | str = argument.name if argument.kwarg_only else positional
            if not argument.kwarg_only:
                positional += 1
            if is_written:
                (mutated_kwargs if argument.kwarg_only else mutated_args).add(where)
                for name in alias.before_set:
                    written[name] = where
        returns = []
        for ret in schema.returns:
            alias = ret.alias_info
            if alias is not None and alias.is_write:
                returns.append(next(written[name] for name in alias.before_set))
            else:
                returns.append(None)
        returns_mutated = tuple(returns) if returns and all(r is not None for r in returns) else None
        out_args = tuple(r for r in returns_mutated or () if isinstance(r, str))
        is_out = bool(out_args) and len(out_args) == len(returns) and set(out_args) == mutated_kwargs
        views = bool(schema.returns) and all(ret.alias_info is not None and not ret.alias_info.is_write
                                             for ret in schema.returns)
        info = OpInfo(frozenset(mutated_args), frozenset(mutated_kwargs), returns_mutated,
                       out_args if is_out and not mutated_args else (), views)
        _OP_INFO[op] = info
    return info


_FUNCTIONAL: dict[OpOverload, OpOverload | None] = {}


def functional_of(op: OpOverload, out_args: tuple[str, ...]) -> OpOverload | None:
    """The functional overload of an out= op (maximum.out -> maximum.default): same name, the same arguments
    without the outputs, nothing written. None if there is none."""
    if op not in _FUNCTIONAL:
        wanted = [(a.name, str(a.type)) for a in op._schema.arguments if a.name not in out_args]
        packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
        found = None
        for name in packet.overloads() if packet is not None else ():
            candidate = getattr(packet, name)
            arguments = candidate._schema.arguments
            if ([(a.name, str(a.type)) for a in arguments] == wanted
                    and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments)):
                found = candidate
                break
        _FUNCTIONAL[op] = found
    return _FUNCTIONAL[op]


def mutated_positions(op: OpOverload, args: tuple, kwargs: dict, dtensor_type: type) -> set[int]:
    """Indices (in input_specs order) of the DTensor inputs the op writes in place."""
    info = op_info(op)
    positions: set[int] = set()
    counter = [0]

    def walk(value: Any, written: bool) -> None:
        if isinstance(value, dtensor_type):
            if written:
                positions.add(counter[0])
            counter[0] += 1
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, written)

    for index, value in enumerate(args):
        walk(value, index in info.mutated_args)
    for name, value in kwargs.items():
        walk(value, name in info.mutated_kwargs)
    return positions


INT_LIST_ARGS: dict[Any, frozenset[int]] = {}      # by op._op, hashed in C (an OpOverload's hash is a Python call)


def int_list_args(op: OpOverload) -> frozenset[int]:
    """Positions of the op's `int[]` arguments (sizes, dims). The dispatcher hands them to __torch_dispatch__ as
    lists of Python ints, so their cache key can be `(list, *value)` with no per-item type check (a Scalar[]
    argument, whose 1 and 1.0 differ, is keyed item by item)."""
    found = INT_LIST_ARGS.get(op._op)
    if found is None:
        positional = [a for a in op._schema.arguments if not a.kwarg_only]
        found = frozenset(k for k, a in enumerate(positional) if str(a.type) in ("List[int]", "Optional[List[int]]"))
        INT_LIST_ARGS[op._op] = found
    return found

"""`local_map`: run a function written for plain tensors on DTensors' local shards, and wrap what it returns as
DTensors with the placements the caller states (torch's `local_map`).

Layer: tensor. No communication of its own: inputs are redistributed only when asked (`redistribute_inputs`),
and `func` may communicate itself (an all-reduce of a partial matmul). The caller vouches for the output
placements; nothing checks that the local results really are laid out that way (as in torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

from spmd.device_mesh import DeviceMesh
from spmd.tensor.api import DTensor
from spmd.tensor.placement import Placement

__all__ = ["local_map"]

PlacementType = Sequence[Placement] | None
InputPlacements = tuple[PlacementType, ...] | None
OutputPlacements = PlacementType | tuple[PlacementType, ...]


def local_map(func: Callable | None = None, out_placements: OutputPlacements = None,
              in_placements: InputPlacements = None, in_grad_placements: InputPlacements = None,
              device_mesh: DeviceMesh | None = None, *, redistribute_inputs: bool = False) -> Callable:
    """`func` made to take DTensors: each DTensor argument becomes its local tensor, `func` runs, and each tensor
    it returns becomes a DTensor on `device_mesh` (default: the first DTensor argument's) with `out_placements`.

    `in_placements` (one entry per flattened positional argument; None for non-tensors) is what each DTensor
    argument must be placed as: a mismatch raises, or is redistributed with `redistribute_inputs=True`.
    `in_grad_placements` are the layouts of the local inputs' gradients, given to `to_local(grad_placements=)`.
    `out_placements` holds one entry per flattened output (a placements sequence for a tensor, None for
    anything else); a single output takes a bare placements sequence. Called without DTensor arguments, the
    result is `func`'s own, unwrapped. Without `func`, returns a decorator.
    """
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    call = functools.partial(_call_local, func, out_placements, in_placements, in_grad_placements, device_mesh,
                             redistribute_inputs)
    return functools.wraps(func)(call)


def _call_local(func: Callable, out_placements: OutputPlacements, in_placements: InputPlacements,
                in_grad_placements: InputPlacements, device_mesh: DeviceMesh | None, redistribute_inputs: bool,
                *args: Any, **kwargs: Any) -> Any:
    name = f"local_map({getattr(func, '__qualname__', func)})"
    flat_args, args_spec = pytree.tree_flatten(args)
    for label, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat_args):
            raise ValueError(f"{name}: {label} has {len(given)} entries for {len(flat_args)} flattened "
                             f"positional arguments; give one per argument (None for a non-tensor)")
    local_args: list[Any] = []
    mesh = device_mesh
    saw_dtensor = False
    for index, arg in enumerate(flat_args):
        if isinstance(arg, DTensor):
            saw_dtensor = True
            mesh = arg.device_mesh if mesh is None else mesh
            local_args.append(_local_input(name, index, arg, in_placements, in_grad_placements,
                                           redistribute_inputs))
            continue
        if in_placements is not None and not isinstance(arg, Tensor) and in_placements[index] is not None:
            raise ValueError(f"{name}: argument {index} is a {type(arg).__name__}, not a tensor, but "
                             f"in_placements[{index}] is {in_placements[index]}; give None for it")
        local_args.append(arg)
    out = func(*pytree.tree_unflatten(local_args, args_spec), **kwargs)
    if not saw_dtensor:
        return out
    assert mesh is not None
    flat_out, out_spec = pytree.tree_flatten(out)
    placements = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(flat_out) != len(placements):
        raise ValueError(f"{name}: out_placements has {len(placements)} entries but the function returned "
                         f"{len(flat_out)} values (flattened); give one per value (None for a non-tensor)")
    wrapped = [_wrap_output(name, position, value, spec, mesh)
               for position, (value, spec) in enumerate(zip(flat_out, placements, strict=True))]
    return pytree.tree_unflatten(wrapped, out_spec)


def _local_input(name: str, index: int, arg: DTensor, in_placements: InputPlacements,
                 in_grad_placements: InputPlacements, redistribute_inputs: bool) -> Tensor:
    """The local tensor `func` receives for DTensor argument `index`, after checking (or redistributing) it."""
    if in_placements is not None:
        wanted = in_placements[index]
        if wanted is None:
            raise ValueError(f"{name}: argument {index} is a DTensor but in_placements[{index}] is None; give "
                             f"the placements the function expects it in")
        wanted = tuple(wanted)
        if arg.placements != wanted:
            if not redistribute_inputs:
                raise ValueError(f"{name}: argument {index} is placed {arg.placements} but in_placements asks "
                                 f"for {wanted}; redistribute it first, or pass redistribute_inputs=True")
            arg = arg.redistribute(placements=wanted)
    if in_grad_placements is None:
        return arg.to_local()
    grad = in_grad_placements[index]
    if grad is None:
        raise ValueError(f"{name}: argument {index} is a DTensor but in_grad_placements[{index}] is None; give "
                         f"its gradient's placements")
    return arg.to_local(grad_placements=tuple(grad))


def _wrap_output(name: str, position: int, value: Any, placements: PlacementType, mesh: DeviceMesh) -> Any:
    if not isinstance(value, Tensor):
        if placements is not None:
            raise ValueError(f"{name}: output {position} is a {type(value).__name__}, not a tensor, but "
                             f"out_placements gives it {placements}; give None for it")
        return value
    if isinstance(value, DTensor):
        raise TypeError(f"{name}: output {position} is already a DTensor; the function must return local "
                        f"(plain) tensors, which local_map wraps")
    if placements is None:
        raise ValueError(f"{name}: output {position} is a tensor but out_placements gives it None; give its "
                         f"placements")
    return DTensor.from_local(value, mesh, tuple(placements), run_check=False)
